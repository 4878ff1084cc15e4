"""Sweeps: failure-tolerant Hydra jobs and `SweepSummary`, the Hydra callback that aggregates them.

`SweepSummary` (registered in `conf/config.yaml` and `conf/evaluate.yaml` under
`hydra.callbacks`) works for any multirun of `recdepth.train` or `recdepth.evaluate`: after
every job and at the end of the sweep it reads every job directory of the sweep and writes,
into the sweep directory,

    sweep_results.csv   one row per job: job, overrides, status, exit, tau (a list when
                        one per group), patience (argmax_stability), max_steps,
                        warm_start (eval.warm_start, continuous compute), ce
                        with its 95% CI (over windows), ppl, ms_per_token (median, min,
                        max, every repeat), applications per group and their mean, layer
                        applications and FLOPs per token, tokens, tokens_per_s (batched),
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

and, at the end, a W&B table with the same rows when the sweep's config has `logger.wandb`.
A job that raised is recorded as `failed` (its error in `<job>/error.txt`); the others are
still aggregated, and the command exits non-zero after the sweep (`recdepth.cli`).
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

import numpy as np
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recdepth import stats, task_tables

log = logging.getLogger("recdepth.sweep")


# -------------------------------------------------------------- aggregation
COLUMNS = ["job", "overrides", "status", "exit", "tau", "patience", "max_steps", "warm_start", "ce", "ce_lo", "ce_hi", "ppl", "ms_per_token",
           "ms_min", "ms_max", "ms_repeats", "applications_per_token", "mean_applications", "layer_applications",
           "flops_per_token", "group_layers", "outside_layers", "tokens", "tokens_per_s", "batch1_apps_mismatch",
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
        row["reused"] = bool(m.get("reused", False))
        if ev:
            apps = ev["applications_per_token"]
            lo, hi = ev.get("ce_ci", ["", ""])
            row.update(exit=ev["exit"], tau=ev["tau"], max_steps=ev.get("max_steps", ""), ce=ev["ce"], ce_lo=lo, ce_hi=hi,
                       warm_start=bool(ev.get("warm_start", False)), ppl=ev["ppl"], ms_per_token=ev["ms_per_token"], ms_min=ev.get("ms_per_token_min", ""),
                       ms_max=ev.get("ms_per_token_max", ""), applications_per_token=apps,
                       mean_applications=sum(apps) / len(apps) if apps else 0.0, tokens=ev.get("tokens", ""),
                       layer_applications=ev.get("layer_applications", sum(apps) / len(apps) if apps else 0.0),
                       flops_per_token=ev.get("flops_per_token", ""), group_layers=ev.get("group_layers", ""),
                       outside_layers=ev.get("outside_layers", ""), ms_repeats=ev.get("ms_per_token_repeats", ""),
                       tokens_per_s=ev.get("tokens_per_s", ""),
                       batch1_apps_mismatch=(ev.get("batch_check") or {}).get("apps_mismatch", ""),
                       batch1_max_abs_dnll=(ev.get("batch_check") or {}).get("max_abs_dnll", ""))
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


def _num(v) -> bool:
    return isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v)


def _uniform_fixed(r: dict) -> bool:
    """A fixed-depth job: exit=fixed with one max_steps for every group (a fixed job with
    one max_steps per group is compared against the frontier like a rule)."""
    return r["exit"] == "fixed" and _num(r["max_steps"])


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


def _tau(r: dict) -> str:
    """τ as the tables show it: one number, one per group in brackets, or argmax_stability's k."""
    t = r["tau"]
    if r.get("patience") not in ("", None):
        return f"k = {r['patience']}"
    if isinstance(t, list) and t and all(_num(x) for x in t):
        return "[" + ", ".join(f"{x:g}" for x in t) + "]"
    return f"{t:g}" if _num(t) else "—"


def markdown(rows: list[dict]) -> str:
    head = ["job", "exit", "τ", "max steps", "CE [95% CI]", "PPL", "ms/token [min, max]",
            "applications per token (per group)", "mean", "layer applications", "status"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r["status"] + (f": {r['error']}" if r["error"] else "") + (" (reused checkpoint)" if r["reused"] is True else "")
        out.append("| " + " | ".join([str(r["job"]), _exit_label(r), _tau(r), _fmt(r["max_steps"]),
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
                    "ms_per_token", "fixed_ms_at_ce", "oracle_cost_at_ce", "oracle_saving",
                    "oracle_saving_lo", "oracle_saving_hi", "verdict", "verdict_holm"]
RESAMPLES = 1000  # bootstrap resamples of the units (docs/spec.md §4b: at least 1000)
ORACLE_EPS = np.concatenate([[0.0], np.logspace(-5, 0, 26)])  # the oracle curve's ε grid
ORACLE = "oracle (best uniform depth within ε; reads the target)"  # its verdict cell: not a rule, not a bound


# Differences this small are float rounding, not a measurement: a setting decoded in another
# batch (a shared sweep batch, a calibrated job decoded alone) gets the same records to
# ~1e-7 nats in float32, and an interval of such differences must not "resolve".
ROUNDING = 1e-6


def _verdict(lo: float, hi: float) -> str:
    """From the 95% CI of CE − (fixed frontier at the rule's own layer applications); an
    interval inside ±`ROUNDING` is not resolved."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or max(abs(lo), abs(hi)) < ROUNDING:
        return "not resolved"
    return "beats the fixed frontier" if hi < 0 else ("worse than the fixed frontier" if lo > 0 else "not resolved")


def _holm_verdict(d: float, p_adj: float) -> str:
    """The verdict at family-wise level 5% (Holm): resolved only if the adjusted p < 0.05
    (and the difference exceeds float rounding, `ROUNDING`)."""
    if not (_num(p_adj) and _num(d)) or p_adj >= 1 - stats.LEVEL or abs(d) < ROUNDING:
        return "not resolved"
    return "beats the fixed frontier" if d < 0 else "worse than the fixed frontier"


def sweep_cost(rows: list[dict]) -> stats.Cost | None:
    """The sweep's cost in layer applications (docs/spec.md §4b), from its jobs' metrics.json
    (group_layers, outside_layers); None for records that do not carry them (older jobs:
    the cost is then the mean applications over groups)."""
    for r in rows:
        if r["status"] == "ok" and isinstance(r.get("group_layers"), list) and _num(r.get("outside_layers")):
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
        t = stats.read_tokens(f)
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
    fixed_nll = {n: t["nll"] for n, t in sorted(fixed.items())}
    fixed_rows = {int(r["max_steps"]): r for r in rows if r["frontier"] and r["ce"] != ""}
    fixed_ms = {n: r["ms_per_token"] for n, r in fixed_rows.items()}
    timed = [n for n in fixed if _num(fixed_ms.get(n))]
    fixed_by_ms = {fixed_ms[n]: fixed[n]["nll"] for n in timed}
    spreads = {fixed_ms[n]: fixed_rows[n]["ms_repeats"] for n in timed}
    spread_ok = all(isinstance(v, list) and v for v in spreads.values())
    out = []
    for r in rows:
        if r["job"] not in tokens or r["frontier"]:  # the frontier itself
            continue
        t = tokens[r["job"]]
        c = stats.compare(t["nll"], t["apps"], fixed_nll, boot, cost)
        row = {k: c.get(k, "") for k in FRONTIER_COLUMNS}
        row.update(job=r["job"], exit=r["exit"], family=family(r), warm_start=r["warm_start"], tau=r["tau"],
                   patience=r.get("patience", ""), ms_per_token=r["ms_per_token"],
                   layer_applications=c["cost"], layer_applications_lo=c["cost_lo"], layer_applications_hi=c["cost_hi"],
                   mean_applications=float(np.asarray(t["apps"], float).mean()),
                   fixed_ms_at_ce=fixed_ms.get(c["fixed_n"], ""),
                   verdict=ORACLE if r["exit"] == "oracle" else _verdict(c["d_hull_lo"], c["d_hull_hi"]))
        if _num(r["ms_per_token"]) and len(fixed_by_ms) >= 2:
            own = r["ms_repeats"] if isinstance(r.get("ms_repeats"), list) and r["ms_repeats"] else None
            v = stats.vs_frontier_at(t["nll"], r["ms_per_token"], fixed_by_ms, boot,
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
        r["verdict_holm"] = _holm_verdict(r["d_hull"], p)
    return out


def frontier_markdown(rows: list[dict], what: str = "CE") -> str:
    """The frontier table; `what` names the quality column (CE, or a task's error rate)."""
    m = sum(r["exit"] != "oracle" for r in rows)
    head = ["job", "exit", "τ", "CE [95% CI]", "layer applications [95% CI]", "mean applications",
            "best fixed within its cost: n, CE", "CE − that [95% CI]", "fixed frontier at its cost",
            "CE − frontier at its cost [95% CI]", "CE − fixed frontier at its ms/token [95% CI, incl. timing spread]",
            "fixed n reaching CE", "saving vs fixed [95% CI]", "oracle saving at CE",
            "ms/token (fixed at CE)", "verdict (per comparison)", f"verdict (Holm, m = {m})"]
    head = [h.replace("CE", what) for h in head]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    pct = lambda v: "—" if v in ("", None) or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}%"  # noqa: E731
    for r in rows:
        fr = "—" if r["frontier_n"] in ("", None) else f"{r['frontier_n']}, {_fmt(r['frontier_ce'])}"
        reach = f"{r['fixed_n']}" + ("" if r["reached"] else " (not reached: lower bound)")
        sav = f"{pct(r['saving'])} [{pct(r['saving_lo'])}, {pct(r['saving_hi'])}]"
        osav = "—" if r["oracle_saving"] == "" else (f"{pct(r['oracle_saving'])} [{pct(r['oracle_saving_lo'])}, "
                                                    f"{pct(r['oracle_saving_hi'])}]")
        ms = f"{_fmt(r['ms_per_token'], 2)} ({_fmt(r['fixed_ms_at_ce'], 2)})"
        out.append("| " + " | ".join([str(r["job"]), r.get("family") or r["exit"], _tau(r), _ci(r["ce"], r["ce_lo"], r["ce_hi"]),
                                      _ci(r["layer_applications"], r["layer_applications_lo"], r["layer_applications_hi"], 2),
                                      _fmt(r["mean_applications"], 2), fr,
                                      _ci(r["d_ce"], r["d_ce_lo"], r["d_ce_hi"]), _fmt(r["hull_ce"]),
                                      _ci(r["d_hull"], r["d_hull_lo"], r["d_hull_hi"]),
                                      _ci(r["d_ms"], r["d_ms_lo"], r["d_ms_hi"]),
                                      reach, sav, osav, ms,
                                      r["verdict"], r.get("verdict_holm") or "—"]) + " |")
    notes = (f"\nIntervals: 95% paired percentile bootstrap over whole windows ({RESAMPLES} resamples, the same "
             f"for every job), each per comparison; the Holm column controls the family-wise error of the {m} "
             "comparisons with the fixed frontier at 5%. Cost: layer applications per token (docs/spec.md §4b). "
             "The oracle reads the target: it is the best uniform depth per token within ε, not a bound on rules "
             "that spend different depths per group.\n")
    return "\n".join(out) + "\n" + notes


def oracle_curve(by_n: np.ndarray, cost: stats.Cost | None = None) -> list[tuple[float, float, float]]:
    """(ε, mean cost, CE) of the oracle over ORACLE_EPS (cost: layer applications with a Cost)."""
    return [(float(e), *stats.oracle_point(by_n, e, cost)[::-1]) for e in ORACLE_EPS]




def fig4(rows: list[dict], oracle: list[tuple[float, float, float]] | None = None, front: list[dict] | None = None,
         paired: dict | None = None):
    """The paper's Fig. 4: latency, PPL, CE and compute against τ, one line per rule; with
    fixed jobs at two or more depths and `paired` (`paired_vs_max`), a second row: CE
    against mean applications and against ms/token, every `family` a curve (the fixed
    grid under warm start is "fixed (warm start)"), the fixed-depth frontier in black and
    the oracle (`oracle`: (ε, applications, CE) points) dashed, and each family's CE minus
    the frontier at equal applications (`front`: frontier_rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["ce"] != ""]
    fixed = sorted((r for r in ok if r["frontier"]), key=lambda r: r["max_steps"])
    frontier = len({r["max_steps"] for r in fixed}) >= 2 and bool(paired)
    panels = [("ms_per_token", "ms / token"), ("ppl", "PPL"), ("ce", "CE (nats)"),
              ("layer_applications", "layer applications per token")]
    fig, axes = plt.subplots(2 if frontier else 1, 4, figsize=(16, 7.4 if frontier else 3.6), squeeze=False)
    rules = sorted({family(r) for r in ok})  # one line per family: a rule, with or without warm start
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors  # more rules than tab10 has colours
    colors = {rule: palette[i % len(palette)] for i, rule in enumerate(rules)}
    per_group = [r["job"] for r in ok if isinstance(r["tau"], list)]
    if per_group:
        log.info("fig4: job(s) %s have one τ per group; left out of the panels against τ (the frontier panels "
                 "show them, by layer applications)", ", ".join(map(str, per_group)))
    on_tau = [r for r in ok if not isinstance(r["tau"], list)]
    taus = sorted({r["tau"] for r in on_tau if _num(r["tau"])})
    for ax, (key, label) in zip(axes[0], panels):
        for rule in rules:
            pts = sorted((r["tau"], r[key]) for r in on_tau if family(r) == rule and _num(r["tau"]) and _num(r[key]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[rule], label=rule)
            flat: dict[str, list] = {}  # one level across τ (fixed at one depth; argmax_stability per k)
            for r in on_tau:
                if family(r) == rule and not _num(r["tau"]) and _num(r[key]):
                    flat.setdefault(f"{rule} (k = {r['patience']})" if r.get("patience", "") != "" else f"{rule} (no τ)",
                                    []).append(r[key])
            for i, (name, vs) in enumerate(sorted(flat.items()) if not (rule.startswith("fixed") and frontier) else []):
                ax.axhline(sum(vs) / len(vs), color=colors[rule], ls=("--", ":", "-.")[i % 3], label=name)
        if taus:
            ax.set_xscale("log")
        ax.set_xlabel("τ")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if frontier:
        _frontier_panels(axes[1], ok, [r for r in fixed if r["job"] in paired], colors, oracle, front or [], paired)
    n_failed = sum(r["status"] != "ok" for r in rows)
    fig.suptitle("Fig. 4: exit policies — latency and quality against the threshold τ"
                 + ("; below, against compute, with the fixed-depth frontier" if frontier else "")
                 + (f" ({n_failed} job(s) not ok, left out)" if n_failed else ""), fontsize=10)
    fig.tight_layout()
    return fig


def paired_vs_max(inputs: tuple[dict, dict, np.ndarray | None], boot: stats.Bootstrap) -> dict:
    """{job: (d, lo, hi)}: every ok job's CE minus the CE of the fixed job at the largest n,
    paired over windows with a 95% bootstrap CI (the absolute CE's CI, about ±0.2 nats
    over 4096 tokens, hides differences of 1e-3 that the paired one resolves)."""
    tokens, fixed, _ = inputs
    ref = fixed[max(fixed)]["nll"]
    return {job: stats.diff_ci(t["nll"], ref, boot) for job, t in tokens.items()}


def _frontier_panels(axes, ok: list[dict], fixed: list[dict], colors: dict, oracle, front: list[dict],
                     paired: dict) -> None:
    """CE − CE(fixed at the largest n) against layer applications (log-x) and against
    ms/token; CE − the fixed frontier at equal layer applications (the verdict) against
    layer applications. Paired 95% CIs over windows."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    n_max = max(r["max_steps"] for r in fixed)

    def yerr(rs):
        return np.array([[paired[r["job"]][0] - paired[r["job"]][1] for r in rs],
                         [paired[r["job"]][2] - paired[r["job"]][0] for r in rs]])

    frontier = "fixed, warm start (frontier)" if fixed and fixed[0]["warm_start"] else "fixed (frontier)"
    groups = [(frontier, fixed, "k", "s-")]
    others = [r for r in ok if not r["frontier"]]  # rules, fixed per group, the fixed grid's other family
    groups += [(fam, sorted((r for r in others if family(r) == fam), key=lambda r: r["layer_applications"]),
                colors[fam], "s--" if fam == "fixed (warm start)" else "o-") for fam in sorted({family(r) for r in others})]
    shown = []
    for ax, xkey, xlabel in ((axes[0], "layer_applications", "layer applications per token"),
                             (axes[1], "ms_per_token", "ms / token (batch 1, median of repeats)")):
        for label, rs, color, style in groups:
            rs = [r for r in rs if _num(r[xkey]) and r["job"] in paired]
            if not rs:
                continue
            ys = [paired[r["job"]][0] for r in rs]
            # the y-range leaves out the shallow fixed depths (n < 3, both fixed families), far above the rest
            shown += [y for r, y in zip(rs, ys) if not (label.startswith("fixed") and _num(r["max_steps"])
                                                        and r["max_steps"] < 3)]
            ax.errorbar([r[xkey] for r in rs], ys, yerr=yerr(rs), fmt=style, color=color, ms=4, capsize=2, lw=1.2,
                        label=label)
            if label.startswith("fixed"):
                for r, y in zip(rs, ys):
                    ax.annotate(f"{r['max_steps']}", (r[xkey], y), fontsize=7, xytext=(3, 3),
                                textcoords="offset points")
        if oracle and xkey == "layer_applications":
            base = oracle[0][2]  # ε = 0: the oracle's own N-application NLLs
            ax.plot([p[1] for p in oracle], [p[2] - base for p in oracle], "k--", lw=1, label="oracle (ε from 0 to 1)")
        ax.axhline(0, color="grey", lw=0.8)
        if xkey == "layer_applications":  # fixed depths 1 .. 32: log, labelled at the fixed jobs' costs
            ax.set_xscale("log")
            ticks = sorted({round(r["layer_applications"]) for r in fixed if _num(r["layer_applications"])})
            ax.set_xticks([t for i, t in enumerate(ticks) if i % 2 == 0 or t == ticks[-1]])
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"CE − CE(fixed {n_max}) (nats)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    if shown:
        lo, hi = min(shown), max(shown)
        pad = 0.15 * (hi - lo) + 1e-4
        for ax in axes[:2]:
            ax.set_ylim(lo - pad, hi + pad)
    ax = axes[2]
    for fam in sorted({r["family"] for r in front} - {"oracle", "oracle (warm start)"}):
        rs = sorted((r for r in front if r["family"] == fam and _num(r["d_hull"]) and _num(r["d_hull_lo"])),
                    key=lambda r: r["layer_applications"])
        if rs:
            d = np.array([r["d_hull"] for r in rs])
            ax.errorbar([r["layer_applications"] for r in rs], d, fmt="o-", color=colors[fam], ms=4, capsize=2,
                        yerr=[d - [r["d_hull_lo"] for r in rs], [r["d_hull_hi"] for r in rs] - d], label=fam)
    ax.axhline(0, color="k", lw=1, label="fixed frontier" + (" (warm start)" if fixed and fixed[0]["warm_start"] else ""))
    ax.set_xlabel("layer applications per token")
    ax.set_ylabel("CE − fixed frontier at equal layer applications")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    axes[3].axis("off")
    axes[3].text(0, 1, "Left two: CE relative to the deepest fixed job,\n"
                 "paired 95% bootstrap CIs over windows; black squares:\n"
                 "fixed depth n (off-scale n are the shallow ones).\n"
                 "Third: CE minus the fixed frontier at the rule's own\n"
                 "layer applications (best per-token mix of two fixed\n"
                 "depths). Below 0 with its CI = beats fixed depth\n"
                 "(per comparison; frontier.md adds Holm's verdict).",
                 va="top", fontsize=8, transform=axes[3].transAxes)


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Write sweep_results.csv / .md, frontier.csv / .md (with fixed jobs at two or more
    depths) and Fig. 4 into sweep_dir; return the rows."""
    import matplotlib.pyplot as plt

    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    spaced = ("applications_per_token", "group_layers", "ms_repeats")
    _write_csv(sweep_dir / "sweep_results.csv", COLUMNS, [
        {**r, **{k: " ".join(map(str, r[k])) if isinstance(r[k], list) else r[k] for k in spaced}} for r in rows])
    (sweep_dir / "sweep_results.md").write_text(markdown(rows))
    oracle, paired, front = None, {}, []
    try:
        inputs = frontier_inputs(sweep_dir, rows)  # every job's eval_tokens.csv, read once
        if inputs is not None:
            boot, cost = bootstrap(inputs), sweep_cost(rows)
            front = frontier_rows(inputs, rows, boot, cost)
            if front:
                paired = paired_vs_max(inputs, boot)
                oracle = None if inputs[2] is None else oracle_curve(inputs[2], cost)
    except ValueError as e:
        log.warning("%s", e)
        front = []
    if front:
        _write_csv(sweep_dir / "frontier.csv", FRONTIER_COLUMNS, front)
        (sweep_dir / "frontier.md").write_text(frontier_markdown(front))
        errors = error_inputs(inputs)
        if errors is not None:  # a task: the same comparisons with accuracy as the quality axis
            acc = frontier_rows(errors, rows, boot, cost)
            _write_csv(sweep_dir / "frontier_accuracy.csv", FRONTIER_COLUMNS, acc)
            (sweep_dir / "frontier_accuracy.md").write_text(
                "Quality = error rate (1 − answer accuracy): the 'error' columns hold error rates, lower is "
                "better; ms/token comparisons too. No oracle column (the oracle picks its depth by NLL).\n\n"
                + frontier_markdown(acc, "error"))
    task_tables.write(sweep_dir, rows)  # a task: accuracy by difficulty and depth (docs/spec.md §6)
    if any(r["status"] == "ok" and r["ce"] != "" for r in rows):
        fig = fig4(rows, oracle, front, paired)
        for fmt in ("png", "pdf"):
            fig.savefig(sweep_dir / f"fig4_exits.{fmt}", dpi=150 if fmt == "png" else None)
        plt.close(fig)
    return rows


def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})
    tmp.replace(path)


def _wandb_table(config: DictConfig, sweep_dir: Path, rows: list[dict]) -> None:
    w = OmegaConf.select(config, "logger.wandb")
    if w is None:
        return
    from recdepth.config import wandb_init

    run = wandb_init(w, sweep_dir, f"sweep-{sweep_dir.name}", job_type="sweep-summary")
    if run is None:
        return
    import wandb

    try:  # the run is finished whatever happens while logging
        cols = [c for c in COLUMNS if c != "applications_per_token"]
        cell = lambda v: _fmt(v) if v in ("", None) else str(v) if isinstance(v, list) else v  # noqa: E731
        table = wandb.Table(columns=cols + ["applications_per_token"],
                            data=[[cell(r[c]) for c in cols]
                                  + [" / ".join(map(str, r["applications_per_token"] or []))] for r in rows])
        log_items = {"sweep/results": table}
        if (sweep_dir / "fig4_exits.png").is_file():
            log_items["sweep/fig4"] = wandb.Image(str(sweep_dir / "fig4_exits.png"))
        run.log(log_items)
    finally:
        run.finish()


class SweepSummary(Callback):
    """Hydra callback: aggregate a multirun after every job and at its end."""

    def on_job_end(self, config: DictConfig, job_return=None, **kwargs) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            summarize(Path(config.hydra.sweep.dir))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = summarize(sweep_dir)
        _wandb_table(config, sweep_dir, rows)
        n_ok = sum(r["status"] == "ok" for r in rows)
        log.info("sweep summary: %d/%d jobs ok -> %s", n_ok, len(rows), sweep_dir / "sweep_results.md")
