"""The paper's loop-geometry figures (Figs. 1, 2, 3, 5) drawn from diagnostics records.

Lightning glue: the `LoopDynamics` callback draws them at the end of training and logs
Fig. 1 to W&B; `python -m recdepth.figures <run_dir>` (the entry point) redraws them from
a run directory's `diagnostics/step_*.json`. What each figure shows: see recdepth/figures.py.
"""


from __future__ import annotations

import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402

from recdepth.analysis.diagnostics import FLOOR_FACTOR, load_diagnostics  # noqa: E402
from recdepth.analysis.frontier import family  # noqa: E402
from recdepth.core.checks import is_number  # noqa: E402

log = logging.getLogger("recdepth.plots")

FORMATS = ("png", "pdf")
TRAJECTORY_CMAP = "viridis_r"  # light (early) -> dark (late)
CHECKPOINT_CMAP = "viridis"


# ------------------------------------------------------------------ helpers
def _checkpoint_colors(hist: list[dict]) -> list:
    cmap = plt.get_cmap(CHECKPOINT_CMAP)
    n = len(hist)
    return [cmap(0.9 * i / max(n - 1, 1)) for i in range(n)]


def _band(ax, x, stats: dict, color, label: str | None, band: bool = True) -> None:
    m, s = np.asarray(stats["mean"]), np.asarray(stats["std"])
    ax.plot(x, m, color=color, lw=1.5, label=label)
    if band:
        ax.fill_between(x, m - s, m + s, color=color, alpha=0.15, lw=0)


def _emptiest_corner(ax, points: np.ndarray, size: float) -> list[float]:
    """[x0, y0, w, h] in axes coordinates of the corner box covering the fewest points."""
    xy = ax.transLimits.transform(points)  # data -> axes fraction
    m = 0.02
    best = None
    for x0 in (m, 1 - m - size):
        for y0 in (m, 1 - m - size):
            inside = np.sum((xy[:, 0] > x0) & (xy[:, 0] < x0 + size) & (xy[:, 1] > y0) & (xy[:, 1] < y0 + size))
            if best is None or inside < best[0]:
                best = (inside, [x0, y0, size, size])
    return best[1]


# ------------------------------------------------------------------- Fig. 1
def fig1_pca(d: dict, inset_group: int = 0, inset_token: int | None = None):
    """Fig. 1 from one diagnostics dict: the PCA trajectory of its sequence."""
    p = d["pca"]
    xy = np.asarray(p["xy"], dtype=float)  # [S states, tokens, 2]
    S, n_tok, _ = xy.shape
    fig, ax = plt.subplots(figsize=(7.5, 6))
    norm = plt.Normalize(0, S - 1)
    cmap = plt.get_cmap(TRAJECTORY_CMAP)
    segs = np.stack([xy[:-1], xy[1:]], axis=2)  # [S-1, tokens, 2 ends, 2]
    seg_color = np.repeat(np.arange(S - 1), n_tok)
    lc = LineCollection(segs.reshape(-1, 2, 2), cmap=cmap, norm=norm, linewidths=0.8, alpha=0.85)
    lc.set_array(seg_color)
    ax.add_collection(lc)
    ax.scatter(xy.reshape(-1, 2)[:, 0], xy.reshape(-1, 2)[:, 1], c=np.repeat(np.arange(S), n_tok),
               cmap=cmap, norm=norm, s=3, lw=0)
    ax.autoscale_view()
    starts = np.cumsum([0] + [st["states"] for st in p["stages"]])[:-1]
    cb = fig.colorbar(lc, ax=ax, pad=0.02)
    cb.set_label("iteration (depth, then loop step)")
    group_starts = [(s0, st["label"]) for s0, st in zip(starts, p["stages"]) if st["kind"] == "group"]
    cb.set_ticks([s0 for s0, _ in group_starts], labels=[lab for _, lab in group_starts])
    # Inset: one loop of one token (its group trajectory), at its own scale.
    groups = [(s0, st) for s0, st in zip(starts, p["stages"]) if st["kind"] == "group"]
    if groups:
        s0, st = groups[min(inset_group, len(groups) - 1)]
        tok = n_tok // 2 if inset_token is None else inset_token
        loop = xy[s0 : s0 + st["states"], tok]
        box = _emptiest_corner(ax, xy.reshape(-1, 2), size=0.38)
        ins = ax.inset_axes(box)
        if box[0] < 0.5:  # keep the inset's tick labels inside the main axes
            ins.yaxis.tick_right()
        if box[1] < 0.5:
            ins.xaxis.tick_top()
        ins.plot(loop[:, 0], loop[:, 1], color="0.6", lw=0.8)
        ins.scatter(loop[:, 0], loop[:, 1], c=np.arange(s0, s0 + len(loop)), cmap=cmap, norm=norm, s=10)
        ins.text(0.03, 0.97, f"zoom: {st['label']}, token {tok}\n{len(loop)} applications", fontsize=6.5,
                 transform=ins.transAxes, va="top", bbox=dict(fc="white", ec="none", alpha=0.7, pad=1))
        ins.tick_params(labelsize=6)
        pad = 0.15 * max(np.ptp(loop[:, 0]), np.ptp(loop[:, 1]), 1e-9)
        ins.set_xlim(loop[:, 0].min() - pad, loop[:, 0].max() + pad)
        ins.set_ylim(loop[:, 1].min() - pad, loop[:, 1].max() + pad)
        ax.indicate_inset_zoom(ins, edgecolor="0.3")
    ev = p["explained_variance"]
    ax.set_xlabel(f"PC 1 ({ev[0]:.0%} of variance)")
    ax.set_ylabel(f"PC 2 ({ev[1]:.0%} of variance)")
    title = (f"Fig. 1: PCA trajectories, step {d['global_step']} "
             f"(sequence {p['sequence']}, {n_tok} tokens, {d['loops']} loops per group)")
    if p.get("text"):
        snippet = " ".join(p["text"].split())
        title += "\n" + repr(snippet[:70] + ("…" if len(snippet) > 70 else ""))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------- Fig. 2
def fig2_dlr(hist: list[dict]):
    """Fig. 2: DLR at every group boundary across checkpoints."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    steps = [h["global_step"] for h in hist]
    n_b = len(hist[-1]["dlr"])
    if n_b == 0:
        ax.text(0.5, 0.5, "one recurrence group: no boundary, no DLR", ha="center", va="center",
                transform=ax.transAxes)
    colors = plt.get_cmap("tab10")
    hi = 1.0
    for b in range(n_b):
        name = hist[-1]["dlr"][b]["name"]
        m = np.array([h["dlr"][b]["mean"] for h in hist])
        s = np.array([h["dlr"][b]["std"] for h in hist])
        ax.plot(steps, m, "o-", color=colors(b), label=f"{name} (mean)")
        ax.fill_between(steps, np.maximum(m - s, 0), m + s, color=colors(b), alpha=0.15, lw=0)
        ax.plot(steps, [h["dlr"][b]["median"] for h in hist], "x:", color=colors(b), label=f"{name} (median)")
        hi = max(hi, float(np.max(m + s)))
    ax.axhline(1.0, color="0.4", ls="--", lw=1, label="DLR = 1")
    ax.set_ylim(0, hi * 1.05)
    ax.set_xlabel("training step (checkpoint)")
    ax.set_ylabel("DLR = ‖x$_{g+1}^{(0)}$ − x$_g^{(K)}$‖ / mean$_k$ ‖Δ$_g^{(k)}$‖")
    ax.set_title(f"Fig. 2: cross-block drift (DLR), {hist[-1]['loops']} loops per group, "
                 f"{hist[-1]['batch']['tokens']} tokens", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------- Fig. 3 / 5
def _per_group_curves(hist: list[dict], quantities: list[tuple[str, int, str]], k_max: int | None,
                      band: bool, title: str):
    G = len(hist[-1]["groups"])
    rows = len(quantities)
    fig, axes = plt.subplots(rows, G, figsize=(3.6 * G, 3.0 * rows), squeeze=False, sharex=True)
    colors = _checkpoint_colors(hist)
    for r, (q, k0, ylabel) in enumerate(quantities):
        for g in range(G):
            ax = axes[r][g]
            for h, c in zip(hist, colors):
                stats = h["groups"][g][q]
                n = len(stats["mean"]) if k_max is None else max(0, min(len(stats["mean"]), k_max - k0))
                cut = {"mean": stats["mean"][:n], "std": stats["std"][:n]}
                _band(ax, np.arange(k0, k0 + n), cut, c, f"step {h['global_step']}", band)
                kf = h["groups"][g].get("first_k_near_floor")
                if kf is not None and k0 <= kf < k0 + n:
                    ax.axvline(kf, color=c, ls=":", lw=1)
            letter = "ab"[r] if rows > 1 else ""
            roman = ["i", "ii", "iii", "iv", "v", "vi", "vii", "viii"][g] if g < 8 else str(g + 1)
            ax.set_title(f"({letter}-{roman}) group {hist[-1]['groups'][g]['name']}" if letter
                         else f"({roman}) group {hist[-1]['groups'][g]['name']}", fontsize=9)
            if g == 0:
                ax.set_ylabel(ylabel)
            if r == rows - 1:
                ax.set_xlabel("loop step k")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, title="checkpoint", title_fontsize=7)
    if any(h["groups"][g].get("first_k_near_floor") is not None for h in hist for g in range(G)):
        title += (f"\ndotted: the mean step falls under {FLOOR_FACTOR}x the rounding floor (eps·‖x‖); "
                  "beyond it steps are rounding noise and their cosine tends to −1/2")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def fig3_loop_dynamics(hist: list[dict], steps: int = 16):
    """Fig. 3: (a) step norms, (b) step cosines, per group, mean ± 1σ, one curve per checkpoint."""
    return _per_group_curves(
        hist, [("step_norm", 0, "‖Δ$^{(k)}$‖₂"), ("step_cosine", 1, "cos∠(Δ$^{(k)}$, Δ$^{(k-1)}$)")],
        k_max=steps, band=True,
        title=f"Fig. 3: loop dynamics (first {min(steps, hist[-1]['steps'])} of {hist[-1]['steps']} steps; "
              "mean over tokens, 1σ band)")


def fig5_cosines(hist: list[dict]):
    """Fig. 5: consecutive-step cosines over all the fixed loops, across checkpoints."""
    return _per_group_curves(
        hist, [("step_cosine", 1, "cos∠(Δ$^{(k)}$, Δ$^{(k-1)}$)")], k_max=None, band=False,
        title=f"Fig. 5: fixed {hist[-1]['loops']}-loop cos∠(Δ$^{{(k)}}$, Δ$^{{(k-1)}}$) across checkpoints "
              "(mean over tokens)")


# ------------------------------------------------------------------ driver
def draw_all(run_dir: str | Path, out_dir: str | Path | None = None, fig3_steps: int = 16,
             formats: tuple[str, ...] = FORMATS) -> list[Path]:
    """Draw Figs. 1, 2, 3 and 5 of a run from its diagnostics JSON; return the files written."""
    hist = load_diagnostics(run_dir)
    out = Path(run_dir) / "figures" if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figs = {"fig2_dlr": fig2_dlr(hist), "fig3_loop_dynamics": fig3_loop_dynamics(hist, fig3_steps),
            "fig5_cosines": fig5_cosines(hist)}
    if hist[-1].get("pca") is not None:
        figs = {"fig1_pca": fig1_pca(hist[-1]), **figs}
    written = []
    for name, fig in figs.items():
        for fmt in formats:
            path = out / f"{name}.{fmt}"
            fig.savefig(path, dpi=150 if fmt == "png" else None)
            written.append(path)
        plt.close(fig)
    return written


# ------------------------------------------------------------ Fig. 4 (a sweep)
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
    taus = sorted({r["tau"] for r in on_tau if is_number(r["tau"])})
    for ax, (key, label) in zip(axes[0], panels):
        for rule in rules:
            pts = sorted((r["tau"], r[key]) for r in on_tau if family(r) == rule and is_number(r["tau"]) and is_number(r[key]))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[rule], label=rule)
            flat: dict[str, list] = {}  # one level across τ (fixed at one depth; argmax_stability per k)
            for r in on_tau:
                if family(r) == rule and not is_number(r["tau"]) and is_number(r[key]):
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
            rs = [r for r in rs if is_number(r[xkey]) and r["job"] in paired]
            if not rs:
                continue
            ys = [paired[r["job"]][0] for r in rs]
            # the y-range leaves out the shallow fixed depths (n < 3, both fixed families), far above the rest
            shown += [y for r, y in zip(rs, ys) if not (label.startswith("fixed") and is_number(r["max_steps"])
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
            ticks = sorted({round(r["layer_applications"]) for r in fixed if is_number(r["layer_applications"])})
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
        rs = sorted((r for r in front if r["family"] == fam and is_number(r["d_hull"]) and is_number(r["d_hull_lo"])),
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
