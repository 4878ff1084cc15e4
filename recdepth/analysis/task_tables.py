"""A task's sweep by difficulty (docs/spec.md §6): what `recdepth.sweep` adds when its jobs
scored a task's answers.

    difficulty.md / difficulty.csv   accuracy per difficulty at every fixed depth (the depth
                                     each difficulty needs), and every other job's accuracy,
                                     layer applications per difficulty and Spearman's
                                     correlation of applications with difficulty
    best_fixed.md / best_fixed.csv   every other job against the best fixed depth (`best_fixed`):
                                     its accuracy difference and its saving in layer
                                     applications, paired, with intervals over windows
    fig_difficulty.png / .pdf        accuracy against layer applications, one curve per
                                     difficulty over the fixed depths, the rules as points

Everything is read from the jobs' metrics.json `eval.answers` blocks (`tasks.score_answers`),
and best_fixed from their eval_tokens.csv (the same answers in every job, in one order).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from recdepth.analysis import stats
from recdepth.analysis.token_files import read_tokens


def answers_of(sweep_dir: Path, rows: list[dict]) -> dict[int, dict]:
    """job -> its eval block, for the ok jobs whose block has `answers`."""
    out = {}
    for r in rows:
        f = Path(sweep_dir) / str(r["job"]) / "metrics.json"
        if r["status"] == "ok" and f.is_file():
            ev = json.loads(f.read_text()).get("eval") or {}
            if "answers" in ev:
                out[r["job"]] = ev
    return out


def _label(ev: dict) -> str:
    if ev["exit"] == "fixed":
        return f"fixed n={ev['max_steps']}" + (" (warm)" if ev.get("warm_start") else "")
    knob = f"k={ev['patience']}" if ev["exit"] == "argmax_stability" else f"τ={ev['tau']}"
    return f"{ev['exit']} {knob}" + (" (warm)" if ev.get("warm_start") else "")


def tables(evs: dict[int, dict]) -> tuple[list[dict], str]:
    """The rows of difficulty.csv and the text of difficulty.md."""
    ds = sorted({int(d) for ev in evs.values() for d in ev["answers"]["by_difficulty"]})
    rows = []
    for job, ev in sorted(evs.items()):
        a = ev["answers"]
        row = {"job": job, "exit": ev["exit"], "tau": ev["tau"], "max_steps": ev["max_steps"],
               "warm_start": bool(ev.get("warm_start")), "answers": a["tokens"],
               "accuracy": a["accuracy"][0], "accuracy_lo": a["accuracy"][1], "accuracy_hi": a["accuracy"][2],
               "layer_applications": a["layer_applications"][0],
               "spearman": a["spearman_applications_difficulty"][0],
               "spearman_lo": a["spearman_applications_difficulty"][1],
               "spearman_hi": a["spearman_applications_difficulty"][2]}
        for d in ds:
            b = a["by_difficulty"].get(str(d))
            row[f"accuracy_d{d}"] = "" if b is None else b["accuracy"][0]
            row[f"layer_applications_d{d}"] = "" if b is None else b["layer_applications"]
        rows.append(row)

    def f(v, digits=3):
        return "—" if v in ("", None) or v != v else f"{v:.{digits}f}"

    fixed = [r for r in rows if r["exit"] == "fixed" and not r["warm_start"]]
    others = [r for r in rows if r not in fixed]
    md = ["Accuracy on the answer tokens by difficulty at each fixed depth (the depth each difficulty needs); "
          "overall accuracy with its 95% interval over windows.", "",
          "| fixed n | layer applications | " + " | ".join(f"d = {d}" for d in ds) + " | all [95% CI] |",
          "|" + "---|" * (len(ds) + 3)]
    for r in sorted(fixed, key=lambda r: r["max_steps"]):
        md.append(f"| {r['max_steps']} | {f(r['layer_applications'], 1)} | "
                  + " | ".join(f(r[f'accuracy_d{d}']) for d in ds)
                  + f" | {f(r['accuracy'])} [{f(r['accuracy_lo'])}, {f(r['accuracy_hi'])}] |")
    if others:
        md += ["", "Every other job: accuracy, layer applications per answer by difficulty, and Spearman's "
               "correlation of layer applications with difficulty [95% CI over windows] (do hard answers get "
               "more depth?).", "",
               "| job | rule | accuracy [95% CI] | layer applications | " + " | ".join(f"apps d = {d}" for d in ds)
               + " | Spearman [95% CI] |", "|" + "---|" * (len(ds) + 5)]
        for r in others:
            md.append(f"| {r['job']} | {_label(evs[r['job']])} | {f(r['accuracy'])} [{f(r['accuracy_lo'])}, "
                      f"{f(r['accuracy_hi'])}] | {f(r['layer_applications'], 2)} | "
                      + " | ".join(f(r[f'layer_applications_d{d}'], 2) for d in ds)
                      + f" | {f(r['spearman'], 2)} [{f(r['spearman_lo'], 2)}, {f(r['spearman_hi'], 2)}] |")
    return rows, "\n".join(md) + "\n"


def figure(rows: list[dict]):
    """Accuracy against layer applications: a curve per difficulty over the fixed depths,
    each other job as a point per difficulty."""
    import matplotlib.pyplot as plt

    ds = sorted(int(k[len("accuracy_d"):]) for k in rows[0] if k.startswith("accuracy_d"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fixed = sorted((r for r in rows if r["exit"] == "fixed" and not r["warm_start"]), key=lambda r: r["max_steps"])
    others = [r for r in rows if r["exit"] != "fixed"]
    for i, d in enumerate(ds):
        c = f"C{i}"
        pts = [(r["layer_applications"], r[f"accuracy_d{d}"]) for r in fixed if r[f"accuracy_d{d}"] != ""]
        if pts:
            ax.plot(*zip(*pts, strict=True), "-o", color=c, ms=3, label=f"difficulty {d} (fixed n)")
        pts = [(r[f"layer_applications_d{d}"], r[f"accuracy_d{d}"]) for r in others if r[f"accuracy_d{d}"] != ""]
        if pts:
            ax.scatter(*zip(*pts, strict=True), color=c, marker="x", s=25)
    ax.set_xscale("log")
    ax.set_xlabel("layer applications per answer token")
    ax.set_ylabel("answer accuracy")
    ax.set_title("Accuracy by difficulty: fixed depths (lines), exit rules (x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def best_fixed(sweep_dir: Path, evs: dict[int, dict], resamples: int = 2000) -> tuple[list[dict], str]:
    """Every job that is not a fixed depth against the **best fixed depth**: the cold fixed job
    with the highest answer accuracy (the cheapest of those tied), the strongest fixed
    baseline of the sweep (a job that cannot be told from it at less cost is what an exit
    rule is for). Per job, over the same answers paired one to one: the accuracy difference
    (job − best) and the saving in cost per answer (layer applications with the rule's
    checks, docs/spec.md §4b), 1 − cost(job) / cost(best), each with its 95%
    percentile-bootstrap interval over windows (for a task of one instance a record,
    instances); beside them the loop alone and both jobs' time per answer. The rows of best_fixed.csv and the text of best_fixed.md; ([], "")
    when the sweep has no fixed job or no other."""
    def load(job):  # the job's cost per answer: its checks included where its record has them
        ev, t = evs[job], read_tokens(Path(sweep_dir) / str(job) / "eval_tokens.csv")
        loop = stats.Cost(ev["group_layers"], ev["outside_layers"]).loop(t["apps"])
        return t, t.get("cost", loop), loop

    fixed = [j for j, ev in evs.items() if ev["exit"] == "fixed" and not ev.get("warm_start")]
    others = [j for j, ev in evs.items() if j not in fixed]
    if not fixed or not others:
        return [], ""
    acc = {j: evs[j]["answers"]["accuracy"][0] for j in fixed}
    top = max(acc.values())
    best = min((j for j in fixed if acc[j] == top), key=lambda j: evs[j]["answers"]["layer_applications"][0])
    ref, ref_cost, _ = load(best)
    boot = stats.Bootstrap(ref["window"], resamples)
    rows = []
    for j in others:
        t, cost, loop = load(j)
        if not (np.array_equal(t["position"], ref["position"]) and np.array_equal(t["window"], ref["window"])):
            raise ValueError(f"best_fixed: job {j} scored other answers than the best fixed job {best}")
        d, lo, hi = stats.diff_ci(t["correct"], ref["correct"], boot)
        saving = 1 - cost.sum() / ref_cost.sum()
        s_lo, s_hi = np.percentile(1 - boot.ratios(cost, ref_cost), [2.5, 97.5])
        rows.append({"job": j, "rule": _label(evs[j]), "accuracy": float(np.mean(t["correct"])),
                     "accuracy_diff": d, "accuracy_diff_lo": lo, "accuracy_diff_hi": hi,
                     "layer_applications": float(cost.mean()), "loop_layer_applications": float(loop.mean()),
                     "saving": float(saving),
                     "saving_lo": float(s_lo), "saving_hi": float(s_hi), "best_fixed_job": best,
                     "best_fixed_n": evs[best]["max_steps"], "best_fixed_accuracy": top,
                     "best_fixed_layer_applications": float(ref_cost.mean()),
                     **_answer_ms(evs[j], ""), **_answer_ms(evs[best], "best_fixed_")})
    md = [f"Against the best fixed depth, n = {evs[best]['max_steps']} (job {best}: accuracy {top:.3f} at "
          f"{ref_cost.mean():.2f} layer applications per answer; the most accurate fixed depth, the cheapest of "
          "those tied). Paired over the same answers, 95% intervals over windows. Cost: layer applications plus "
          "the rule's checks in layer equivalents (docs/spec.md §4b); the loop alone beside it.", "",
          "| job | rule | accuracy | accuracy − best fixed [95% CI] | cost (with checks) | loop alone | "
          f"saving [95% CI] | ms per answer [95% CI] (best fixed: {_ms(rows[0], 'best_fixed_')}) |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['job']} | {r['rule']} | {r['accuracy']:.3f} | {r['accuracy_diff']:+.3f} "
                  f"[{r['accuracy_diff_lo']:+.3f}, {r['accuracy_diff_hi']:+.3f}] | {r['layer_applications']:.2f} | "
                  f"{r['loop_layer_applications']:.2f} | "
                  f"{r['saving']:+.1%} [{r['saving_lo']:+.1%}, {r['saving_hi']:+.1%}] | {_ms(r, '')} |")
    return rows, "\n".join(md) + "\n"


def _answer_ms(ev: dict, prefix: str) -> dict:
    """A job's time per answer (`scoring.latency_of`) as best_fixed columns."""
    ci = ev.get("ms_per_answer_ci") or ["", ""]
    return {f"{prefix}ms_per_answer": ev.get("ms_per_answer", ""), f"{prefix}ms_per_answer_lo": ci[0],
            f"{prefix}ms_per_answer_hi": ci[1]}


def _ms(r: dict, prefix: str) -> str:
    v = r[f"{prefix}ms_per_answer"]
    if v in ("", None):
        return "—"
    return f"{v:.2f} [{r[f'{prefix}ms_per_answer_lo']:.2f}, {r[f'{prefix}ms_per_answer_hi']:.2f}]"


def write(sweep_dir: Path, rows: list[dict]) -> bool:
    """difficulty.csv/.md and fig_difficulty when the sweep's jobs scored a task; False otherwise."""
    import matplotlib.pyplot as plt

    evs = answers_of(sweep_dir, rows)
    if not evs:
        return False
    out, md = tables(evs)
    with open(Path(sweep_dir) / "difficulty.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    (Path(sweep_dir) / "difficulty.md").write_text(md)
    vs, md = best_fixed(sweep_dir, evs)
    if vs:
        with open(Path(sweep_dir) / "best_fixed.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(vs[0]))
            w.writeheader()
            w.writerows(vs)
        (Path(sweep_dir) / "best_fixed.md").write_text(md)
    fig = figure(out)
    for fmt in ("png", "pdf"):
        fig.savefig(Path(sweep_dir) / f"fig_difficulty.{fmt}", dpi=150 if fmt == "png" else None)
    plt.close(fig)
    return True
