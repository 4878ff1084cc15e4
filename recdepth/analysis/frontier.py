"""A sweep's results as tables: each job directory read into a row, the Markdown and CSV
tables, and the frontier statistics of docs/spec.md §4b (fixed-depth frontier, paired
bootstrap over windows, verdicts with Holm's control, the oracle's curve).

`recdepth.sweep.summarize` (the Hydra callback's work, and `recdepth.report`'s) writes
these into the sweep directory:

    sweep_results.csv   one row per job: job, overrides, status, exit, tau (a list when
                        one per group), patience (argmax_stability), max_steps,
                        warm_start (eval.warm_start, continuous compute), ce
                        with its 95% CI (over windows), ppl, ms_per_token (median, min,
                        max, every repeat), on a task ms_per_answer (with its CI and
                        repeats) and ms_per_context, applications per group and their mean,
                        the cost (layer applications with the checks), the loop alone, the
                        checks per token, FLOPs per token, tokens, tokens_per_s (batched),
                        the batch-1 check (tokens whose applications differ between batch
                        1 and batch B, largest NLL difference), reused, error
    sweep_results.md    the same as a Markdown table
    frontier.csv / .md  when the sweep has fixed-depth jobs at two or more n (SPEC §4b): for
                        every other job (its `family`: the rule, "fixed (warm start)" for
                        the fixed grid under eval.warm_start, see `family`), its CE and
                        layer applications per token with 95% CIs, the best fixed CE
                        within its cost and the paired CE difference, the fixed frontier
                        at exactly its cost (`stats.hull_ce`) and the paired CE
                        difference to it (the verdict, per comparison and with Holm's
                        family-wise control over the table), the same at the job's
                        ms/token (the fixed jobs' (ms, CE) frontier, the spread over
                        timing repeats included), the fewest fixed applications that
                        reach its CE and the saving 1 − cost/cost(n) with a paired CI,
                        and the oracle's saving at the same CE (`frontier_rows`, from
                        the jobs' eval_tokens.csv). Every interval resamples whole
                        windows, the same draws for every job (docs/spec.md §4b).
    fig4_exits.{png,pdf} the paper's Fig. 4: ms/token, PPL, CE and layer applications per
                        token against τ (log-x), one line per exit rule (`fixed` dashed;
                        jobs with one τ per group are left out of these panels, logged);
                        with a frontier also CE against layer applications and against
                        ms/token, every family a curve, the fixed frontier and the oracle drawn

The fixed frontier is the cold fixed grid (eval.warm_start=false); fixed jobs with warm
start are a family of their own, compared with it like a rule. Only a sweep whose fixed
jobs are all warm-started (eval.warm_start=true given for the whole sweep) has the warm
grid as its frontier (`_reference_warm`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from recdepth.analysis import stats, token_files
from recdepth.core.checks import is_number

log = logging.getLogger("recdepth.frontier")


# -------------------------------------------------------------- aggregation
COLUMNS = ["job", "overrides", "status", "exit", "tau", "patience", "max_steps", "warm_start", "ce", "ce_lo", "ce_hi", "ppl", "ms_per_token",
           "ms_min", "ms_max", "ms_repeats", "ms_per_answer", "ms_per_answer_lo", "ms_per_answer_hi",
           "ms_per_answer_repeats", "ms_per_context", "applications_per_token", "mean_applications", "layer_applications",
           "loop_layer_applications", "checks_per_token", "flops_per_token", "group_layers", "outside_layers", "tokens", "tokens_per_s", "batch1_apps_mismatch",
           "batch1_max_abs_dnll", "reused", "error"]


def _job_row(job_dir: Path) -> dict:
    row = {c: "" for c in COLUMNS}
    row["job"] = int(job_dir.name)
    ov = job_dir / ".hydra" / "overrides.yaml"
    if ov.is_file():
        row["overrides"] = " ".join(OmegaConf.to_container(OmegaConf.load(ov)))
    cfg_file = job_dir / ".hydra" / "config.yaml"
    row["warm_start"] = False
    if cfg_file.is_file():
        job_cfg = OmegaConf.load(cfg_file)
        ex = job_cfg.get("exit") or {}
        row["exit"], row["tau"] = ex.get("name", ""), ex.get("tau")
        row["warm_start"] = bool(OmegaConf.select(job_cfg, "eval.warm_start", default=False))
        if OmegaConf.is_list(row["tau"]):  # one per group
            row["tau"] = list(row["tau"])
    m_file = job_dir / "metrics.json"
    if m_file.is_file():
        m = json.loads(m_file.read_text())
        ev = m.get("eval")
        row["status"] = "ok"
        row["overrides"] = row["overrides"] or m.get("overrides", "")  # a report's job files its own
        row["reused"] = bool(m.get("reused", False))
        if ev:
            apps = ev["applications_per_token"]
            lo, hi = ev.get("ce_ci", ["", ""])
            row.update(exit=ev["exit"], tau=ev["tau"], max_steps=ev.get("max_steps", ""), ce=ev["ce"], ce_lo=lo, ce_hi=hi,
                       warm_start=bool(ev.get("warm_start", False)), ppl=ev["ppl"], ms_per_token=ev["ms_per_token"], ms_min=ev.get("ms_per_token_min", ""),
                       ms_max=ev.get("ms_per_token_max", ""), applications_per_token=apps,
                       mean_applications=sum(apps) / len(apps) if apps else 0.0, tokens=ev.get("tokens", ""),
                       layer_applications=ev.get("layer_applications", sum(apps) / len(apps) if apps else 0.0),
                       loop_layer_applications=ev.get("loop_layer_applications", ev.get("layer_applications", "")),
                       checks_per_token=ev.get("checks_per_token", ""),
                       flops_per_token=ev.get("flops_per_token", ""), group_layers=ev.get("group_layers", ""),
                       outside_layers=ev.get("outside_layers", ""), ms_repeats=ev.get("ms_per_token_repeats", ""),
                       tokens_per_s=ev.get("tokens_per_s", ""),
                       batch1_apps_mismatch=(ev.get("batch_check") or {}).get("apps_mismatch", ""),
                       batch1_max_abs_dnll=(ev.get("batch_check") or {}).get("max_abs_dnll", ""))
            if ev.get("ms_per_answer") is not None:  # a task's time per answer (`scoring.latency_of`)
                row.update(ms_per_answer=ev["ms_per_answer"], ms_per_answer_lo=ev["ms_per_answer_ci"][0],
                           ms_per_answer_hi=ev["ms_per_answer_ci"][1],
                           ms_per_answer_repeats=ev["ms_per_answer_repeats"], ms_per_context=ev.get("ms_per_context"))
            if ev["exit"] == "argmax_stability":  # its k; the other rules do not read it
                row["patience"] = ev.get("patience", "")
    elif (job_dir / "error.txt").is_file():
        lines = (job_dir / "error.txt").read_text().strip().splitlines()
        row["status"], row["error"] = "failed", lines[-1] if lines else "error"
    else:
        row["status"] = "incomplete"
    return row


def collect(sweep_dir: str | Path) -> list[dict]:
    """One row per job directory (`<sweep_dir>/<n>/`), by job number; each row's
    `frontier` says whether it is a point of the fixed frontier (`_reference_warm`)."""
    jobs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()]
    rows = [_job_row(p) for p in sorted(jobs, key=lambda p: int(p.name))]
    warm = _reference_warm(rows)
    for r in rows:
        r["frontier"] = _uniform_fixed(r) and r["warm_start"] is warm
    return rows


def _fmt(v, digits=4) -> str:
    if v is None or v == "":
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, list):  # per group: applications (floats), max_steps (integers)
        return " / ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in v)
    return str(v)


def _uniform_fixed(r: dict) -> bool:
    """A fixed-depth job: exit=fixed with one max_steps for every group (a fixed job with
    one max_steps per group is compared against the frontier like a rule)."""
    return r["exit"] == "fixed" and is_number(r["max_steps"])


def _reference_warm(rows: list[dict]) -> bool:
    """Whether the fixed frontier is the warm-start grid (eval.warm_start=true): only when
    the sweep has fewer than two cold fixed depths and at least two warm ones, i.e. the
    user ran the whole sweep warm. Otherwise it is the cold grid (docs/spec.md §4), and
    warm fixed jobs are the family "fixed (warm start)", compared with it like a rule."""
    def depths(warm: bool) -> set:
        return {r["max_steps"] for r in rows
                if r["status"] == "ok" and r["ce"] != "" and _uniform_fixed(r) and r["warm_start"] is warm}
    return len(depths(False)) < 2 and len(depths(True)) >= 2


def family(r: dict) -> str:
    """The curve a job belongs to in frontier.csv/.md and Fig. 4: its exit rule, "fixed (per
    group)" for exit=fixed with one max_steps per group, and "(warm start)" added when it
    ran with eval.warm_start=true (continuous compute): "fixed (warm start)", "kl (warm start)"."""
    quals = ["per group"] if r["exit"] == "fixed" and isinstance(r["max_steps"], list) else []
    quals += ["warm start"] if r.get("warm_start") is True else []
    return r["exit"] + (f" ({', '.join(quals)})" if quals else "")


def _exit_label(r: dict) -> str:
    """The exit column of sweep_results.md: the rule, "(warm start)" added under eval.warm_start."""
    return _fmt(r["exit"]) + (" (warm start)" if r.get("warm_start") is True else "")


def _ci(v, lo, hi, digits=4) -> str:
    if v in ("", None) or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if lo in ("", None) or (isinstance(lo, float) and math.isnan(lo)):
        return _fmt(v, digits)
    return f"{_fmt(v, digits)} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"


def tau_label(r: dict) -> str:
    """τ as the tables show it: one number, one per group in brackets, or argmax_stability's k."""
    t = r["tau"]
    if r.get("patience") not in ("", None):
        return f"k = {r['patience']}"
    if isinstance(t, list) and t and all(is_number(x) for x in t):
        return "[" + ", ".join(f"{x:g}" for x in t) + "]"
    return f"{t:g}" if is_number(t) else "—"


def markdown(rows: list[dict]) -> str:
    head = ["job", "exit", "τ", "max steps", "CE [95% CI]", "PPL", "ms/token [min, max]",
            "applications per token (per group)", "mean", "layer applications", "status"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r["status"] + (f": {r['error']}" if r["error"] else "") + (" (reused checkpoint)" if r["reused"] is True else "")
        out.append("| " + " | ".join([str(r["job"]), _exit_label(r), tau_label(r), _fmt(r["max_steps"]),
                                      _ci(r["ce"], r["ce_lo"], r["ce_hi"]), _fmt(r["ppl"], 2),
                                      _ci(r["ms_per_token"], r["ms_min"], r["ms_max"], 2),
                                      _fmt(r["applications_per_token"]), _fmt(r["mean_applications"], 2),
                                      _fmt(r["layer_applications"], 2), status.replace("|", "/")]) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------ frontier (SPEC §4b)
FRONTIER_COLUMNS = ["job", "exit", "family", "warm_start", "tau", "patience", "ce", "ce_lo", "ce_hi", "layer_applications",
                    "layer_applications_lo", "layer_applications_hi", "mean_applications", "frontier_n", "frontier_ce",
                    "d_ce", "d_ce_lo", "d_ce_hi", "hull_ce", "d_hull", "d_hull_lo", "d_hull_hi", "p_hull", "p_holm",
                    "ms_frontier_ce", "d_ms", "d_ms_lo", "d_ms_hi", "fixed_n", "reached", "saving", "saving_lo", "saving_hi",
                    "ms_per_token", "ms_per_answer", "latency", "fixed_ms_at_ce", "loop_layer_applications", "oracle_cost_at_ce", "oracle_saving",
                    "oracle_saving_lo", "oracle_saving_hi", "verdict", "verdict_holm"]
RESAMPLES = 1000  # bootstrap resamples of the units (docs/spec.md §4b: at least 1000)
ORACLE_EPS = np.concatenate([[0.0], np.logspace(-5, 0, 26)])  # the oracle curve's ε grid
# its verdict cell: not a rule; it reads the target, so no run reaches it, and it is priced as its loop alone
ORACLE = "oracle (best uniform depth within ε; reads the target: unreachable, priced as its loop alone)"


# Differences this small are float rounding, not a measurement: a setting decoded in another
# batch (a shared sweep batch, a calibrated job decoded alone) gets the same records to
# ~1e-7 nats in float32, and an interval of such differences must not "resolve".
ROUNDING = 1e-6


def verdict(lo: float, hi: float) -> str:
    """From the 95% CI of CE − (fixed frontier at the rule's own layer applications); an
    interval inside ±`ROUNDING` is not resolved."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or max(abs(lo), abs(hi)) < ROUNDING:
        return "not resolved"
    return "beats the fixed frontier" if hi < 0 else ("worse than the fixed frontier" if lo > 0 else "not resolved")


def holm_verdict(d: float, p_adj: float) -> str:
    """The verdict at family-wise level 5% (Holm): resolved only if the adjusted p < 0.05
    (and the difference exceeds float rounding, `ROUNDING`)."""
    if not (is_number(p_adj) and is_number(d)) or p_adj >= 1 - stats.LEVEL or abs(d) < ROUNDING:
        return "not resolved"
    return "beats the fixed frontier" if d < 0 else "worse than the fixed frontier"


def sweep_cost(rows: list[dict]) -> stats.Cost | None:
    """The sweep's cost in layer applications (docs/spec.md §4b), from its jobs' metrics.json
    (group_layers, outside_layers); None for records that do not carry them (older jobs:
    the cost is then the mean applications over groups)."""
    for r in rows:
        if r["status"] == "ok" and isinstance(r.get("group_layers"), list) and is_number(r.get("outside_layers")):
            return stats.Cost(r["group_layers"], r["outside_layers"]) if r["group_layers"] else None
    return None


def frontier_inputs(sweep_dir: Path, rows: list[dict]) -> tuple[dict, dict, np.ndarray | None] | None:
    """Per-token records of the sweep's ok jobs, the fixed ones by n, and the oracle's NLL
    at every n (or None); None when the sweep has fewer than two fixed depths."""
    tokens, fixed, by_n, ref = {}, {}, None, None
    for r in rows:
        f = Path(sweep_dir) / str(r["job"]) / "eval_tokens.csv"
        if r["status"] != "ok" or r["ce"] == "" or not f.is_file():
            continue
        t = token_files.read_tokens(f)
        key = (t["window"].tolist(), t["position"].tolist(), t["target"].tolist())
        if ref is None:
            ref = key
        elif key != ref:
            raise ValueError(f"frontier: {f} scores other tokens than the sweep's first job; "
                             "every job of a frontier must score the same held-out tokens (same eval.tokens)")
        tokens[r["job"]] = t
        if r["frontier"]:
            fixed.setdefault(int(r["max_steps"]), t)
        if r["exit"] == "oracle" and by_n is None and (f.parent / "oracle_nll.npy").is_file():
            by_n = np.load(f.parent / "oracle_nll.npy")
    if len(fixed) < 2:
        return None
    return tokens, fixed, by_n


def error_inputs(inputs: tuple[dict, dict, np.ndarray | None]) -> tuple[dict, dict, None] | None:
    """`frontier_inputs` with each token's error (1 − correct: a task's answer tokens) in place
    of its NLL, so every comparison of the frontier is made in accuracy (docs/spec.md §6); None
    unless every job's record has the `correct` column."""
    tokens, fixed, _ = inputs
    if not all("correct" in t for t in tokens.values()):
        return None
    err = {job: {**t, "nll": 1.0 - t["correct"].astype(float)} for job, t in tokens.items()}
    return err, {n: err[next(j for j, t in tokens.items() if t is f)] for n, f in fixed.items()}, None


def bootstrap(inputs: tuple[dict, dict, np.ndarray | None], resamples: int = RESAMPLES) -> stats.Bootstrap:
    """The sweep's resamples: whole windows (the `window` column every job shares), the same
    draws for every job (docs/spec.md §4b)."""
    return stats.Bootstrap(next(iter(inputs[1].values()))["window"], resamples)


def latency_keys(rows: list[dict]) -> tuple[str, str]:
    """The latency the equal-latency comparison reads: ms per answer (a task's time per
    answer, `scoring.latency_of`) when every timed job of the sweep has it, else ms per
    token; (the row's key, the key of its repeats)."""
    timed = [r for r in rows if r["status"] == "ok" and is_number(r["ms_per_token"])]
    if timed and all(is_number(r.get("ms_per_answer")) for r in timed):
        return "ms_per_answer", "ms_per_answer_repeats"
    return "ms_per_token", "ms_repeats"


def frontier_rows(inputs: tuple[dict, dict, np.ndarray | None], rows: list[dict], boot: stats.Bootstrap,
                  cost: stats.Cost | None = None) -> list[dict]:
    """SPEC §4b, for every job that is not fixed: `stats.compare` against the fixed jobs at
    equal cost (`cost`: layer applications; None: mean applications), the fixed frontier at
    the job's ms/token with the spread over timing repeats, and the oracle's saving at the
    job's CE (from the oracle job's NLLs, over ORACLE_EPS). `inputs` from `frontier_inputs`;
    `boot`: the resamples of whole windows, one set shared by every job. The interval of
    each row is per comparison; `p_holm` and `verdict_holm` control the family-wise error
    over the table's rows (every job but the oracle, Holm's procedure)."""
    tokens, fixed, by_n = inputs
    ms_key, spread_key = latency_keys(rows)
    fixed_nll = {n: t["nll"] for n, t in sorted(fixed.items())}
    fixed_rows = {int(r["max_steps"]): r for r in rows if r["frontier"] and r["ce"] != ""}
    fixed_ms = {n: r[ms_key] for n, r in fixed_rows.items()}
    timed = [n for n in fixed if is_number(fixed_ms.get(n))]
    fixed_by_ms = {fixed_ms[n]: fixed[n]["nll"] for n in timed}
    spreads = {fixed_ms[n]: fixed_rows[n][spread_key] for n in timed}
    spread_ok = all(isinstance(v, list) and v for v in spreads.values())
    out = []
    for r in rows:
        if r["job"] not in tokens or r["frontier"]:  # the frontier itself
            continue
        t = tokens[r["job"]]
        # the job's own cost per token (its checks included) where its record has it; else its loop
        c = stats.compare(t["nll"], t["cost"] if "cost" in t else t["apps"], fixed_nll, boot, cost)
        row = {k: c.get(k, "") for k in FRONTIER_COLUMNS}
        row.update(job=r["job"], exit=r["exit"], family=family(r), warm_start=r["warm_start"], tau=r["tau"],
                   patience=r.get("patience", ""), ms_per_token=r["ms_per_token"],
                   ms_per_answer=r.get("ms_per_answer", ""), latency=ms_key,
                   layer_applications=c["cost"], layer_applications_lo=c["cost_lo"], layer_applications_hi=c["cost_hi"],
                   loop_layer_applications=float(np.mean(cost.loop(t["apps"]) if cost is not None
                                                         else np.asarray(t["apps"], float).mean(axis=1))),
                   mean_applications=float(np.asarray(t["apps"], float).mean()),
                   fixed_ms_at_ce=fixed_ms.get(c["fixed_n"], ""),
                   verdict=ORACLE if r["exit"] == "oracle" else verdict(c["d_hull_lo"], c["d_hull_hi"]))
        if is_number(r[ms_key]) and len(fixed_by_ms) >= 2:
            own = r[spread_key] if isinstance(r.get(spread_key), list) and r[spread_key] else None
            v = stats.vs_frontier_at(t["nll"], r[ms_key], fixed_by_ms, boot,
                                     own if spread_ok else None, spreads if (spread_ok and own) else None)
            row.update(ms_frontier_ce=v["frontier_ce"], d_ms=v["d"], d_ms_lo=v["d_lo"], d_ms_hi=v["d_hi"])
        if by_n is not None:
            o = stats.oracle_saving(by_n, ORACLE_EPS, t["nll"], fixed_nll, boot, cost)
            row.update(oracle_cost_at_ce=o["applications"], oracle_saving=o["saving"],
                       oracle_saving_lo=o["saving_lo"], oracle_saving_hi=o["saving_hi"])
        out.append(row)
    family_rows = [r for r in out if r["exit"] != "oracle"]
    adj = stats.holm([r["p_hull"] for r in family_rows])
    for r, p in zip(family_rows, adj):
        r["p_holm"] = float(p)
        r["verdict_holm"] = holm_verdict(r["d_hull"], p)
    return out


def frontier_markdown(rows: list[dict], what: str = "CE") -> str:
    """The frontier table; `what` names the quality column (CE, or a task's error rate)."""
    m = sum(r["exit"] != "oracle" for r in rows)
    unit = "ms/answer" if any(r.get("latency") == "ms_per_answer" for r in rows) else "ms/token"
    head = ["job", "exit", "τ", "CE [95% CI]", "cost: layer applications + checks [95% CI]", "loop alone",
            "mean applications", "best fixed within its cost: n, CE", "CE − that [95% CI]", "fixed frontier at its cost",
            "CE − frontier at its cost [95% CI]", f"CE − fixed frontier at its {unit} [95% CI, incl. timing spread]",
            "fixed n reaching CE", "saving vs fixed [95% CI]", "oracle saving at CE (an unreachable bound)",
            f"{unit} (fixed at CE)", "verdict (per comparison)", f"verdict (Holm, m = {m})"]
    head = [h.replace("CE", what) for h in head]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pct = lambda v: "—" if v in ("", None) or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        fr = "—" if r["frontier_n"] in ("", None) else f"{r['frontier_n']}, {_fmt(r['frontier_ce'])}"
        reach = f"{r['fixed_n']}" + ("" if r["reached"] else " (not reached: lower bound)")
        sav = f"{pct(r['saving'])} [{pct(r['saving_lo'])}, {pct(r['saving_hi'])}]"
        osav = "—" if r["oracle_saving"] == "" else (f"{pct(r['oracle_saving'])} [{pct(r['oracle_saving_lo'])}, "
                                                    f"{pct(r['oracle_saving_hi'])}]")
        ms = f"{_fmt(r[r.get('latency') or 'ms_per_token'], 2)} ({_fmt(r['fixed_ms_at_ce'], 2)})"
        out.append("| " + " | ".join([str(r["job"]), r.get("family") or r["exit"], tau_label(r), _ci(r["ce"], r["ce_lo"], r["ce_hi"]),
                                      _ci(r["layer_applications"], r["layer_applications_lo"], r["layer_applications_hi"], 2),
                                      _fmt(r.get("loop_layer_applications"), 2), _fmt(r["mean_applications"], 2), fr,
                                      _ci(r["d_ce"], r["d_ce_lo"], r["d_ce_hi"]), _fmt(r["hull_ce"]),
                                      _ci(r["d_hull"], r["d_hull_lo"], r["d_hull_hi"]),
                                      _ci(r["d_ms"], r["d_ms_lo"], r["d_ms_hi"]),
                                      reach, sav, osav, ms,
                                      r["verdict"], r.get("verdict_holm") or "—"]) + " |")
    notes = (f"\nIntervals: 95% paired percentile bootstrap over whole windows ({RESAMPLES} resamples, the same "
             f"for every job), each per comparison; the Holm column controls the family-wise error of the {m} "
             "comparisons with the fixed frontier at 5%. Cost: layer applications per token plus the rule's checks in "
             "layer equivalents (a decoding check: the layers after the group and the head; docs/spec.md §4b); "
             "\"loop alone\" leaves the checks out. The oracle reads the target and is priced as its loop alone: "
             "the best uniform depth per token within ε, an unreachable reference, not a bound on rules that "
             "spend different depths per group.\n")
    return "\n".join(out) + "\n" + notes


def oracle_curve(by_n: np.ndarray, cost: stats.Cost | None = None) -> list[tuple[float, float, float]]:
    """(ε, mean cost, CE) of the oracle over ORACLE_EPS (cost: layer applications with a Cost)."""
    return [(float(e), *stats.oracle_point(by_n, e, cost)[::-1]) for e in ORACLE_EPS]


def paired_vs_max(inputs: tuple[dict, dict, np.ndarray | None], boot: stats.Bootstrap) -> dict:
    """{job: (d, lo, hi)}: every ok job's CE minus the CE of the fixed job at the largest n,
    paired over windows with a 95% bootstrap CI (the absolute CE's CI, about ±0.2 nats
    over 4096 tokens, hides differences of 1e-3 that the paired one resolves)."""
    tokens, fixed, _ = inputs
    ref = fixed[max(fixed)]["nll"]
    return {job: stats.diff_ci(t["nll"], ref, boot) for job, t in tokens.items()}


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})
    tmp.replace(path)
