"""`python -m recdepth.calibrate ckpt=<path> exit=accel target.max_ce_increase=0.01`: per-group
exit thresholds searched to a target on a calibration split, then one evaluation on the test
split (docs/spec.md §4c; the search is `recdepth.exits.calibration.search`).

    python -m recdepth.calibrate ckpt=<run>/train/checkpoints/last.ckpt exit=accel target.max_ce_increase=0.01
    python -m recdepth.calibrate ckpt=<run>/train/checkpoints/last.ckpt exit=kl target.layer_applications=40

Splits, both from the checkpoint's val split and never overlapping: the **test** split is
what `recdepth.evaluate` scores, val tokens [0, eval.tokens]; the **calibration** split
follows it, val tokens [eval.tokens + 1, eval.tokens + 1 + calibration.tokens]. Every
candidate setting is decoded for real on the calibration split (exact engine, batched).
The calibration windows draw their own initial-state noise: their noise keys (SPEC §4's
"sequence") continue after the test split's windows instead of restarting at 0.

Targets (set exactly one): `target.max_ce_increase` δ, CE at most δ nats above `fixed` at
exit.max_steps; `target.layer_applications` B, layer applications per token at most B
(Σ_g |g| · applications_g + the layers outside the loops, docs/spec.md §4b);
`target.max_accuracy_drop` a, a task's answer accuracy at most a below full depth (ltt only).
`calibration.method=ltt` (CE or accuracy target) replaces the search by Learn then Test
(`calibrate_ltt`, docs/spec.md §4e): the answer's clipped per-window CE increase (or its
per-window fraction of answers lost) is at most the target with probability >= 1 −
calibration.epsilon, or nothing is certified and the answer is full depth; `empirical`
(the default) is the search, with no guarantee. `calibration.tokens=null` (the default)
sizes the calibration split to the target, and under ltt a split too small to certify it
is refused in one line that says what it needs (`app.calibration.calibration_size`). The run
directory gets:
    calibration.json    the answer, the exit override line, calibration and test numbers
    calibration.csv     every setting decoded on the calibration split (per-group values, CE, A)
    calibration_tokens.csv  the answer's per-token record on the calibration split
                        (position = offset in the val split)
    exit.yaml           the calibrated `exit` group, the same as the override line
    eval_tokens.csv     the answer's per-token record on the test split (as recdepth.evaluate)
The override line (`exit=accel exit.tau=[...] ... exit.calibrated_on=[first,last]`) runs the
calibrated rule in `recdepth.evaluate` and `recdepth.train`; `exit.calibrated_on` makes them
refuse a test range that overlaps the calibration tokens.
"""

from __future__ import annotations

import csv
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from recdepth.analysis import token_files
from recdepth.app.calibration import (
    calibrate_ltt,
    calibrate_policy,
    calibration_split,
    check_method,
    exit_group,
    load_splits,
    ltt_test_risk,
    overrides,
    target_of,
    test_check,
)
from recdepth.app.jobs import decode_settings, for_model, run_eval
from recdepth.cli.runner import hydra_main, job_dir, refuse, start_job, task
from recdepth.config.build import exit_policy
from recdepth.config.schema import validated
from recdepth.decode.scoring import evaluate_exit
from recdepth.exits.policy import build
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.calibrate")


def calibrate(cfg: DictConfig) -> dict:
    """Calibrate cfg.exit on the calibration split to cfg.target, evaluate the answer once on
    the test split; write and return calibration.json's dict."""
    run_dir = job_dir(cfg, "calibrate")
    run = validated(cfg)
    base = exit_policy(run)
    target = target_of(run)
    c = run.calibration
    check_method(c, target)
    if base.name == "oracle":
        raise ValueError("exit.name: the oracle reads the target token; there is nothing to calibrate")
    refuse(run_dir, "calibration.json")
    opened, sp, test_tokens, cal_tokens, labels = load_splits(run, target)
    n_cal = sp["calibration"][1] - sp["calibration"][0]
    model = opened.model
    base = for_model(base, opened)  # its groups checked; decode and kl_direction decided as evaluate does
    start_job(run_dir, cfg)

    test_targets = opened.targets(run.eval.tokens + 1, 0)  # a task's in-place answers, else None
    split = calibration_split(run, model, cal_tokens, labels["calibration"], bos=opened.bos,
                              targets=opened.targets(n_cal + 1, sp["calibration"][0]))
    t0 = time.perf_counter()
    if c.method == "ltt":
        policy, res, cal_rec, rows, method = calibrate_ltt(split, base, target, c.per_group, c.max_evals, c.epsilon,
                                                           c.loss_bound, shared_rows=c.shared_rows)
    else:
        policy, res, cal_rec, rows = calibrate_policy(split, base, target, c.per_group, c.max_evals,
                                                      max_rows=c.shared_rows)
        method = {"method": "empirical", "guarantee": "no guarantee"}
    search_s = time.perf_counter() - t0
    gate = run.exit.gate
    cal_range = tuple(sp["calibration"])
    line = overrides(policy, gate, cal_range)
    log.info("calibrated on %d tokens in %d decodes (%.0f s): %s (CE %+.4f vs fixed-%s, %.2f layer applications)%s",
             n_cal, len(res.history), search_s, line, res.best.ce - res.ce_ref, base.max_steps,
             res.best.cost, "" if res.met else " -- the target is NOT met on the calibration split")

    off, v2g = sp["calibration"][0], opened.vocab_to_gpt2
    gpt2 = cal_rec["target"] if v2g is None else v2g.cpu().numpy()[cal_rec["target"]]
    token_files.write_tokens(run_dir / "calibration_tokens.csv", cal_rec["window"], cal_rec["position"] + off,
                       cal_rec["target"], gpt2, cal_rec["nll"], cal_rec["apps"])
    _write_rows(run_dir / "calibration.csv", rows)
    (run_dir / "exit.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(exit_group(policy, gate, cal_range))))
    (run_dir / "exit_overrides.txt").write_text(line + "\n")

    ev = run_eval(model, test_tokens, policy, cfg, run_dir, opened.vocab_to_gpt2, bos=opened.bos, labels=labels["test"],
                  targets=test_targets)
    test_rec = token_files.read_tokens(run_dir / "eval_tokens.csv")
    ref = None
    if target.kind != "layer_applications":  # the test split's own full-depth reference, paired per token
        _, ref = evaluate_exit(model, test_tokens, build("fixed", None, max_steps=base.max_steps), run.eval.tokens,
                               decode_settings(run, opened.bos).replace(warmup_tokens=0, latency_tokens=0),
                               labels=labels["test"], targets=test_targets)
        if "correct" in test_rec:
            test_rec["correct"] = test_rec["correct"].astype(bool)
    held = test_check(target, test_rec, ref, split.cost)
    if c.method == "ltt":
        held.update(ltt_test_risk(test_rec, ref, target, c.loss_bound, method["alpha"]))
    out = {
        opened.kind: opened.source, "groups": model.cfg.groups,
        "target": {"kind": target.kind, "value": target.value},
        "exit": exit_group(policy, gate, cal_range), "overrides": line,
        "splits": {k: list(v) for k, v in sp.items()},
        "calibration": {"tokens": n_cal, "token_range": list(cal_range), "first_window": split.first_window,
                        "met": res.met, "ce": res.best.ce, "ce_ref": res.ce_ref,
                        "ce_increase": res.best.ce - res.ce_ref, "layer_applications": res.best.cost,
                        "applications_per_group": list(res.best.per_group), "decodes": len(res.history),
                        "seconds": search_s, "per_group": bool(c.per_group), "max_evals": c.max_evals,
                        **method},
        "test": {**held, "eval": ev},
    }
    write_json(run_dir / "calibration.json", out)
    log.info("test split: %s", _held_line(held))
    return out


def _held_line(h: dict) -> str:
    if "accuracy_drop" in h:
        return (f"accuracy drop {h['accuracy_drop']:+.4f} [{h['accuracy_drop_ci'][0]:+.4f}, "
                f"{h['accuracy_drop_ci'][1]:+.4f}] vs target <= {h['bound']:g}: {h['verdict']}")
    if "ce_increase" in h:
        return (f"CE increase {h['ce_increase']:+.4f} [{h['ce_increase_ci'][0]:+.4f}, {h['ce_increase_ci'][1]:+.4f}] "
                f"vs target <= {h['bound']:g}: {h['verdict']}")
    return (f"layer applications {h['layer_applications']:.2f} [{h['layer_applications_ci'][0]:.2f}, "
            f"{h['layer_applications_ci'][1]:.2f}] vs target <= {h['bound']:g}: {h['verdict']}")


def _write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["decode", "field", "values", "ce", "ce_increase", "layer_applications", "per_group", "meets"])
        for i, r in enumerate(rows):
            w.writerow([i, r["field"], " ".join(f"{v:g}" for v in r["values"]), f"{r['ce']:.6f}",
                        f"{r['ce_increase']:+.6f}", f"{r['layer_applications']:.4f}",
                        " ".join(f"{a:.3f}" for a in r["per_group"]), int(r["meets"])])


_task = task(lambda c: calibrate(c)["test"]["eval"], "ce")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "calibrate")


if __name__ == "__main__":
    # as recdepth.evaluate: run the importable module's main, so launchers pickle by reference
    import recdepth.calibrate

    recdepth.calibrate.main()
