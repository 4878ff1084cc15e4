"""Calibrating an exit rule on a checkpoint (docs/spec.md §4c, §4e), the pieces
`recdepth.calibrate` and `recdepth.report` share: the test and calibration splits of the
val stream (`splits`, `load_splits`, their noise keys), the calibration split decoded for
real under candidate settings (`CalibrationSplit`), the empirical search and Learn then
Test driven on it (`calibrate_policy`, `calibrate_ltt`; the math is
recdepth/exits/calibration/search.py and recdepth/exits/calibration/ltt.py), the calibrated `exit` group and its
override line, and the check of the answer on the test split (`test_check`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from recdepth.analysis import stats
from recdepth.app.checkpoints import open_model, resolve_device
from recdepth.app.jobs import decode_settings
from recdepth.config.frontier_grid import Setting, exit_line
from recdepth.config.schema import CalibrateConfig, ReportConfig
from recdepth.decode.engine import span
from recdepth.decode.scoring import evaluate_exit, evaluate_exits, model_cost
from recdepth.decode.settings import DecodeSettings
from recdepth.exits.calibration import ltt, search
from recdepth.exits.policy import ExitPolicy, build

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
    inherited from the rule's yaml; floats exactly, as `repr`), and the val-token range it
    was calibrated on (`frontier_grid.exit_line`)."""
    return " ".join(exit_line(Setting("calibrated", exit_group(p, gate, calibrated_on))))


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
    `settings`: how it decodes (the run's eval block with calibration.batch_size windows a
    batch, no warm-up or latency passes: `calibration_split`); `first_window`: the noise key
    of the split's first window (`noise_window`), so its windows never share the test
    windows' noise; `cost`: the model's layer-application cost (a record's own `cost`, its
    checks included, is what the searches read).

    A setting is decoded once per split: a policy asked for again (the two targets of one
    rule start their searches at the same ends and midpoint; `fixed` at max_steps is every
    search's CE reference and the fixed rule's dear end) gets a copy of its first record,
    which is the record decoding it again would give (a decode depends on the policy
    alone; in float32 up to a criterion within rounding of τ under another batch, as for
    any batch). `decodes` counts the settings decoded, `reused` the asks answered from memory."""

    def __init__(self, model, tokens: torch.Tensor, n_tokens: int, settings: DecodeSettings,
                 first_window: int = 0, labels=None, targets=None):
        self.model, self.tokens, self.n_tokens, self.labels = model, tokens, n_tokens, labels
        self.targets = targets  # a task's scored stream (in-place targets), else None
        self.settings = settings.replace(warmup_tokens=0, latency_tokens=0)
        self.first_window = first_window
        self.cost = model_cost(model)
        self.seconds = 0.0
        self.decoded: dict[tuple, dict] = {}  # policy key -> its record
        self.decodes = self.reused = 0

    @staticmethod
    def _key(p: ExitPolicy) -> tuple:
        """A policy's identity for the memory: its fields, and its gate tensors by identity
        (the dataclass leaves the gate out of equality; the key's policy keeps them alive)."""
        return p, None if p.gate is None else (id(p.gate[0]), id(p.gate[1]))

    def decode_many(self, policies: list[ExitPolicy], max_rows: int) -> list[dict]:
        """`decode` of several policies, the ones not decoded before as one batch of
        settings × windows, `max_rows` rows a batch (`scoring.evaluate_exits`: each record
        the one `decode` gives it alone); max_rows 0 or one new policy: one by one."""
        keys = [self._key(p) for p in policies]
        new = {k: p for k, p in zip(keys, policies, strict=True) if k not in self.decoded}
        self.reused += len(keys) - len(new)
        if new:
            t0 = time.perf_counter()
            if max_rows == 0 or len(new) < 2:
                recs = [self._decode(p) for p in new.values()]
            else:
                out = evaluate_exits(self.model, self.tokens, list(new.values()), self.n_tokens,
                                     self.settings.replace(batch_size=max_rows), self.first_window, self.labels,
                                     self.targets)
                recs = [rec for _, rec in out]
            self.seconds += time.perf_counter() - t0
            self.decodes += len(new)
            self.decoded.update(zip(new, recs, strict=True))
        return [dict(self.decoded[k]) for k in keys]

    def decode(self, policy: ExitPolicy) -> dict:
        return self.decode_many([policy], 0)[0]

    def _decode(self, policy: ExitPolicy) -> dict:
        _, rec = evaluate_exit(self.model, self.tokens, policy, self.n_tokens, self.settings, self.first_window,
                               self.labels, self.targets)
        return rec


def calibrate_policy(split: CalibrationSplit, base: ExitPolicy, target: search.Target, per_group: bool,
                     max_evals: int, ce_ref: float | None = None, max_rows: int = 0,
                     decode: Callable[[list[ExitPolicy]], list[dict]] | None = None
                     ) -> tuple[ExitPolicy, search.Result, dict, list]:
    """Search `base`'s knob (`search.knob`) to `target` on the calibration split.
    Returns the calibrated policy, the search result, its per-token record there and the
    rows of calibration.csv. `ce_ref` (CE of fixed at max_steps there) is computed if not given.
    Settings that do not depend on each other (both ends of the bisection, a round of
    per-group moves) are decoded as one batch, `max_rows` rows a batch (0: one by one;
    `CalibrationSplit.decode_many`); `decode` (policies -> their records) replaces that
    (`calibrate_many`'s lockstep)."""
    G = split.model.n_groups
    field, grid = search.knob(base.name, base.max_steps_bound)
    groups = G if (per_group and field != "patience") else 1
    if ce_ref is None:
        ce_ref = float(split.decode(build("fixed", None, max_steps=base.max_steps))["nll"].mean())
    records = {}

    def at(setting):
        return policy_at(base, field, [grid[i] for i in setting])

    decode = decode or (lambda policies: split.decode_many(policies, max_rows))

    def evaluate_many(settings):
        recs = decode([at(s) for s in settings])
        records.update(zip(settings, recs, strict=True))
        return [(r["nll"], r["apps"], r["cost"]) for r in recs]

    res = search.search(lambda s: evaluate_many([s])[0], len(grid), groups, target, ce_ref,
                             per_group=groups > 1, max_evals=max_evals, cost=split.cost, evaluate_many=evaluate_many)
    rows = [{"field": field, "values": [grid[i] for i in p.setting], "ce": p.ce, "ce_increase": p.ce - ce_ref,
             "layer_applications": p.cost, "per_group": list(p.per_group),
             "meets": search.meets(p, target, ce_ref)} for p in res.history]
    return at(res.best.setting), res, records[res.best.setting], rows


def calibrate_many(split: CalibrationSplit, searches: list[tuple[ExitPolicy, search.Target]], per_group: bool,
                   max_evals: int, ce_ref: float, max_rows: int) -> list[tuple]:
    """`calibrate_policy` of several (base, target) searches in lockstep (recdepth.report's
    20): each search runs in a thread of its own until it asks for its next decodes; once
    every search still running has asked, the asked settings are decoded side by side
    (`CalibrationSplit.decode_many`, `max_rows` rows a batch, each record the one its setting
    gets alone) and each search goes on with its own. The settings of rules that read the
    logits at every application (kl, entropy_diff, argmax_stability: `needs_decode`) and
    those of rules that do not are decoded in separate batches: a mixed batch computes the
    logits for all its rows (`mixed.MixedMonitor`), and the LM head is most of a
    small model's cost. A search's steps depend on its own results only, so each answer is
    the one it gets alone (in float32 up to a criterion within rounding of τ, as for any
    batch). The decoding stays in this thread; the threads only choose settings. max_rows
    0: one search after another."""
    if max_rows == 0 or len(searches) < 2:
        return [calibrate_policy(split, b, t, per_group, max_evals, ce_ref, max_rows) for b, t in searches]
    cond = threading.Condition()
    asked: dict[int, list[ExitPolicy]] = {}
    answered: dict[int, list[dict] | None] = {}
    running = set(range(len(searches)))
    out: dict[int, tuple] = {}
    failed: dict[int, BaseException] = {}

    def run(i: int, base: ExitPolicy, target: search.Target) -> None:
        def decode(policies: list[ExitPolicy]) -> list[dict]:
            with cond:
                asked[i] = policies
                cond.notify_all()
                cond.wait_for(lambda: i in answered)
                recs = answered.pop(i)
            if recs is None:
                raise RuntimeError("calibrate_many: the batch this search waited for failed")
            return recs

        try:
            out[i] = calibrate_policy(split, base, target, per_group, max_evals, ce_ref, decode=decode)
        except BaseException as e:  # handed to the caller below
            failed[i] = e
        finally:
            with cond:
                running.discard(i)
                cond.notify_all()

    threads = [threading.Thread(target=run, args=(i, b, t), daemon=True) for i, (b, t) in enumerate(searches)]
    for t in threads:
        t.start()
    while True:
        with cond:
            cond.wait_for(lambda: not running or running <= set(asked))
            if not running:
                break
            batch = dict(sorted(asked.items()))  # in search order, not the threads' arrival order: the
            asked.clear()                          # same batches every run, so the same float32 rounding
        asks = [(i, k, p) for i, ps in batch.items() for k, p in enumerate(ps)]
        recs: dict[tuple[int, int], dict] = {}
        try:
            for reads_logits in (True, False):
                part = [(i, k, p) for i, k, p in asks if p.needs_decode == reads_logits]
                if part:
                    recs.update(zip([(i, k) for i, k, _ in part],
                                    split.decode_many([p for _, _, p in part], max_rows), strict=True))
        except BaseException:
            with cond:  # release the waiting searches with nothing, then re-raise
                answered.update({i: None for i in batch})
                cond.notify_all()
            raise
        with cond:
            answered.update({i: [recs[i, k] for k in range(len(ps))] for i, ps in batch.items()})
            cond.notify_all()
    for t in threads:
        t.join()
    if failed:
        raise failed[min(failed)]
    return [out[i] for i in range(len(searches))]


def calibrate_ltt(split: CalibrationSplit, base: ExitPolicy, target: search.Target, per_group: bool,
                  max_evals: int, epsilon: float, loss_bound: float,
                  ref: dict | None = None, shared_rows: int = 0) -> tuple[ExitPolicy, search.Result, dict, list, dict]:
    """Learn then Test on the calibration split (`recdepth.exits.calibration.ltt`, docs/spec.md §4e): the
    settings of `base`'s knob along a fixed path, most conservative first (`ltt.staircase`
    over the per-group grid with `per_group`, else the shared grid), each window's loss its
    mean NLL increase over `fixed` at max_steps clipped to [0, loss_bound] and divided by it,
    Hoeffding–Bentkus p-values of "risk > δ / loss_bound", fixed-sequence testing at level
    `epsilon`. Settings are decoded lazily in path order and the walk stops at the first one
    not certified (fixed-sequence testing never reads further) or after `max_evals` (a
    prefix of a fixed sequence is a fixed sequence: still valid). The answer is the last
    certified setting; if none is, `fixed` at max_steps (full depth, loss 0). Returns the
    policy, a `search.Result` (history: the decoded settings), the answer's per-token
    record, the rows of calibration.csv ("meets" = certified) and calibration.json's method
    block. `shared_rows` (calibration.shared_rows): the path's next settings are decoded as
    one batch of settings × windows of about this many rows (`CalibrationSplit.decode_many`;
    records as decoded alone), so up to that many settings past the first uncertified one
    are decoded and not read; 0: one by one."""
    accuracy = target.kind == "max_accuracy_drop"
    if target.kind == "layer_applications":
        raise ValueError("calibration.method: ltt needs target.max_ce_increase or target.max_accuracy_drop (a "
                         "layer-applications budget has no risk to certify); use calibration.method=empirical for it")
    G = split.model.n_groups
    field, grid = search.knob(base.name, base.max_steps_bound)
    groups = G if (per_group and field != "patience") else 1
    path = ltt.staircase(len(grid), groups)
    full = build("fixed", None, max_steps=base.max_steps)
    if ref is None:
        ref = split.decode(full)
    if accuracy and "correct" not in ref:
        raise ValueError("target.max_accuracy_drop: scores a task's answers, but this data has no answer labels "
                         "(data=<task>; else target.max_ce_increase)")
    alpha = target.value if accuracy else ltt.alpha(target.value, loss_bound)
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
                yield (ltt.answer_flips(rec["correct"], ref["correct"], rec["window"]) if accuracy else
                       ltt.window_losses(rec["nll"], ref["nll"], rec["window"], loss_bound))

    out = ltt.ltt_lazy(losses(), alpha, epsilon)
    k, n = out["certified"], out["n"]
    points = [search.point(s, rec["nll"], rec["apps"], split.cost, rec["cost"]) for s, rec in decoded]
    rows = [{"field": field, "values": [grid[i] for i in p.setting], "ce": p.ce, "ce_increase": p.ce - ce_ref,
             "layer_applications": p.cost, "per_group": list(p.per_group), "meets": i < k,
             "risk": out["risks"][i], "pvalue": out["pvalues"][i]} for i, p in enumerate(points)]
    if k:
        policy, best, rec = at(decoded[k - 1][0]), points[k - 1], decoded[k - 1][1]
    else:
        policy, rec = full, ref
        best = search.point((), ref["nll"], ref["apps"], split.cost, ref["cost"])
    stopped = ("first uncertified setting" if k < len(decoded) else
               "end of the path" if len(decoded) == len(path) else "calibration.max_evals")
    n_min = ltt.min_alpha(n, epsilon)  # calibration_size refused fewer windows than alpha needs
    method = {
        "method": "ltt",
        "guarantee": (f"with probability >= {1 - epsilon:g} over the calibration windows, the answer's expected "
                      + (f"per-window fraction of answers that full depth gets right and it gets wrong (so its "
                         f"accuracy drop) is <= {target.value:g}; spec §4e" if accuracy else
                         f"per-window CE increase over full depth, clipped to [0, {loss_bound:g}] nats, is <= "
                         f"{target.value:g} (risk <= alpha = {alpha:g}); spec §4e")),
        "status": f"certified {k} of {len(path)} settings on the path" if k else "nothing certified: full depth",
        "epsilon": epsilon, "alpha": alpha, "loss": "answer_flips" if accuracy else "clipped_ce_increase",
        "loss_bound": None if accuracy else loss_bound, "windows": n, "min_alpha": n_min,
        "path": "staircase" if groups > 1 else "shared", "path_length": len(path), "tested": len(decoded),
        "certified": k, "stopped": stopped, "pvalue": "hoeffding_bentkus",
        "settings": [r["values"] for r in rows], "pvalues": out["pvalues"], "risks": out["risks"],
    }
    log.info("ltt: %s (%d windows, alpha %.4g, epsilon %g; walk stopped at the %s)", method["status"], n, alpha,
             epsilon, stopped)
    return policy, search.Result(best, True, ce_ref, target, points), rec, rows, method


def check_method(c, target: search.Target) -> None:
    """calibration.method=ltt needs a CE target below calibration.loss_bound or an accuracy
    target; an accuracy target needs ltt (one line otherwise)."""
    if c.method != "ltt":
        if target.kind == "max_accuracy_drop":
            raise ValueError("target.max_accuracy_drop: needs calibration.method=ltt (the empirical search "
                             "minimises cost at a CE or cost target)")
        return
    if target.kind == "layer_applications":
        raise ValueError("calibration.method: ltt needs target.max_ce_increase or target.max_accuracy_drop (a "
                         "layer-applications budget has no risk to certify); use calibration.method=empirical for it")
    if target.kind == "max_ce_increase" and target.value >= c.loss_bound:
        raise ValueError(f"calibration.loss_bound: must exceed target.max_ce_increase ({c.loss_bound:g} <= "
                         f"{target.value:g}): the clipped loss never exceeds the bound, so nothing would be tested")


def ltt_test_risk(rec: dict, ref: dict, target: search.Target, loss_bound: float, alpha: float) -> dict:
    """The answer's LTT risk on the test split (mean window loss: `ltt.answer_flips` for an
    accuracy target, else `ltt.window_losses`) against alpha, from its record and the full-depth
    reference `ref` (nll, correct): what the guarantee is about, measured once on the test windows."""
    if target.kind == "max_accuracy_drop":
        losses = ltt.answer_flips(rec["correct"], ref["correct"], rec["window"])
    else:
        losses = ltt.window_losses(rec["nll"], ref["nll"], rec["window"], loss_bound)
    r = float(np.mean(losses))
    return {"ltt_risk": r, "ltt_alpha": alpha, "ltt_risk_within_alpha": r <= alpha}


def target_of(run: CalibrateConfig) -> search.Target:
    """The one target set in run.target (one line naming the fields otherwise)."""
    t = {k: v for k, v in dataclasses.asdict(run.target).items() if v is not None}
    if len(t) != 1:
        raise ValueError(f"target: set exactly one of target.max_ce_increase=<nats>, "
                         f"target.layer_applications=<layer applications per token> or "
                         f"target.max_accuracy_drop=<fraction> (ltt), got {t or 'none'}")
    (kind, value), = t.items()
    return search.Target(kind, value)


def verdict(lo: float, hi: float, bound: float) -> str:
    """Whether a test quantity's 95% interval is below a target bound (held), above it
    (violated), or straddles it (not resolved)."""
    return "held" if hi <= bound else "violated" if lo > bound else "not resolved"


def test_check(target: search.Target, rec: dict, ref: dict | None, cost: stats.Cost,
               resamples: int = 1000) -> dict:
    """The target on the test split with its paired 95% bootstrap interval over windows
    (`ref`: the full-depth record, nll and correct, for the CE and accuracy targets)."""
    boot = stats.Bootstrap(rec["window"], resamples)
    if target.kind == "max_ce_increase":
        d, lo, hi = stats.diff_ci(rec["nll"], ref["nll"], boot)
        return {"ce_increase": d, "ce_increase_ci": [lo, hi], "bound": target.value,
                "verdict": verdict(lo, hi, target.value)}
    if target.kind == "max_accuracy_drop":
        d, lo, hi = stats.diff_ci(ref["correct"].astype(float), rec["correct"].astype(float), boot)
        return {"accuracy_drop": d, "accuracy_drop_ci": [lo, hi], "bound": target.value,
                "verdict": verdict(lo, hi, target.value)}
    a, lo, hi = stats.mean_ci(rec["cost"] if "cost" in rec else cost.per_token(rec["apps"]), boot)
    return {"layer_applications": a, "layer_applications_ci": [lo, hi], "bound": target.value,
            "verdict": verdict(lo, hi, target.value)}


def noise_window(n_test: int, block_size: int, bos: int | None = None) -> int:
    """The noise key of the calibration split's first window: one past the test split's
    last window (the test split scores n_test targets in ceil(n_test / span) windows keyed
    0, 1, ..., span = block_size, or block_size - 1 after an hf= model's BOS:
    `engine.span`), so no calibration window draws a test window's noise."""
    return -(-n_test // span(block_size, bos))


def load_splits(run: CalibrateConfig | ReportConfig, target: search.Target | None = None):
    """The validated config's model (`checkpoints.open_model`: ckpt= or hf=) on run.device,
    the split ranges (`splits`), the test and calibration token streams (held-out tokens
    [0, eval.tokens] and the calibration tokens + 1 after them, as many as
    `calibration_size` says for `target`; one line naming calibration.tokens if the held-out
    split is too short), and their task labels {"test": ..., "calibration": ...} (None
    each on text)."""
    opened = open_model(run, resolve_device(run.device))
    n_test = run.eval.tokens
    regions = opened.regions()
    if regions and n_test + 1 != regions["validation"][0]:  # a task (docs/spec.md §6)
        size = regions["test"][1]
        raise ValueError(f"eval.tokens: on a task, calibration reads the validation split, which starts after the "
                         f"test split's {size} tokens: set eval.tokens={size} (got {n_test})")
    room = regions["validation"][1] if regions else opened.heldout_size() - n_test - 2
    n_cal = calibration_size(run, target, room, opened.model.cfg.block_size, opened.bos, bool(regions))
    sp = splits(n_test, n_cal)
    first = sp["calibration"][0]
    try:
        cal_tokens = opened.heldout(n_cal + 1, first)
    except ValueError as e:
        raise ValueError(f"calibration.tokens: {n_cal} calibration tokens after the {n_test + 1} test "
                         f"tokens do not fit the held-out split ({e})") from None
    n = n_test + 1
    labels = {"test": opened.labels(n, 0), "calibration": opened.labels(n_cal + 1, first)}
    return opened, sp, opened.heldout(n, 0), cal_tokens, labels


EMPIRICAL_TOKENS = 2048  # calibration.tokens=null under the empirical search
LTT_MARGIN = 4  # calibration.tokens=null under ltt: this many times the windows a zero loss needs


def calibration_size(run, target: search.Target | None, room: int, block_size: int,
                     bos: int | None = None, task: bool = False) -> int:
    """Calibration tokens: calibration.tokens where set, else sized to the target —
    EMPIRICAL_TOKENS for the empirical search; for Learn then Test LTT_MARGIN times the
    windows that could certify the target with every loss 0 (`ltt.units_needed`), or the
    `room` there is (the held-out tokens after the test split; on a task, its validation
    split) where that is less. Under ltt fewer windows than `ltt.units_needed` can certify
    nothing, so that is refused in one line saying what it needs (rather than decoding a
    calibration that must return full depth)."""
    c = run.calibration
    if c.method != "ltt" or target is None:
        return EMPIRICAL_TOKENS if c.tokens is None else c.tokens
    a = target.value if target.kind == "max_accuracy_drop" else ltt.alpha(target.value, c.loss_bound)
    if a <= 0:
        raise ValueError(f"target.{target.kind}: Learn then Test cannot certify a risk of 0 (expected a target > 0)")
    width = span(block_size, bos)
    need = ltt.units_needed(a, c.epsilon)
    n = min(room, LTT_MARGIN * need * width) if c.tokens is None else c.tokens
    have = -(-n // width)
    if have < need:
        where = (f"the validation split holds {room} tokens: raise data.validation_records to >= {need} and train "
                 f"again, or set a looser target" if task else
                 f"the held-out split has {room} tokens after the test split")
        raise ValueError(f"calibration.tokens: Learn then Test certifies a risk of {a:.4g} at calibration.epsilon="
                         f"{c.epsilon:g} only with >= {need} calibration windows of {width} tokens "
                         f"({need * width} tokens, every loss 0), got {have} ({n} tokens; {where})")
    return n


def calibration_split(run: CalibrateConfig | ReportConfig, model, cal_tokens: torch.Tensor, labels=None,
                      bos: int | None = None, targets=None) -> CalibrationSplit:
    """The calibration split of `load_splits`, decoded with the validated config's settings
    and its own noise keys (on a task, its answer tokens: `labels`, and with in-place
    answers their scored stream, `targets`; an hf= model's windows start with `bos`)."""
    c, e = run.calibration, run.eval
    settings = decode_settings(run, bos).replace(batch_size=c.batch_size)
    return CalibrationSplit(model, cal_tokens, len(cal_tokens) - 1, settings,
                            first_window=noise_window(e.tokens, model.cfg.block_size, bos), labels=labels,
                            targets=targets)
