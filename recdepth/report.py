"""`python -m recdepth.report ckpt=<path>`: every exit rule on one checkpoint, compared fairly on
one frontier, in one command (docs/spec.md §4b, §4c).

    python -m recdepth.report ckpt=<run>/train/checkpoints/last.ckpt          # hydra.run.dir=<out>

On the checkpoint's test split (val tokens [0, eval.tokens], as `recdepth.evaluate`) it scores
  - the fixed-depth frontier (`report.fixed`: exit=fixed at each n);
  - the oracle at ε = `report.oracle` (its NLL at every n gives the oracle curve);
  - every rule at its τ grid (`report.rules`; argmax_stability at each k of `report.patience`;
    the learned gate at each probability of `report.gate_tau`);
  - every rule of `report.calibrate` calibrated per group on the calibration split (val
    tokens after the test split, `recdepth.calibrate`) to each of two targets: CE at most
    `report.max_ce_increase` nats above fixed at max_steps, and at most
    `report.applications` mean applications per token; then scored once on the test split.
The learned gate is `report.gate` (a gate.pt of `recdepth.train_gate`), or trained here on
the train split when null.

Written into the run directory:
    jobs/<k>/           one job per scored setting, laid out like a sweep's job
                        (metrics.json, eval_tokens.csv, .hydra/overrides.yaml: the
                        overrides that rerun it with recdepth.evaluate)
    jobs/sweep_results.md, jobs/frontier.md, jobs/fig4_exits.png
                        the sweep summary of all jobs (recdepth.sweep): every job against
                        the fixed frontier at equal applications and at equal ms/token
    report.md / report.csv  the table: per target, each calibrated rule's setting, the
                        target on test with its CI, its cost and CE, its CE minus the fixed
                        frontier at its own applications with the CI, and the winner
    report.png / .pdf   CE (minus fixed at max_steps) against mean applications and against
                        ms/token: the frontier, the oracle, each rule's τ grid, the
                        calibrated settings and the gate
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from recdepth import calibration, stats, sweep
from recdepth.calibrate import (
    CalibrationSplit,
    calibrate_policy,
    exit_group,
    load_splits,
    overrides,
    test_check,
)
from recdepth.cli import guarded, run_hydra_main
from recdepth.config import conf_dir
from recdepth.decoding import evaluate_exit
from recdepth.evaluate import write_eval
from recdepth.exits import NO_TAU, build
from recdepth.gate import load_gate
from recdepth.runs import write_json
from recdepth.schema import TrainGateConfig, validated
from recdepth.train_gate import train_gate

log = logging.getLogger("recdepth.report")

TARGET_NAMES = {"max_ce_increase": "CE increase", "applications": "applications"}


class Jobs:
    """Scores settings on the test split and writes each as a sweep job directory."""

    def __init__(self, out: Path, model, tokens, cfg: DictConfig, vocab_to_gpt2):
        self.out, self.model, self.tokens, self.cfg, self.v2g = out, model, tokens, cfg, vocab_to_gpt2
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []

    def run(self, family: str, policy, line: str, extra: dict | None = None) -> dict:
        e = self.cfg.eval
        k = len(self.rows)
        d = self.out / str(k)
        t0 = time.perf_counter()
        ev, rec = evaluate_exit(self.model, self.tokens, policy, e.tokens, warmup_tokens=e.warmup_tokens,
                                seed=self.cfg.seed, cache=e.cache, batch_size=e.batch_size,
                                latency_tokens=e.latency_tokens, repeats=e.repeats, warm_start=e.warm_start)
        (d / ".hydra").mkdir(parents=True, exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(line.split())))
        write_eval(d, rec, self.v2g)
        write_json(d / "metrics.json", {"family": family, "overrides": line, **(extra or {}), "eval": ev})
        row = {"job": k, "family": family, "overrides": line, "eval": ev, "rec": rec, **(extra or {})}
        self.rows.append(row)
        ms = "—" if ev["ms_per_token"] is None else f"{ev['ms_per_token']:.2f}"
        log.info("job %d %-10s %s: CE %.4f, %.2f applications, %s ms/token (%.0f s)", k, family, line, ev["ce"],
                 ev["mean_applications"], ms, time.perf_counter() - t0)
        return row


def _start_tau(rule: str) -> float | None:
    """A valid τ to build a rule's policy before calibration replaces it (None: it has none)."""
    return None if rule in NO_TAU else 0.5 if rule == "gate" else 1e-3


def _line(p, gate: str | None = None) -> str:
    return overrides(p, gate if p.name == "gate" else None)


def report(cfg: DictConfig) -> dict:
    """Run the comparison of the module docstring; write and return report.json's dict."""
    try:
        out = Path(cfg.run_dir)
    except Exception:
        raise ValueError("run_dir: set run_dir=<directory> when calling report(cfg) outside Hydra") from None
    validated(cfg)
    r = cfg.report
    if (out / "report.md").exists() or (out / "jobs").exists():
        raise FileExistsError(f"run_dir: {out} already holds a report; choose a new run_dir")
    t_start = time.perf_counter()
    module, sp, test_tokens, cal_tokens = load_splits(cfg)
    model, c = module.model, cfg.calibration
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    jobs = Jobs(out / "jobs", model, test_tokens, cfg, module.vocab_to_gpt2)
    N, kw = r.max_steps, {"min_steps": 0, "max_steps": r.max_steps}
    gate_path = gate_file(cfg, out) if ("gate" in r.calibrate or r.gate_tau) else None
    gate = load_gate(gate_path)[:2] if gate_path else None

    def policy(name, tau=None, patience=5):
        return build(name, tau, patience=patience, groups=model.n_groups, **kw,
                     **({"gate": gate} if name == "gate" else {}))

    for n in r.fixed:
        jobs.run("fixed", build("fixed", None, max_steps=n), f"exit=fixed exit.max_steps={n}")
    jobs.run("oracle", build("oracle", r.oracle, max_steps=N), f"exit=oracle exit.tau={r.oracle:g} exit.max_steps={N}")
    for rule, taus in r.rules.items():
        for tau in taus:
            p = policy(rule, float(tau))
            jobs.run("grid", p, _line(p))
    for k in r.patience:
        p = policy("argmax_stability", patience=int(k))
        jobs.run("grid", p, _line(p))
    for tau in r.gate_tau:
        p = policy("gate", float(tau))
        jobs.run("grid", p, _line(p, gate_path))

    split = CalibrationSplit(model, cal_tokens, c.tokens, cfg.seed, cfg.eval.cache, c.batch_size,
                             cfg.eval.warm_start)
    ce_ref = float(split.decode(build("fixed", None, max_steps=N))["nll"].mean())
    fixed_ref = next(j for j in jobs.rows if j["family"] == "fixed" and j["eval"]["max_steps"] == N)["rec"]["nll"] \
        if N in r.fixed else None
    if fixed_ref is None:
        _, ref = evaluate_exit(model, test_tokens, build("fixed", None, max_steps=N), cfg.eval.tokens,
                               warmup_tokens=0, seed=cfg.seed, cache=cfg.eval.cache,
                               batch_size=cfg.eval.batch_size, latency_tokens=0, warm_start=cfg.eval.warm_start)
        fixed_ref = ref["nll"]
    targets = [calibration.Target("max_ce_increase", r.max_ce_increase),
               calibration.Target("applications", r.applications)]
    for rule in r.calibrate:
        for target in targets:
            t0 = time.perf_counter()
            p, res, _, _ = calibrate_policy(split, policy(rule, _start_tau(rule)), target,
                                            c.per_group, c.max_evals, ce_ref)
            line = _line(p, gate_path)
            cal = {"target": {"kind": target.kind, "value": target.value}, "met": res.met,
                   "ce_increase": res.best.ce - res.ce_ref, "applications": res.best.applications,
                   "decodes": len(res.history), "seconds": time.perf_counter() - t0, "exit": exit_group(p)}
            row = jobs.run("calibrated", p, line, {"calibration": cal})
            row["test_target"] = test_check(target, row["rec"], fixed_ref)

    sweep.summarize(jobs.out)
    table = comparison(jobs.rows, targets)
    (out / "report.md").write_text(markdown(table, targets, cfg, time.perf_counter() - t_start))
    fig = figure(jobs.rows, N)
    for fmt in ("png", "pdf"):
        fig.savefig(out / f"report.{fmt}", dpi=150 if fmt == "png" else None)
    import matplotlib.pyplot as plt

    plt.close(fig)
    result = {"ckpt": str(Path(cfg.ckpt).resolve()), "seconds": time.perf_counter() - t_start,
              "splits": {k: list(v) for k, v in sp.items()}, "ce_ref_calibration": ce_ref,
              "winners": table["winners"], "rows": table["rows"]}
    write_json(out / "report.json", result)
    log.info("report: %s (%.0f s)", out / "report.md", result["seconds"])
    return result


# ---------------------------------------------------------------- the table
def comparison(rows: list[dict], targets: list[calibration.Target], resamples: int = sweep.RESAMPLES) -> dict:
    """Every calibrated job against the fixed frontier at its own mean applications
    (`stats.compare`, paired over tokens), and per target the winner: among the rules
    whose target was not violated on test, the fewest applications (CE target) or the
    lowest CE (budget), with the paired CI of its difference to the runner-up."""
    fixed = {int(j["eval"]["max_steps"]): j["rec"]["nll"] for j in rows if j["family"] == "fixed"}
    n_tok = len(rows[0]["rec"]["nll"])
    idx = stats.bootstrap_indices(n_tok, resamples)
    out, winners = [], {}
    for t in targets:
        cand = []
        for j in rows:
            if j["family"] != "calibrated" or j["calibration"]["target"]["kind"] != t.kind:
                continue
            cmp = stats.compare(j["rec"]["nll"], j["rec"]["apps"], fixed, idx)
            row = {"target": t.kind, "bound": t.value, "rule": j["eval"]["exit"], "job": j["job"],
                   "overrides": j["overrides"], "calibration_met": j["calibration"]["met"],
                   "calibration_ce_increase": j["calibration"]["ce_increase"],
                   "calibration_applications": j["calibration"]["applications"],
                   **{f"test_{k}": v for k, v in j["test_target"].items()},
                   "ce": cmp["ce"], "ce_lo": cmp["ce_lo"], "ce_hi": cmp["ce_hi"],
                   "applications": cmp["mean_applications"], "applications_lo": cmp["mean_applications_lo"],
                   "applications_hi": cmp["mean_applications_hi"], "ms_per_token": j["eval"]["ms_per_token"],
                   "hull_ce": cmp["hull_ce"], "d_hull": cmp["d_hull"], "d_hull_lo": cmp["d_hull_lo"],
                   "d_hull_hi": cmp["d_hull_hi"], "vs_frontier": sweep._verdict(cmp["d_hull_lo"], cmp["d_hull_hi"])}
            out.append(row)
            if row["test_verdict"] != "violated":
                cand.append((row, j))
        key = (lambda x: x[0]["applications"]) if t.kind == "max_ce_increase" else (lambda x: x[0]["ce"])
        cand.sort(key=key)
        if not cand:
            winners[t.kind] = None
            continue
        (w, wj), rest = cand[0], cand[1:]
        win = {"rule": w["rule"], "job": w["job"], "overrides": w["overrides"], "vs_frontier": w["vs_frontier"],
               "d_hull": [w["d_hull"], w["d_hull_lo"], w["d_hull_hi"]]}
        if rest:
            (r2, j2) = rest[0]
            a = (np.asarray(wj["rec"]["apps"], float).mean(axis=1), np.asarray(j2["rec"]["apps"], float).mean(axis=1)) \
                if t.kind == "max_ce_increase" else (wj["rec"]["nll"], j2["rec"]["nll"])
            d, lo, hi = stats.diff_ci(*a, idx)
            win.update(runner_up=r2["rule"], vs_runner_up=[d, lo, hi],
                       separated=bool(hi < 0), quantity="applications" if t.kind == "max_ce_increase" else "CE")
        winners[t.kind] = win
    return {"rows": out, "winners": winners}


def _f(v, digits=4, sign=False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def markdown(table: dict, targets: list[calibration.Target], cfg: DictConfig, seconds: float) -> str:
    lines = [f"# Exit rules compared on {cfg.ckpt}", "",
             f"Test split: {cfg.eval.tokens} tokens (val offsets 0–{cfg.eval.tokens}); calibration split: "
             f"{cfg.calibration.tokens} tokens after it. Intervals: 95% paired bootstrap over test tokens "
             f"({sweep.RESAMPLES} resamples). Report run time: {seconds / 60:.1f} min.", ""]
    for t in targets:
        name = TARGET_NAMES[t.kind]
        lines += [f"## Calibrated to {name} ≤ {t.value:g}", "",
                  "| rule | calibrated setting | on calibration: CE increase, applications | on test: "
                  f"{name} [95% CI] | target on test | CE [95% CI] | applications | ms/token | "
                  "CE − fixed frontier at its applications [95% CI] | vs fixed frontier |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in (x for x in table["rows"] if x["target"] == t.kind):
            q = "ce_increase" if t.kind == "max_ce_increase" else "applications"
            test_q = f"{_f(r[f'test_{q}'], 4 if q == 'ce_increase' else 2, q == 'ce_increase')} " \
                     f"[{_f(r[f'test_{q}_ci'][0], 4 if q == 'ce_increase' else 2, q == 'ce_increase')}, " \
                     f"{_f(r[f'test_{q}_ci'][1], 4 if q == 'ce_increase' else 2, q == 'ce_increase')}]"
            setting = " ".join(x for x in r["overrides"].split() if not x.startswith(("exit.gate=",)))
            met = "" if r["calibration_met"] else " (not met)"
            lines.append(f"| {r['rule']} | `{setting}` | {_f(r['calibration_ce_increase'], 4, True)}, "
                         f"{_f(r['calibration_applications'], 2)}{met} | {test_q} | {r['test_verdict']} | "
                         f"{_f(r['ce'])} [{_f(r['ce_lo'])}, {_f(r['ce_hi'])}] | {_f(r['applications'], 2)} | "
                         f"{_f(r['ms_per_token'], 2)} | {_f(r['d_hull'], 4, True)} [{_f(r['d_hull_lo'], 4, True)}, "
                         f"{_f(r['d_hull_hi'], 4, True)}] | {r['vs_frontier']} |")
        w = table["winners"].get(t.kind)
        lines.append("")
        if w is None:
            lines.append("Winner: none — every calibrated rule violated the target on test.")
        else:
            s = f"Winner: **{w['rule']}**"
            if "runner_up" in w:
                d, lo, hi = w["vs_runner_up"]
                s += (f"; {w['quantity']} minus the runner-up's ({w['runner_up']}) {d:+.4f} [{lo:+.4f}, {hi:+.4f}]"
                      + ("" if w["separated"] else " — not resolved against the runner-up"))
            d, lo, hi = w["d_hull"]
            s += (f"; against the fixed frontier at its applications {d:+.4f} [{lo:+.4f}, {hi:+.4f}]: "
                  f"{w['vs_frontier']}.")
            lines.append(s)
        lines.append("")
    lines += ["Every scored setting, with the frontier comparison of each: `jobs/frontier.md`; "
              "the figure: `report.png`.", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- the figure
def figure(rows: list[dict], n_max: int):
    """CE − CE(fixed at n_max) against mean applications (log-x) and against ms/token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = next((j["eval"]["ce"] for j in rows if j["family"] == "fixed" and j["eval"]["max_steps"] == n_max), None)
    ref = ref if ref is not None else min(j["eval"]["ce"] for j in rows)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    rules = sorted({j["eval"]["exit"] for j in rows if j["family"] in ("grid", "calibrated")})
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colors = {rule: palette[i % len(palette)] for i, rule in enumerate(rules)}
    marks = {"max_ce_increase": "*", "applications": "s"}
    for ax, key, xlabel in ((axes[0], "mean_applications", "mean applications per token"),
                            (axes[1], "ms_per_token", "ms / token (batch 1)")):
        fx = sorted((j["eval"][key], j["eval"]["ce"] - ref) for j in rows if j["family"] == "fixed"
                    and j["eval"][key] is not None)
        ax.plot(*zip(*fx), "k-o", ms=3, label="fixed depth", zorder=3)
        if key == "mean_applications":
            orc = [j for j in rows if j["family"] == "oracle"]
            if orc:
                by_n = orc[0]["rec"]["nll_by_n"]
                pts = sorted(stats.oracle_point(by_n, e)[::-1] for e in sweep.ORACLE_EPS)
                ax.plot([a for a, _ in pts], [c - ref for _, c in pts], "k--", lw=1, label="oracle (reads the target)")
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
    axes[0].plot([], [], "s", color="gray", ms=8, label="calibrated to an application budget")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("Exit rules on one frontier: quality against compute and latency (test split)", fontsize=10)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- the gate
def gate_file(cfg: DictConfig, out: Path) -> str:
    """report.gate, or a gate fitted here on the checkpoint's train split with cfg.gate's
    settings at N = report.max_steps (as `python -m recdepth.train_gate`; out/gate/gate.pt)."""
    if cfg.report.gate:
        return str(Path(cfg.report.gate).resolve())
    g = OmegaConf.merge(OmegaConf.structured(TrainGateConfig), {
        "ckpt": cfg.ckpt, "seed": cfg.seed, "device": cfg.device, "run_dir": str(out / "gate"),
        "gate": {**OmegaConf.to_container(cfg.gate), "max_steps": cfg.report.max_steps}})
    train_gate(g)
    return str((out / "gate" / "gate.pt").resolve())


@hydra.main(config_path=conf_dir(), config_name="report", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float:
    return guarded(lambda c: {"ce": math.nan, **report(c)}, cfg, "ce")


def main() -> None:
    run_hydra_main(_hydra_main)


if __name__ == "__main__":
    import recdepth.report

    recdepth.report.main()
