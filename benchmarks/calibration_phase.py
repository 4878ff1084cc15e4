"""`recdepth report`'s calibration phase alone (recdepth/report.py, step 1): the 20 (rule,
target) searches of conf/report.yaml in lockstep on the calibration split, timed; with
`--no-memo` every ask is decoded anew (the split's memory of decoded settings off), the
A/B in docs/journal.md (2026-11-26, calibration decodes each setting once). Prints the wall time, the settings decoded and reused, and each
search's answer (rule, target, calibrated value, patience, decodes, CE, cost).

    python benchmarks/calibration_phase.py <last.ckpt> <gate.pt> <calibration tokens> [--no-memo] [overrides ...]

<gate.pt>: a gate of `recdepth train_gate` (or the one `recdepth report` fitted, <out>/gate/gate.pt).
Run it from a checkout (or with that checkout on PYTHONPATH) to time that checkout's code.
"""

import sys
import time

import torch
from hydra import compose, initialize_config_dir

from recdepth.config.build import conf_dir
from recdepth.config.schema import validated
from recdepth.core.runtime import tune_cpu_allocator
from recdepth.exits import build
from recdepth.app.calibration import (
    CalibrationSplit,
    calibrate_many,
    calibration_split,
    load_splits,
)
from recdepth.exits.gate import load_gate
from recdepth.report import calibration_searches


def main(argv: list[str]) -> None:
    ckpt, gate_path, tokens, *rest = argv
    memo = "--no-memo" not in rest
    overrides = [a for a in rest if a != "--no-memo"]
    if not memo:  # every ask a key of its own: nothing answered from memory
        CalibrationSplit._key = staticmethod(lambda p: object())
    tune_cpu_allocator()
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("report", overrides=[f"ckpt={ckpt}", f"calibration.tokens={tokens}", "run_dir=.", *overrides])
    run = validated(cfg)
    r, c = run.report, run.calibration
    opened, _, _, cal_tokens, labels = load_splits(run)
    model, n = opened.model, r.max_steps
    gate = load_gate(gate_path)[:2]
    t0 = time.perf_counter()
    split = calibration_split(run, model, cal_tokens, labels["calibration"], bos=opened.bos)
    ce_ref = float(split.decode(build("fixed", None, max_steps=n))["nll"].mean())
    _, searches = calibration_searches(run, opened, gate)
    found = calibrate_many(split, searches, c.per_group, c.max_evals, ce_ref, r.shared_rows)
    print(f"memory {'on' if memo else 'off'}: {time.perf_counter() - t0:.1f} s, {torch.get_num_threads()} threads, "
          f"{split.decodes} settings decoded, {split.reused} asks answered from memory")
    for (base, target), (p, res, _, _) in zip(searches, found, strict=True):
        value = p.max_steps if p.name == "fixed" else p.tau
        print(base.name, target.kind, value, p.patience, len(res.history), f"{res.best.ce:.6f} {res.best.cost:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
