"""`python -m recdepth.report ckpt=<path>`: every exit rule on one checkpoint, compared fairly on
one frontier, in one command (docs/spec.md §4b, §4c).

    python -m recdepth.report ckpt=<run>/train/checkpoints/last.ckpt          # hydra.run.dir=<out>

First, every rule of `report.calibrate` is calibrated per group on the calibration split
(val tokens after the test split, `recdepth.calibrate`) to each of two targets: CE at most
`report.max_ce_increase` nats above fixed at max_steps, and at most
`report.layer_applications` layer applications per token; the searches in lockstep, each
round's settings decoded side by side (`app.calibration.calibrate_many`). Then one frontier sweep scores,
on the checkpoint's test split (val tokens [0, eval.tokens], as `recdepth.evaluate`),
  - the frontier's grid (`report.*`, the fields of `frontier_grid.FrontierGrid`, expanded by
    `frontier_grid.settings` as `make frontier` expands `hydra.sweeper.*`): the fixed
    depths (`report.fixed`, and report.max_steps, the reference), every rule at its τ grid
    (`report.rules`), argmax_stability at each k of `report.patience`, the learned gate at
    each probability of `report.gate_tau`, the oracle at each ε of `report.oracle`;
  - the calibrated answers,
each setting a `recdepth.evaluate` job (`score_jobs`), all but the oracle decoded ahead of
them as one batch, their batch-1 latency timed round-robin within each of `eval.repeats`
rounds, so drift of the machine hits every setting alike (`jobs.decode_shared`).
Winners are chosen on the calibration split only (`select`): the test split scores the
chosen settings and is never used to choose.
The learned gate is `report.gate` (a gate.pt of `recdepth.train_gate`), or trained here on
the train split when null.

Written into the run directory:
    jobs/<k>/           one recdepth.evaluate job per scored setting (config.yaml,
                        metrics.json with its family and `overrides`: what reruns it with
                        recdepth.evaluate, eval_tokens.csv)
    jobs/sweep_results.md, jobs/frontier.md, jobs/fig4_exits.png
                        the sweep summary of all jobs (recdepth.sweep): every job against
                        the fixed frontier at equal applications and at equal ms/token
    report.md / report.csv  the table: per target, each calibrated rule's setting, its
                        numbers on the calibration split (which choose the winner), the
                        target on test with its CI, its cost and CE, its CE minus the fixed
                        frontier at its own layer applications with the CI, and the winner
                        (chosen on calibration) with its test numbers
    report.png / .pdf   CE (minus fixed at max_steps) against layer applications and against
                        ms/token: the frontier, the oracle, each rule's τ grid, the
                        calibrated settings and the gate
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from recdepth import sweep
from recdepth.analysis import frontier, stats
from recdepth.analysis.token_files import read_tokens
from recdepth.app.calibration import (
    EMPIRICAL_TOKENS,
    calibrate_many,
    calibration_split,
    exit_group,
    load_splits,
    test_check,
)
from recdepth.app.jobs import decode_shared, for_model
from recdepth.cli.runner import compose_job, hydra_main, job_dir, refuse, start_job, task
from recdepth.config.frontier_grid import FRONTIER_FROM_CHECKPOINT, Setting, exit_line, settings
from recdepth.config.schema import ReportConfig, TrainGateConfig, validated
from recdepth.decode.scoring import model_cost
from recdepth.evaluate import evaluate
from recdepth.exits.calibration import search
from recdepth.exits.gate import load_gate
from recdepth.exits.policy import build
from recdepth.exits.rule import lookup
from recdepth.train_gate import train_gate
from recdepth.training.runs import write_json

log = logging.getLogger("recdepth.report")

TARGET_NAMES = {"max_ce_increase": "CE increase", "layer_applications": "layer applications"}


def calibration_searches(run: ReportConfig, opened, gate) -> tuple[list[search.Target], list[tuple]]:
    """The report's two targets and its (base policy, target) searches: every rule of
    report.calibrate to each target, at report.max_steps (`gate`: the gate's (weight, bias));
    exit=halt only on a model with a halting head."""
    r, model = run.report, opened.model
    targets = [search.Target("max_ce_increase", r.max_ce_increase),
               search.Target("layer_applications", r.layer_applications)]
    searches = [(for_model(build(rule, _start_tau(rule), groups=model.n_groups, min_steps=0, max_steps=r.max_steps,
                                 **({"gate": gate} if lookup(rule).gated else {})), opened), target)
                for rule in r.calibrate for target in targets
                if model.halt is not None or not lookup(rule).reads_head]  # exit=halt: a model with a head
    return targets, searches


def _start_tau(rule: str) -> float | None:
    """A valid τ to build a rule's policy before calibration replaces it (None: it has none):
    the rule's default."""
    r = lookup(rule)
    return r.default_tau if r.takes_tau else None


def report(cfg: DictConfig) -> dict:
    """Run the comparison of the module docstring; write and return report.json's dict."""
    out = job_dir(cfg, "report")
    run = validated(cfg)
    r, c = run.report, run.calibration
    refuse(out, "report.md", "jobs", what="a report")
    t_start = time.perf_counter()
    opened, sp, _, cal_tokens, labels = load_splits(run)
    model, N = opened.model, r.max_steps
    start_job(out, cfg)
    gate_path = gate_file(run, out) if ("gate" in r.calibrate or r.gate_tau) else None
    gate = load_gate(gate_path)[:2] if gate_path else None

    # 1. every rule of report.calibrate calibrated per group to each target on the calibration
    # split: the 20 searches in lockstep, each round's settings decoded side by side
    # (report.shared_rows rows a batch; rules that read the logits in batches of their own)
    split = calibration_split(run, model, cal_tokens, labels["calibration"], bos=opened.bos,
                              targets=opened.targets(len(cal_tokens), sp["calibration"][0]))
    ce_ref = float(split.decode(build("fixed", None, max_steps=N))["nll"].mean())
    targets, searches = calibration_searches(run, opened, gate)
    cal_range = tuple(sp["calibration"])
    t0 = time.perf_counter()
    found = calibrate_many(split, searches, c.per_group, c.max_evals, ce_ref, r.shared_rows)
    seconds = time.perf_counter() - t0
    log.info("calibrated %d (rule, target) pairs in lockstep (%.0f s; %d settings decoded, %d asks answered "
             "from earlier decodes)", len(searches), seconds, split.decodes, split.reused)
    answers = []
    for (base, target), (p, res, _, _) in zip(searches, found, strict=True):
        setting = Setting("calibrated", exit_group(p, gate_path if p.name == "gate" else None, cal_range))
        cal = {"target": {"kind": target.kind, "value": target.value}, "met": res.met,
               "ce": res.best.ce, "ce_increase": res.best.ce - res.ce_ref, "layer_applications": res.best.cost,
               "decodes": len(res.history), "seconds": seconds / len(searches), "exit": setting.exit}
        log.info("calibrated %s to %s %g: %s (%d decodes)", base.name, target.kind, target.value,
                 " ".join(exit_line(setting)), len(res.history))
        answers.append((setting, {"calibration": cal}))

    # 2. the frontier (report.*'s grid, the fixed reference at max_steps included) and the
    # calibrated answers on the test split: one sweep of recdepth.evaluate jobs
    grid = settings(dataclasses.replace(r, fixed=sorted({*r.fixed, N})), max_steps=N, gate=gate_path,
                    head=model.halt is not None)
    rows = score_jobs(run, out / "jobs", [(s, {}) for s in grid] + answers, r.shared_rows, opened)
    fixed_ref = next(j for j in rows if j["family"] == "fixed" and j["eval"]["max_steps"] == N)["rec"]["nll"]
    for row in rows:
        if row["family"] == "calibrated":
            target = search.Target(**row["calibration"]["target"])
            row["test_target"] = test_check(target, row["rec"], {"nll": fixed_ref}, split.cost)

    table = comparison(rows, targets, model_cost(model))
    (out / "report.md").write_text(markdown(table, targets, run, time.perf_counter() - t_start))
    fig = figure(rows, N, model_cost(model))
    for fmt in ("png", "pdf"):
        fig.savefig(out / f"report.{fmt}", dpi=150 if fmt == "png" else None)
    import matplotlib.pyplot as plt

    plt.close(fig)
    result = {opened.kind: opened.source, "seconds": time.perf_counter() - t_start,
              "splits": {k: list(v) for k, v in sp.items()}, "ce_ref_calibration": ce_ref,
              "grid_from": {k: "checkpoint" if k in r.from_checkpoint else "command" for k in FRONTIER_FROM_CHECKPOINT},
              "winners": table["winners"], "rows": table["rows"]}
    write_json(out / "report.json", result)
    log.info("report: %s (%.0f s)", out / "report.md", result["seconds"])
    return result


def score_jobs(run: ReportConfig, jobs_dir: Path, jobs: list[tuple[Setting, dict]], shared_rows: int,
               opened=None) -> list[dict]:
    """Each (setting, record) as the frontier sweep (`make frontier`) scores its settings:
    a `recdepth.evaluate` job in jobs_dir/<k> with the report's model, seed, device and eval
    block (conf/evaluate.yaml composed with the setting's overrides, `frontier_grid.exit_line`),
    the jobs decoded ahead of them as one batch (`jobs.decode_shared`, shared_rows rows
    a batch; latency timed at batch 1, round-robin), metrics.json also holding the setting's
    family, its overrides and `record`; then the sweep summary (`sweep.summarize`). Returns
    each job's row: job, family, overrides, metrics.json's eval block and record, and its
    per-token record read back from eval_tokens.csv (the oracle's with its NLL at every n).
    `opened`: the model these jobs score, already opened (`checkpoints.open_model`)."""
    keep = {k: getattr(run, k) for k in ("ckpt", "hf", "data", "dtype", "seed", "device", "eval")}
    cfgs = []
    for k, (s, _) in enumerate(jobs):
        job = OmegaConf.merge(compose_job("evaluate", [*exit_line(s), f"run_dir={jobs_dir / str(k)}"]), keep)
        job.eval.warm_start = job.eval.warm_start or s.warm_start  # the setting's, over the report's
        cfgs.append(job)
    precomputed = decode_shared(cfgs, shared_rows, opened) if shared_rows else None
    rows = []
    for k, (job, (s, record)) in enumerate(zip(cfgs, jobs, strict=True)):
        line = " ".join(exit_line(s))
        ev = evaluate(job, {"family": s.family, "overrides": line, **record}, opened, precomputed)["eval"]
        d = jobs_dir / str(k)
        rec = read_tokens(d / "eval_tokens.csv")
        if (d / "oracle_nll.npy").is_file():
            rec["nll_by_n"] = np.load(d / "oracle_nll.npy")
        rows.append({"job": k, "family": s.family, "overrides": line, "eval": ev, "rec": rec, **record})
    sweep.summarize(jobs_dir)
    return rows


# ---------------------------------------------------------------- the table
def select(rows: list[dict], target: search.Target) -> list[int]:
    """The calibrated jobs of one target in the order the report ranks them, from their
    calibration-split numbers only (`row["calibration"]`: met, ce, layer_applications): the
    settings that met the target on calibration first, by fewest layer applications (CE
    target) or lowest CE (budget), then the others by how far they missed it. Returns job
    numbers; the first is the winner. Nothing of the test split is read: choosing on the
    split that then scores the choice would be a winner's curse."""
    cand = [j for j in rows if j["family"] == "calibrated" and j["calibration"]["target"]["kind"] == target.kind]

    def key(j):
        c = j["calibration"]
        miss = max(c["ce_increase"] - target.value, 0.0) if target.kind == "max_ce_increase" \
            else max(c["layer_applications"] - target.value, 0.0)
        obj = (c["layer_applications"], c["ce"]) if target.kind == "max_ce_increase" else (c["ce"], c["layer_applications"])
        return (not c["met"], miss, *obj)

    return [j["job"] for j in sorted(cand, key=key)]


def comparison(rows: list[dict], targets: list[search.Target], cost, resamples: int = frontier.RESAMPLES) -> dict:
    """Every calibrated job against the fixed frontier at its own layer applications
    (`stats.compare`, paired over windows), and per target the winner and runner-up chosen
    on the calibration split (`select`), then scored on the test split: the target's test
    verdict, the frontier comparison, and the paired CI of the winner's difference to the
    runner-up (layer applications under a CE target, CE under a budget)."""
    fixed = {int(j["eval"]["max_steps"]): j["rec"]["nll"] for j in rows if j["family"] == "fixed"}
    boot = stats.Bootstrap(rows[0]["rec"]["window"], resamples)
    by_job = {j["job"]: j for j in rows}
    out, winners = [], {}
    for t in targets:
        order = select(rows, t)
        for rank, job in enumerate(order):
            j = by_job[job]
            cmp = stats.compare(j["rec"]["nll"], _costs(j["rec"], cost), fixed, boot, cost)
            out.append({"target": t.kind, "bound": t.value, "rule": j["eval"]["exit"], "job": job, "rank": rank + 1,
                        "overrides": j["overrides"], "calibration_met": j["calibration"]["met"],
                        "calibration_ce_increase": j["calibration"]["ce_increase"],
                        "calibration_layer_applications": j["calibration"]["layer_applications"],
                        **{f"test_{k}": v for k, v in j["test_target"].items()},
                        "ce": cmp["ce"], "ce_lo": cmp["ce_lo"], "ce_hi": cmp["ce_hi"],
                        "layer_applications": cmp["cost"], "layer_applications_lo": cmp["cost_lo"],
                        "layer_applications_hi": cmp["cost_hi"], "ms_per_token": j["eval"]["ms_per_token"],
                        "ms_per_answer": j["eval"].get("ms_per_answer"),
                        "ms_per_answer_ci": j["eval"].get("ms_per_answer_ci"),
                        "hull_ce": cmp["hull_ce"], "d_hull": cmp["d_hull"], "d_hull_lo": cmp["d_hull_lo"],
                        "d_hull_hi": cmp["d_hull_hi"], "vs_frontier": frontier.verdict(cmp["d_hull_lo"], cmp["d_hull_hi"])})
        if not order or not by_job[order[0]]["calibration"]["met"]:
            winners[t.kind] = None
            continue
        w = next(r for r in out if r["target"] == t.kind and r["job"] == order[0])
        win = {"rule": w["rule"], "job": w["job"], "overrides": w["overrides"], "vs_frontier": w["vs_frontier"],
               "d_hull": [w["d_hull"], w["d_hull_lo"], w["d_hull_hi"]], "test_verdict": w["test_verdict"],
               "chosen_on": "calibration split"}
        if len(order) > 1 and by_job[order[1]]["calibration"]["met"]:
            wj, j2 = by_job[order[0]], by_job[order[1]]
            a = (_costs(wj["rec"], cost), _costs(j2["rec"], cost)) \
                if t.kind == "max_ce_increase" else (wj["rec"]["nll"], j2["rec"]["nll"])
            d, lo, hi = stats.diff_ci(*a, boot)
            win.update(runner_up=j2["eval"]["exit"], vs_runner_up=[d, lo, hi], separated=bool(hi < 0),
                       quantity="layer applications" if t.kind == "max_ce_increase" else "CE")
        winners[t.kind] = win
    return {"rows": out, "winners": winners}


def _costs(rec: dict, cost: stats.Cost) -> np.ndarray:
    """A job's cost per token: its record's `cost` (the rule's checks included), or for a
    record without one the loop's layer applications."""
    return rec["cost"] if "cost" in rec else cost.per_token(rec["apps"])


def _answer_ms(r: dict) -> str:
    """ " (ms per answer [95% CI])" of a task's job, "" elsewhere."""
    if r.get("ms_per_answer") is None:
        return ""
    lo, hi = r["ms_per_answer_ci"]
    return f" ({_f(r['ms_per_answer'], 2)} [{_f(lo, 2)}, {_f(hi, 2)}])"


def _f(v, digits=4, sign=False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def markdown(table: dict, targets: list[search.Target], run: ReportConfig, seconds: float) -> str:
    lines = [f"# Exit rules compared on {run.ckpt or run.hf}", "",
             f"Test split: {run.eval.tokens} tokens (val offsets 0–{run.eval.tokens}); calibration split: "
             f"{run.calibration.tokens or EMPIRICAL_TOKENS} tokens after it, with its own noise keys. Rules are ranked and the winner "
             "chosen on the calibration split (rank); the test split only scores the choices. Intervals: 95% "
             f"paired bootstrap over whole test windows ({frontier.RESAMPLES} resamples), per comparison. Cost: layer "
             "applications per token plus each rule's checks in layer equivalents (docs/spec.md §4b). Latency: batch 1, every setting timed round-robin "
             f"({run.eval.repeats} round(s)). Report run time: {seconds / 60:.1f} min.", ""]
    for t in targets:
        name = TARGET_NAMES[t.kind]
        q = "ce_increase" if t.kind == "max_ce_increase" else "layer_applications"
        dig, sign = (4, True) if q == "ce_increase" else (2, False)
        lines += [f"## Calibrated to {name} ≤ {t.value:g}", "",
                  "| rank (on calibration) | rule | calibrated setting | on calibration: CE increase, layer applications | "
                  f"on test: {name} [95% CI] | target on test | CE [95% CI] | layer applications + checks | "
                  "ms/token (ms/answer) | "
                  "CE − fixed frontier at its layer applications [95% CI] | vs fixed frontier |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (x for x in table["rows"] if x["target"] == t.kind):
            test_q = f"{_f(r[f'test_{q}'], dig, sign)} [{_f(r[f'test_{q}_ci'][0], dig, sign)}, " \
                     f"{_f(r[f'test_{q}_ci'][1], dig, sign)}]"
            setting = " ".join(x for x in r["overrides"].split() if not x.startswith(("exit.gate=", "exit.calibrated_on=")))
            met = "" if r["calibration_met"] else " (not met)"
            lines.append(f"| {r['rank']} | {r['rule']} | `{setting}` | {_f(r['calibration_ce_increase'], 4, True)}, "
                         f"{_f(r['calibration_layer_applications'], 2)}{met} | {test_q} | {r['test_verdict']} | "
                         f"{_f(r['ce'])} [{_f(r['ce_lo'])}, {_f(r['ce_hi'])}] | {_f(r['layer_applications'], 2)} | "
                         f"{_f(r['ms_per_token'], 2)}{_answer_ms(r)} | {_f(r['d_hull'], 4, True)} [{_f(r['d_hull_lo'], 4, True)}, "
                         f"{_f(r['d_hull_hi'], 4, True)}] | {r['vs_frontier']} |")
        w = table["winners"].get(t.kind)
        lines.append("")
        if w is None:
            lines.append("Winner: none — no calibrated rule met the target on the calibration split.")
        else:
            s = f"Winner (chosen on the calibration split): **{w['rule']}**; target on test: {w['test_verdict']}"
            if "runner_up" in w:
                d, lo, hi = w["vs_runner_up"]
                s += (f"; on test, {w['quantity']} minus the runner-up's ({w['runner_up']}) {d:+.4f} "
                      f"[{lo:+.4f}, {hi:+.4f}]" + ("" if w["separated"] else " — not resolved against the runner-up"))
            d, lo, hi = w["d_hull"]
            s += (f"; against the fixed frontier at its layer applications {d:+.4f} [{lo:+.4f}, {hi:+.4f}]: "
                  f"{w['vs_frontier']}.")
            lines.append(s)
        lines.append("")
    lines += ["Every scored setting, with the frontier comparison of each: `jobs/frontier.md`; "
              "the figure: `report.png`.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the figure
def figure(rows: list[dict], n_max: int, cost: stats.Cost):
    """CE − CE(fixed at n_max) against layer applications (log-x) and against ms/token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next((j["eval"]["ce"] for j in rows if j["family"] == "fixed" and j["eval"]["max_steps"] == n_max), None)
    ref = ref if ref is not None else min(j["eval"]["ce"] for j in rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    rules = sorted({j["eval"]["exit"] for j in rows if j["family"] in ("grid", "calibrated")})
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colors = {rule: palette[i % len(palette)] for i, rule in enumerate(rules)}
    marks = {"max_ce_increase": "*", "layer_applications": "s"}
    for ax, key, xlabel in ((axes[0], "layer_applications", "cost: layer applications + checks per token"),
                            (axes[1], "ms_per_token", "ms / token (batch 1)")):
        fx = sorted((j["eval"][key], j["eval"]["ce"] - ref) for j in rows if j["family"] == "fixed"
                    and j["eval"][key] is not None)
        ax.plot(*zip(*fx), "k-o", ms=3, label="fixed depth", zorder=3)
        if key == "layer_applications":
            orc = [j for j in rows if j["family"] == "oracle"]
            if orc:
                by_n = orc[0]["rec"]["nll_by_n"]
                pts = sorted(stats.oracle_point(by_n, e, cost)[::-1] for e in frontier.ORACLE_EPS)
                ax.plot([a for a, _ in pts], [c - ref for _, c in pts], "k--", lw=1,
                        label="oracle: best uniform depth within ε (reads the target; not a bound)")
        for rule in rules:
            g = sorted((j["eval"][key], j["eval"]["ce"] - ref) for j in rows if j["family"] == "grid"
                       and j["eval"]["exit"] == rule and j["eval"][key] is not None)
            if g:
                ax.plot(*zip(*g), "-", marker=".", color=colors[rule], lw=1, alpha=0.7, label=f"{rule} (τ grid)")
            for j in rows:
                if j["family"] == "calibrated" and j["eval"]["exit"] == rule and j["eval"][key] is not None:
                    kind = j["calibration"]["target"]["kind"]
                    ax.plot(j["eval"][key], j["eval"]["ce"] - ref, marks[kind], color=colors[rule], ms=10,
                            mec="k", mew=0.5)
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"CE − CE(fixed {n_max}) (nats)")
        ax.grid(alpha=0.3)
    axes[0].plot([], [], "*", color="gray", ms=10, label="calibrated to a CE increase")
    axes[0].plot([], [], "s", color="gray", ms=8, label="calibrated to a layer-application budget")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Exit rules on one frontier: quality against compute and latency (test split)", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- the gate
def gate_file(run: ReportConfig, out: Path) -> str:
    """report.gate, or a gate fitted here on the checkpoint's train split with run.gate's
    settings at N = report.max_steps (as `python -m recdepth.train_gate`; out/gate/gate.pt)."""
    if run.report.gate:
        return str(Path(run.report.gate).resolve())
    g = TrainGateConfig(ckpt=run.ckpt, hf=run.hf, data=run.data, dtype=run.dtype, seed=run.seed, device=run.device,
                        run_dir=str(out / "gate"), gate=dataclasses.replace(run.gate, max_steps=run.report.max_steps))
    train_gate(OmegaConf.structured(g))
    return str((out / "gate" / "gate.pt").resolve())


_task = task(lambda c: {"ce": math.nan, **report(c)}, "ce")  # the Hydra task (recdepth/cli/runner.py)
main = hydra_main(_task, "report")


if __name__ == "__main__":
    import recdepth.report

    recdepth.report.main()
