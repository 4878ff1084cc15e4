"""A task's sweep by difficulty (docs/spec.md §6): what `recdepth.sweep` adds when its jobs
scored a task's answers.

    difficulty.md / difficulty.csv   accuracy per difficulty at every fixed depth (the depth
                                     each difficulty needs), and every other job's accuracy,
                                     layer applications per difficulty and Spearman's
                                     correlation of applications with difficulty
    fig_difficulty.png / .pdf        accuracy against layer applications, one curve per
                                     difficulty over the fixed depths, the rules as points

Everything is read from the jobs' metrics.json `eval.answers` blocks (`tasks.score_answers`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


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
    return f"{ev['exit']} τ={ev['tau']}" + (" (warm)" if ev.get("warm_start") else "")


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
    fig = figure(out)
    for fmt in ("png", "pdf"):
        fig.savefig(Path(sweep_dir) / f"fig_difficulty.{fmt}", dpi=150 if fmt == "png" else None)
    plt.close(fig)
    return True
