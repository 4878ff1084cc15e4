"""`python -m recdepth.calibrate ckpt=<path> exit=accel target.max_ce_increase=0.01`: per-group
exit thresholds searched to a target on a calibration split, then one evaluation on the test
split (docs/spec.md §4c; the search is `recdepth.calibration`).

    python -m recdepth.calibrate ckpt=<run>/train/checkpoints/last.ckpt exit=accel target.max_ce_increase=0.01
    python -m recdepth.calibrate ckpt=<run>/train/checkpoints/last.ckpt exit=kl target.applications=8

Splits, both from the checkpoint's val split and never overlapping: the **test** split is
what `recdepth.evaluate` scores, val tokens [0, eval.tokens]; the **calibration** split
follows it, val tokens [eval.tokens + 1, eval.tokens + 1 + calibration.tokens]. Every
candidate setting is decoded for real on the calibration split (exact engine, batched).

Targets (set exactly one): `target.max_ce_increase` δ, CE at most δ nats above `fixed` at
exit.max_steps; `target.applications` B, mean applications per token at most B. The run
directory gets:
    calibration.json    the answer, the exit override line, calibration and test numbers
    calibration.csv     every setting decoded on the calibration split (per-group values, CE, A)
    calibration_tokens.csv  the answer's per-token record on the calibration split
                        (position = offset in the val split)
    exit.yaml           the calibrated `exit` group, the same as the override line
    eval_tokens.csv     the answer's per-token record on the test split (as recdepth.evaluate)
The override line (`exit=accel exit.tau=[...] ...`) runs the calibrated rule in
`recdepth.evaluate` and `recdepth.train`.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import calibration, stats
from recdepth.checkpoints import heldout_tokens, load_checkpoint, resolve_device
from recdepth.cli import guarded, run_hydra_main
from recdepth.config import conf_dir, exit_policy
from recdepth.decoding import evaluate_exit
from recdepth.evaluate import run_eval
from recdepth.exits import ExitPolicy, build
from recdepth.runs import write_json
from recdepth.schema import validated

log = logging.getLogger("recdepth.calibrate")


def splits(n_test: int, n_cal: int) -> dict[str, tuple[int, int]]:
    """The val-split token ranges [first, last] (inclusive) of the test and calibration
    streams: test scores targets 1..n_test of [0, n_test]; calibration starts after it."""
    test = (0, n_test)
    cal = (n_test + 1, n_test + 1 + n_cal)
    if not test[1] < cal[0]:
        raise AssertionError(f"calibration split {cal} overlaps the test split {test}")
    return {"test": test, "calibration": cal}


def policy_at(base: ExitPolicy, field: str, values: list) -> ExitPolicy:
    """`base` with its calibrated field set: one value if every group has the same, else a
    list of one per group."""
    v = values[0] if len(set(values)) == 1 else tuple(values)
    return dataclasses.replace(base, **{field: v})


def overrides(p: ExitPolicy, gate: str | None = None) -> str:
    """The command-line overrides that select policy `p` (every field, so nothing is
    inherited from the rule's yaml)."""
    def fmt(v):
        return "[" + ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) + "]" \
            if isinstance(v, tuple) else (f"{v:g}" if isinstance(v, float) else str(v))

    parts = [f"exit={p.name}", f"exit.tau={'null' if p.tau is None else fmt(p.tau)}",
             f"exit.min_steps={fmt(p.min_steps)}", f"exit.max_steps={fmt(p.max_steps)}", f"exit.patience={p.patience}"]
    if gate:
        parts.append(f"exit.gate={gate}")
    return " ".join(parts)


def exit_group(p: ExitPolicy, gate: str | None = None) -> dict:
    """The `exit` group of policy p as plain data (exit.yaml)."""
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    d = {"name": p.name, "tau": plain(p.tau), "min_steps": plain(p.min_steps), "max_steps": plain(p.max_steps),
         "patience": p.patience}
    if gate:
        d["gate"] = gate
    return d


class CalibrationSplit:
    """Decodes a policy on the calibration tokens for real; remembers what it decoded."""

    def __init__(self, model, tokens: torch.Tensor, n_tokens: int, seed: int, cache: str, batch_size: int,
                 warm_start: bool = False):
        self.model, self.tokens, self.n_tokens = model, tokens, n_tokens
        self.seed, self.cache, self.batch_size, self.warm_start = seed, cache, batch_size, warm_start
        self.seconds = 0.0

    def decode(self, policy: ExitPolicy) -> dict:
        t0 = time.perf_counter()
        _, rec = evaluate_exit(self.model, self.tokens, policy, self.n_tokens, warmup_tokens=0, seed=self.seed,
                               cache=self.cache, batch_size=self.batch_size, latency_tokens=0,
                               warm_start=self.warm_start)
        self.seconds += time.perf_counter() - t0
        return rec


def calibrate_policy(split: CalibrationSplit, base: ExitPolicy, target: calibration.Target, per_group: bool,
                     max_evals: int, ce_ref: float | None = None) -> tuple[ExitPolicy, calibration.Result, dict, list]:
    """Search `base`'s knob (`calibration.knob`) to `target` on the calibration split.
    Returns the calibrated policy, the search result, its per-token record there and the
    rows of calibration.csv. `ce_ref` (CE of fixed at max_steps there) is computed if not given."""
    G = split.model.n_groups
    field, grid = calibration.knob(base.name, base.max_steps_bound)
    groups = G if (per_group and field != "patience") else 1
    if ce_ref is None:
        ce_ref = float(split.decode(build("fixed", None, max_steps=base.max_steps))["nll"].mean())
    records = {}

    def at(setting):
        return policy_at(base, field, [grid[i] for i in setting])

    def evaluate(setting):
        rec = split.decode(at(setting))
        records[setting] = rec
        return rec["nll"], rec["apps"]

    res = calibration.search(evaluate, len(grid), groups, target, ce_ref, per_group=groups > 1, max_evals=max_evals)
    rows = [{"field": field, "values": [grid[i] for i in p.setting], "ce": p.ce, "ce_increase": p.ce - ce_ref,
             "applications": p.applications, "per_group": list(p.per_group),
             "meets": calibration.meets(p, target, ce_ref)} for p in res.history]
    return at(res.best.setting), res, records[res.best.setting], rows


def target_of(cfg: DictConfig) -> calibration.Target:
    """The one target set in cfg.target (one line naming the fields otherwise)."""
    t = {k: v for k, v in OmegaConf.to_container(cfg.target).items() if v is not None}
    if len(t) != 1:
        raise ValueError(f"target: set exactly one of target.max_ce_increase=<nats> or target.applications=<mean "
                         f"applications per token>, got {t or 'none'}")
    (kind, value), = t.items()
    return calibration.Target(kind, value)


def verdict(lo: float, hi: float, bound: float) -> str:
    """Whether a test quantity's 95% interval is below a target bound (held), above it
    (violated), or straddles it (not resolved)."""
    return "held" if hi <= bound else "violated" if lo > bound else "not resolved"


def test_check(target: calibration.Target, rec: dict, ref_nll: np.ndarray | None, resamples: int = 1000) -> dict:
    """The target on the test split with its paired 95% bootstrap interval over tokens."""
    idx = stats.bootstrap_indices(len(rec["nll"]), resamples)
    if target.kind == "max_ce_increase":
        d, lo, hi = stats.diff_ci(rec["nll"], ref_nll, idx)
        return {"ce_increase": d, "ce_increase_ci": [lo, hi], "bound": target.value,
                "verdict": verdict(lo, hi, target.value)}
    a, lo, hi = stats.mean_ci(np.asarray(rec["apps"], float).mean(axis=1), idx)
    return {"applications": a, "applications_ci": [lo, hi], "bound": target.value,
            "verdict": verdict(lo, hi, target.value)}


def load_splits(cfg: DictConfig):
    """cfg.ckpt's module on cfg.device, the split ranges (`splits`), and the test and
    calibration token streams (val tokens [0, eval.tokens] and the calibration.tokens + 1
    after them; one line naming calibration.tokens if the val split is too short)."""
    module, data = load_checkpoint(cfg.ckpt, resolve_device(cfg.device))
    c = cfg.calibration
    sp = splits(cfg.eval.tokens, c.tokens)
    try:
        cal_tokens = heldout_tokens(module, data, c.tokens + 1, cfg.seed, start=sp["calibration"][0])
    except ValueError as e:
        raise ValueError(f"calibration.tokens: {c.tokens} calibration tokens after the {cfg.eval.tokens + 1} test "
                         f"tokens do not fit the checkpoint's val split ({e})") from None
    return module, sp, heldout_tokens(module, data, cfg.eval.tokens + 1, cfg.seed), cal_tokens


def calibrate(cfg: DictConfig) -> dict:
    """Calibrate cfg.exit on the calibration split to cfg.target, evaluate the answer once on
    the test split; write and return calibration.json's dict."""
    try:
        run_dir = Path(cfg.run_dir)
    except Exception:
        raise ValueError("run_dir: set run_dir=<directory> when calling calibrate(cfg) outside Hydra") from None
    validated(cfg)
    base = exit_policy(cfg)
    target = target_of(cfg)
    if base.name == "oracle":
        raise ValueError("exit.name: the oracle reads the target token; there is nothing to calibrate")
    if (run_dir / "calibration.json").exists():
        raise FileExistsError(f"run_dir: {run_dir} already holds calibration.json; choose a new run_dir")
    module, sp, test_tokens, cal_tokens = load_splits(cfg)
    model, c = module.model, cfg.calibration
    base.check_groups(model.n_groups)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    split = CalibrationSplit(model, cal_tokens, c.tokens, cfg.seed, cfg.eval.cache, c.batch_size,
                             cfg.eval.warm_start)
    t0 = time.perf_counter()
    policy, res, cal_rec, rows = calibrate_policy(split, base, target, c.per_group, c.max_evals)
    search_s = time.perf_counter() - t0
    gate = OmegaConf.select(cfg, "exit.gate")
    line = overrides(policy, gate)
    log.info("calibrated on %d tokens in %d decodes (%.0f s): %s (CE %+.4f vs fixed-%s, %.2f applications)%s",
             c.tokens, len(res.history), search_s, line, res.best.ce - res.ce_ref, base.max_steps,
             res.best.applications, "" if res.met else " -- the target is NOT met on the calibration split")

    off, v2g = sp["calibration"][0], module.vocab_to_gpt2
    gpt2 = cal_rec["target"] if v2g is None else v2g.cpu().numpy()[cal_rec["target"]]
    stats.write_tokens(run_dir / "calibration_tokens.csv", cal_rec["window"], cal_rec["position"] + off,
                       cal_rec["target"], gpt2, cal_rec["nll"], cal_rec["apps"])
    _write_rows(run_dir / "calibration.csv", rows)
    (run_dir / "exit.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(exit_group(policy, gate))))
    (run_dir / "exit_overrides.txt").write_text(line + "\n")

    ev = run_eval(model, test_tokens, policy, cfg, run_dir, module.vocab_to_gpt2)
    test_rec = stats.read_tokens(run_dir / "eval_tokens.csv")
    ref_nll = None
    if target.kind == "max_ce_increase":  # the test split's own full-depth reference, paired per token
        _, ref = evaluate_exit(model, test_tokens, build("fixed", None, max_steps=base.max_steps), cfg.eval.tokens,
                               warmup_tokens=0, seed=cfg.seed, cache=cfg.eval.cache,
                               batch_size=cfg.eval.batch_size, latency_tokens=0, warm_start=cfg.eval.warm_start)
        ref_nll = ref["nll"]
    held = test_check(target, test_rec, ref_nll)
    out = {
        "ckpt": str(Path(cfg.ckpt).resolve()), "groups": module.config.groups,
        "target": {"kind": target.kind, "value": target.value},
        "exit": exit_group(policy, gate), "overrides": line,
        "splits": {k: list(v) for k, v in sp.items()},
        "calibration": {"tokens": c.tokens, "met": res.met, "ce": res.best.ce, "ce_ref": res.ce_ref,
                        "ce_increase": res.best.ce - res.ce_ref, "applications": res.best.applications,
                        "applications_per_group": list(res.best.per_group), "decodes": len(res.history),
                        "seconds": search_s, "per_group": bool(c.per_group), "max_evals": c.max_evals},
        "test": {**held, "eval": ev},
    }
    write_json(run_dir / "calibration.json", out)
    log.info("test split: %s", _held_line(held))
    return out


def _held_line(h: dict) -> str:
    if "ce_increase" in h:
        return (f"CE increase {h['ce_increase']:+.4f} [{h['ce_increase_ci'][0]:+.4f}, {h['ce_increase_ci'][1]:+.4f}] "
                f"vs target <= {h['bound']:g}: {h['verdict']}")
    return (f"applications {h['applications']:.2f} [{h['applications_ci'][0]:.2f}, {h['applications_ci'][1]:.2f}] "
            f"vs target <= {h['bound']:g}: {h['verdict']}")


def _write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["decode", "field", "values", "ce", "ce_increase", "applications", "per_group", "meets"])
        for i, r in enumerate(rows):
            w.writerow([i, r["field"], " ".join(f"{v:g}" for v in r["values"]), f"{r['ce']:.6f}",
                        f"{r['ce_increase']:+.6f}", f"{r['applications']:.4f}",
                        " ".join(f"{a:.3f}" for a in r["per_group"]), int(r["meets"])])


@hydra.main(config_path=conf_dir(), config_name="calibrate", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float:
    return guarded(lambda c: calibrate(c)["test"]["eval"], cfg, "ce")


def main() -> None:
    run_hydra_main(_hydra_main)


if __name__ == "__main__":
    # as recdepth.evaluate: run the importable module's main, so launchers pickle by reference
    import recdepth.calibrate

    recdepth.calibrate.main()
