"""`python -m recdepth.calibrate ckpt=<path> exit=accel target.max_ce_increase=0.01`: per-group
exit thresholds searched to a target on a calibration split, then one evaluation on the test
split (docs/spec.md §4c; the search is `recdepth.calibration`).

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
(Σ_g |g| · applications_g + the layers outside the loops, docs/spec.md §4b).
`calibration.method=ltt` (CE target only) replaces the search by Learn then Test
(`calibrate_ltt`, docs/spec.md §4e): the answer's clipped per-window CE increase is at most
δ with probability >= 1 − calibration.epsilon, or nothing is certified and the answer is
full depth; `empirical` (the default) is the search, with no guarantee. The run
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
import dataclasses
import logging
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from recdepth import calibration, ltt, stats
from recdepth.checkpoints import checkpoint_data, load_checkpoint, resolve_device
from recdepth.cli import hydra_main, job_dir, refuse, start_job, task
from recdepth.config import exit_policy
from recdepth.decoding import evaluate_exit, evaluate_exits, lean_steps, model_cost
from recdepth.evaluate import run_eval
from recdepth.exits import ExitPolicy, build
from recdepth.runs import write_json
from recdepth.schema import EvalConfig, validated

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


def overrides(p: ExitPolicy, gate: str | None = None, calibrated_on: tuple[int, int] | None = None) -> str:
    """The command-line overrides that select policy `p` (every field, so nothing is
    inherited from the rule's yaml), and the val-token range it was calibrated on."""
    def fmt(v):
        return "[" + ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in v) + "]" \
            if isinstance(v, tuple) else (f"{v:g}" if isinstance(v, float) else str(v))

    parts = [f"exit={p.name}", f"exit.tau={'null' if p.tau is None else fmt(p.tau)}",
             f"exit.min_steps={fmt(p.min_steps)}", f"exit.max_steps={fmt(p.max_steps)}", f"exit.patience={p.patience}"]
    if gate:
        parts.append(f"exit.gate={gate}")
    if calibrated_on is not None:
        parts.append(f"exit.calibrated_on=[{int(calibrated_on[0])},{int(calibrated_on[1])}]")
    return " ".join(parts)


def exit_group(p: ExitPolicy, gate: str | None = None, calibrated_on: tuple[int, int] | None = None) -> dict:
    """The `exit` group of policy p as plain data (exit.yaml)."""
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    d = {"name": p.name, "tau": plain(p.tau), "min_steps": plain(p.min_steps), "max_steps": plain(p.max_steps),
         "patience": p.patience}
    if gate:
        d["gate"] = gate
    if calibrated_on is not None:
        d["calibrated_on"] = [int(calibrated_on[0]), int(calibrated_on[1])]
    return d


class CalibrationSplit:
    """Decodes a policy on the calibration tokens for real; remembers what it decoded.
    `first_window`: the noise key of the split's first window (`noise_window`), so its
    windows never share the test windows' noise; `cost`: the model's layer-application cost."""

    def __init__(self, model, tokens: torch.Tensor, n_tokens: int, seed: int, cache: str, batch_size: int,
                 warm_start: bool = False, first_window: int = 0, labels=None, answers: bool | None = None,
                 context_steps: int | None = None):
        self.model, self.tokens, self.n_tokens, self.labels = model, tokens, n_tokens, labels
        self.answers = answers  # eval.answers: a task's answer tokens only (None: whenever there are labels)
        self.context_steps = context_steps  # eval.context_steps: a task's context at fixed depth
        self.seed, self.cache, self.batch_size, self.warm_start = seed, cache, batch_size, warm_start
        self.first_window = first_window
        self.cost = model_cost(model)
        self.seconds = 0.0

    def decode_many(self, policies: list[ExitPolicy], max_rows: int) -> list[dict]:
        """`decode` of several policies as one batch of settings × windows, `max_rows` rows
        a batch (`decoding.evaluate_exits`: each record the one `decode` gives it alone);
        max_rows 0 or one policy: one by one."""
        if max_rows == 0 or len(policies) < 2:
            return [self.decode(p) for p in policies]
        t0 = time.perf_counter()
        out = evaluate_exits(self.model, self.tokens, policies, self.n_tokens, warmup_tokens=0, seed=self.seed,
                             cache=self.cache, max_rows=max_rows, latency_tokens=0, warm_start=self.warm_start,
                             first_window=self.first_window, labels=self.labels, answers=self.answers,
                             context_steps=self.context_steps)
        self.seconds += time.perf_counter() - t0
        return [rec for _, rec in out]

    def decode(self, policy: ExitPolicy) -> dict:
        t0 = time.perf_counter()
        _, rec = evaluate_exit(self.model, self.tokens, policy, self.n_tokens, warmup_tokens=0, seed=self.seed,
                               cache=self.cache, batch_size=self.batch_size, latency_tokens=0,
                               warm_start=self.warm_start, first_window=self.first_window, labels=self.labels,
                               answers=self.answers, context_steps=self.context_steps)
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

    res = calibration.search(evaluate, len(grid), groups, target, ce_ref, per_group=groups > 1, max_evals=max_evals,
                             cost=split.cost)
    rows = [{"field": field, "values": [grid[i] for i in p.setting], "ce": p.ce, "ce_increase": p.ce - ce_ref,
             "layer_applications": p.cost, "per_group": list(p.per_group),
             "meets": calibration.meets(p, target, ce_ref)} for p in res.history]
    return at(res.best.setting), res, records[res.best.setting], rows


def calibrate_ltt(split: CalibrationSplit, base: ExitPolicy, target: calibration.Target, per_group: bool,
                  max_evals: int, epsilon: float, loss_bound: float,
                  ref: dict | None = None, shared_rows: int = 0) -> tuple[ExitPolicy, calibration.Result, dict, list, dict]:
    """Learn then Test on the calibration split (`recdepth.ltt`, docs/spec.md §4e): the
    settings of `base`'s knob along a fixed path, most conservative first (`ltt.staircase`
    over the per-group grid with `per_group`, else the shared grid), each window's loss its
    mean NLL increase over `fixed` at max_steps clipped to [0, loss_bound] and divided by it,
    Hoeffding–Bentkus p-values of "risk > δ / loss_bound", fixed-sequence testing at level
    `epsilon`. Settings are decoded lazily in path order and the walk stops at the first one
    not certified (fixed-sequence testing never reads further) or after `max_evals` (a
    prefix of a fixed sequence is a fixed sequence: still valid). The answer is the last
    certified setting; if none is, `fixed` at max_steps (full depth, loss 0). Returns the
    policy, a `calibration.Result` (history: the decoded settings), the answer's per-token
    record, the rows of calibration.csv ("meets" = certified) and calibration.json's method
    block. `shared_rows` (calibration.shared_rows): the path's next settings are decoded as
    one batch of settings × windows of about this many rows (`CalibrationSplit.decode_many`;
    records as decoded alone), so up to that many settings past the first uncertified one
    are decoded and not read; 0: one by one."""
    if target.kind != "max_ce_increase":
        raise ValueError("calibration.method: ltt needs target.max_ce_increase (a layer-applications budget has "
                         "no risk to certify); use calibration.method=empirical for it")
    G = split.model.n_groups
    field, grid = calibration.knob(base.name, base.max_steps_bound)
    groups = G if (per_group and field != "patience") else 1
    path = ltt.staircase(len(grid), groups)
    full = build("fixed", None, max_steps=base.max_steps)
    if ref is None:
        ref = split.decode(full)
    alpha = ltt.alpha(target.value, loss_bound)
    ce_ref = float(np.mean(ref["nll"]))
    decoded: list[tuple[tuple[int, ...], dict]] = []

    def at(setting):
        return policy_at(base, field, [grid[i] for i in setting])

    windows = len(np.unique(ref["window"]))
    chunk = max(1, -(-shared_rows // windows)) if shared_rows else 1  # settings a batch

    def losses():
        todo = path[:max_evals]
        for i in range(0, len(todo), chunk):
            part = todo[i : i + chunk]
            for s, rec in zip(part, split.decode_many([at(s) for s in part], shared_rows), strict=True):
                decoded.append((s, rec))
                yield ltt.window_losses(rec["nll"], ref["nll"], rec["window"], loss_bound)

    out = ltt.ltt_lazy(losses(), alpha, epsilon)
    k, n = out["certified"], out["n"]
    points = [calibration.point(s, rec["nll"], rec["apps"], split.cost) for s, rec in decoded]
    rows = [{"field": field, "values": [grid[i] for i in p.setting], "ce": p.ce, "ce_increase": p.ce - ce_ref,
             "layer_applications": p.cost, "per_group": list(p.per_group), "meets": i < k,
             "risk": out["risks"][i], "pvalue": out["pvalues"][i]} for i, p in enumerate(points)]
    if k:
        policy, best, rec = at(decoded[k - 1][0]), points[k - 1], decoded[k - 1][1]
    else:
        policy, rec = full, ref
        best = calibration.point((), ref["nll"], ref["apps"], split.cost)
    stopped = ("first uncertified setting" if k < len(decoded) else
               "end of the path" if len(decoded) == len(path) else "calibration.max_evals")
    n_min = ltt.min_alpha(n, epsilon)
    if alpha < n_min:
        log.warning("ltt: with %d calibration windows nothing below a risk of %.4g (δ = %.4g nats at loss_bound %g) "
                    "can be certified at epsilon %g; raise calibration.tokens", n, n_min, n_min * loss_bound,
                    loss_bound, epsilon)
    method = {
        "method": "ltt",
        "guarantee": (f"with probability >= {1 - epsilon:g} over the calibration windows, the answer's expected "
                      f"per-window CE increase over full depth, clipped to [0, {loss_bound:g}] nats, is <= "
                      f"{target.value:g} (risk <= alpha = {alpha:g}); spec §4e"),
        "status": f"certified {k} of {len(path)} settings on the path" if k else "nothing certified: full depth",
        "epsilon": epsilon, "alpha": alpha, "loss_bound": loss_bound, "windows": n, "min_alpha": n_min,
        "path": "staircase" if groups > 1 else "shared", "path_length": len(path), "tested": len(decoded),
        "certified": k, "stopped": stopped, "pvalue": "hoeffding_bentkus",
        "settings": [r["values"] for r in rows], "pvalues": out["pvalues"], "risks": out["risks"],
    }
    log.info("ltt: %s (%d windows, alpha %.4g, epsilon %g; walk stopped at the %s)", method["status"], n, alpha,
             epsilon, stopped)
    return policy, calibration.Result(best, True, ce_ref, target, points), rec, rows, method


def check_method(c, target: calibration.Target) -> None:
    """calibration.method=ltt needs a CE target below calibration.loss_bound (one line otherwise)."""
    if c.method != "ltt":
        return
    if target.kind != "max_ce_increase":
        raise ValueError("calibration.method: ltt needs target.max_ce_increase (a layer-applications budget has "
                         "no risk to certify); use calibration.method=empirical for it")
    if target.value >= c.loss_bound:
        raise ValueError(f"calibration.loss_bound: must exceed target.max_ce_increase ({c.loss_bound:g} <= "
                         f"{target.value:g}): the clipped loss never exceeds the bound, so nothing would be tested")


def ltt_test_risk(rec: dict, ref_nll: np.ndarray, loss_bound: float, alpha: float) -> dict:
    """The answer's LTT risk on the test split (mean clipped window loss, `ltt.window_losses`)
    against alpha: what the guarantee is about, measured once on the test windows."""
    r = float(np.mean(ltt.window_losses(rec["nll"], ref_nll, rec["window"], loss_bound)))
    return {"ltt_risk": r, "ltt_alpha": alpha, "ltt_risk_within_alpha": r <= alpha}


def target_of(cfg: DictConfig) -> calibration.Target:
    """The one target set in cfg.target (one line naming the fields otherwise)."""
    t = {k: v for k, v in OmegaConf.to_container(cfg.target).items() if v is not None}
    if len(t) != 1:
        raise ValueError(f"target: set exactly one of target.max_ce_increase=<nats> or "
                         f"target.layer_applications=<layer applications per token>, got {t or 'none'}")
    (kind, value), = t.items()
    return calibration.Target(kind, value)


def verdict(lo: float, hi: float, bound: float) -> str:
    """Whether a test quantity's 95% interval is below a target bound (held), above it
    (violated), or straddles it (not resolved)."""
    return "held" if hi <= bound else "violated" if lo > bound else "not resolved"


def test_check(target: calibration.Target, rec: dict, ref_nll: np.ndarray | None, cost: stats.Cost,
               resamples: int = 1000) -> dict:
    """The target on the test split with its paired 95% bootstrap interval over windows."""
    boot = stats.Bootstrap(rec["window"], resamples)
    if target.kind == "max_ce_increase":
        d, lo, hi = stats.diff_ci(rec["nll"], ref_nll, boot)
        return {"ce_increase": d, "ce_increase_ci": [lo, hi], "bound": target.value,
                "verdict": verdict(lo, hi, target.value)}
    a, lo, hi = stats.mean_ci(cost.per_token(rec["apps"]), boot)
    return {"layer_applications": a, "layer_applications_ci": [lo, hi], "bound": target.value,
            "verdict": verdict(lo, hi, target.value)}


def noise_window(n_test: int, block_size: int) -> int:
    """The noise key of the calibration split's first window: one past the test split's
    last window (the test split scores n_test targets in ceil(n_test / block_size)
    windows keyed 0, 1, ...), so no calibration window draws a test window's noise."""
    return -(-n_test // block_size)


def load_splits(cfg: DictConfig):
    """cfg.ckpt's module on cfg.device, the split ranges (`splits`), the test and
    calibration token streams (val tokens [0, eval.tokens] and the calibration.tokens + 1
    after them; one line naming calibration.tokens if the val split is too short), and
    their task labels {"test": ..., "calibration": ...} (None each on text)."""
    module, data = load_checkpoint(cfg.ckpt, resolve_device(cfg.device))
    lean_steps(module.model, OmegaConf.select(cfg, "eval.step", default=EvalConfig.step))  # every decode below
    c = cfg.calibration
    sp = splits(cfg.eval.tokens, c.tokens)
    dm = checkpoint_data(module, data, cfg.seed)
    regions = dm.cache.regions
    if regions and sp["calibration"][0] != regions["validation"][0]:  # a task (docs/spec.md §6)
        size = regions["test"][1]
        raise ValueError(f"eval.tokens: on a task, calibration reads the validation split, which starts after the "
                         f"test split's {size} tokens: set eval.tokens={size} (got {cfg.eval.tokens})")
    first = sp["calibration"][0]
    try:
        cal_tokens = torch.as_tensor(dm.heldout_tokens(c.tokens + 1, first))
    except ValueError as e:
        raise ValueError(f"calibration.tokens: {c.tokens} calibration tokens after the {cfg.eval.tokens + 1} test "
                         f"tokens do not fit the checkpoint's val split ({e})") from None
    n = cfg.eval.tokens + 1
    labels = {"test": dm.heldout_labels(n), "calibration": dm.heldout_labels(c.tokens + 1, first)}
    return module, sp, torch.as_tensor(dm.heldout_tokens(n)), cal_tokens, labels


def calibration_split(cfg: DictConfig, model, cal_tokens: torch.Tensor, labels=None) -> CalibrationSplit:
    """The calibration split of `load_splits`, decoded with cfg's settings and its own noise
    keys (on a task, its answer tokens: `labels`)."""
    c = cfg.calibration
    return CalibrationSplit(model, cal_tokens, c.tokens, cfg.seed, cfg.eval.cache, c.batch_size, cfg.eval.warm_start,
                            first_window=noise_window(cfg.eval.tokens, model.cfg.block_size), labels=labels,
                            answers=OmegaConf.select(cfg, "eval.answers"),
                            context_steps=OmegaConf.select(cfg, "eval.context_steps"))


def calibrate(cfg: DictConfig) -> dict:
    """Calibrate cfg.exit on the calibration split to cfg.target, evaluate the answer once on
    the test split; write and return calibration.json's dict."""
    run_dir = job_dir(cfg, "calibrate")
    validated(cfg)
    base = exit_policy(cfg)
    target = target_of(cfg)
    check_method(cfg.calibration, target)
    if base.name == "oracle":
        raise ValueError("exit.name: the oracle reads the target token; there is nothing to calibrate")
    refuse(run_dir, "calibration.json")
    module, sp, test_tokens, cal_tokens, labels = load_splits(cfg)
    model, c = module.model, cfg.calibration
    base.check_groups(model.n_groups)
    start_job(run_dir, cfg)

    split = calibration_split(cfg, model, cal_tokens, labels["calibration"])
    t0 = time.perf_counter()
    if c.method == "ltt":
        policy, res, cal_rec, rows, method = calibrate_ltt(split, base, target, c.per_group, c.max_evals, c.epsilon,
                                                           c.loss_bound, shared_rows=c.shared_rows)
    else:
        policy, res, cal_rec, rows = calibrate_policy(split, base, target, c.per_group, c.max_evals)
        method = {"method": "empirical", "guarantee": "no guarantee"}
    search_s = time.perf_counter() - t0
    gate = OmegaConf.select(cfg, "exit.gate")
    cal_range = tuple(sp["calibration"])
    line = overrides(policy, gate, cal_range)
    log.info("calibrated on %d tokens in %d decodes (%.0f s): %s (CE %+.4f vs fixed-%s, %.2f layer applications)%s",
             c.tokens, len(res.history), search_s, line, res.best.ce - res.ce_ref, base.max_steps,
             res.best.cost, "" if res.met else " -- the target is NOT met on the calibration split")

    off, v2g = sp["calibration"][0], module.vocab_to_gpt2
    gpt2 = cal_rec["target"] if v2g is None else v2g.cpu().numpy()[cal_rec["target"]]
    stats.write_tokens(run_dir / "calibration_tokens.csv", cal_rec["window"], cal_rec["position"] + off,
                       cal_rec["target"], gpt2, cal_rec["nll"], cal_rec["apps"])
    _write_rows(run_dir / "calibration.csv", rows)
    (run_dir / "exit.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(exit_group(policy, gate, cal_range))))
    (run_dir / "exit_overrides.txt").write_text(line + "\n")

    ev = run_eval(model, test_tokens, policy, cfg, run_dir, module.vocab_to_gpt2, labels=labels["test"])
    test_rec = stats.read_tokens(run_dir / "eval_tokens.csv")
    ref_nll = None
    if target.kind == "max_ce_increase":  # the test split's own full-depth reference, paired per token
        _, ref = evaluate_exit(model, test_tokens, build("fixed", None, max_steps=base.max_steps), cfg.eval.tokens,
                               warmup_tokens=0, seed=cfg.seed, cache=cfg.eval.cache,
                               batch_size=cfg.eval.batch_size, latency_tokens=0, warm_start=cfg.eval.warm_start,
                               labels=labels["test"], answers=OmegaConf.select(cfg, "eval.answers"),
                               context_steps=OmegaConf.select(cfg, "eval.context_steps"))
        ref_nll = ref["nll"]
    held = test_check(target, test_rec, ref_nll, split.cost)
    if c.method == "ltt":
        held.update(ltt_test_risk(test_rec, ref_nll, c.loss_bound, method["alpha"]))
    out = {
        "ckpt": str(Path(cfg.ckpt).resolve()), "groups": module.config.groups,
        "target": {"kind": target.kind, "value": target.value},
        "exit": exit_group(policy, gate, cal_range), "overrides": line,
        "splits": {k: list(v) for k, v in sp.items()},
        "calibration": {"tokens": c.tokens, "token_range": list(cal_range), "first_window": split.first_window,
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


_task = task(lambda c: calibrate(c)["test"]["eval"], "ce")  # the Hydra task (recdepth/cli.py)
main = hydra_main(_task, "calibrate")


if __name__ == "__main__":
    # as recdepth.evaluate: run the importable module's main, so launchers pickle by reference
    import recdepth.calibrate

    recdepth.calibrate.main()
