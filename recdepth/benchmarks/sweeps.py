"""`recdepth bench ltt|intervals|settings|oracle`: the benches of calibration and sweeps —
Learn then Test's coverage on real decodes, a sweep's verdicts under older statistics, a
frontier grid decoded setting by setting and as one batch, the oracle with its first group
looped once per window or in every row. See recdepth/bench.py for the options."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from recdepth.core.runtime import tune_cpu_allocator


@torch.no_grad()
def bench_ltt(args) -> dict:
    """Does Learn-then-Test calibration (docs/spec.md §4e, recdepth/exits/calibration/ltt.py) keep its promise
    on real decodes? One rule's path of settings (most conservative first) is decoded once
    over `--windows` held-out windows of the checkpoint's val split (windows decode
    independently and batched rows are exact, so a window's record does not depend on which
    other windows it is decoded with), with `fixed` at --max-steps as the paired reference.
    Then, for `--partitions` random half/half splits of the windows into calibration and
    test, and for each loss bound b and target δ (α = δ / b):
    - LTT (Hoeffding–Bentkus p-values, fixed-sequence testing at ε) on the calibration half;
      violation: the chosen setting's test-half risk (mean clipped window loss) > α;
    - the empirical method (the cheapest setting on the same path whose calibration-half CE
      increase over full depth is <= δ, as the §4c search would answer on this path), with the
      same violation criterion; and for both the CE-increase criterion (test-half CE increase > δ).
    Violation rates get 95% Clopper–Pearson intervals over partitions (the partitions share
    one pool of windows: the interval is over the partition draw given this pool). Cost: the
    mean cost per token (layer applications with the rule's checks, `scoring.model_cost`) of the chosen setting on the
    test half. The path is decoded until its pooled CE increase exceeds 2 max(δ) and its
    pooled risk exceeds 2 max(α) (or the grid ends); a partition whose LTT walk or empirical
    choice reaches the last decoded setting is counted and reported (`truncated`). With
    `--ltt-shared-rows`, the path's settings are decoded --ltt-shared-rows // --windows at a
    time as one batch (`scoring.evaluate_exits`; a few past the stop are decoded unread)."""
    import json

    import numpy as np

    from recdepth.app.checkpoints import heldout_tokens, load_checkpoint
    from recdepth.decode.scoring import evaluate_exit, evaluate_exits
    from recdepth.decode.settings import DecodeSettings
    from recdepth.exits.calibration import ltt
    from recdepth.exits.policy import build

    tune_cpu_allocator()
    t_start = time.perf_counter()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    model = module.model
    T, G, W = model.cfg.block_size, model.n_groups, args.windows
    tokens = heldout_tokens(module, data, W * T + 1, seed=0)
    rule, N = args.ltt_rule, args.max_steps
    grid = list(args.ltt_grid) if args.ltt_grid else (
        list(range(N, 0, -1)) if rule == "fixed" else _bench_tau_grid())
    if rule == "fixed":
        grid = [int(v) for v in grid]
    path = ltt.staircase(len(grid), G) if args.ltt_path == "staircase" else [(i,) * G for i in range(len(grid))]

    def policy(setting):
        vals = [grid[i] for i in setting]
        v = vals[0] if len(set(vals)) == 1 else vals
        return build("fixed", None, max_steps=v) if rule == "fixed" else build(rule, v, max_steps=N)

    settings = DecodeSettings(warmup_tokens=0, seed=args.seed, latency_tokens=0)

    def decode(p):
        t = time.perf_counter()
        _, rec = evaluate_exit(model, tokens, p, W * T, settings.replace(batch_size=args.ltt_batch))
        _, _, cnt = ltt.window_means(rec["nll"], rec["window"])
        return rec, cnt, time.perf_counter() - t

    print(f"# recdepth bench ltt: {args.ckpt}; {W} windows x {T} tokens of the val split, rule {rule} on the "
          f"{args.ltt_path} path over {grid[0]:g} .. {grid[-1]:g} ({len(path)} settings), reference fixed-{N}, "
          f"{args.partitions} half/half partitions, epsilon {args.epsilon:g}, threads={torch.get_num_threads()}",
          flush=True)
    ref, cnt, secs = decode(build("fixed", None, max_steps=N))
    ntok = cnt
    print(f"reference fixed-{N}: CE {ref['nll'].mean():.4f}, {ref['cost'].mean():.1f} layer "
          f"applications per token, decoded in {secs:.0f} s", flush=True)
    bounds, deltas = list(args.loss_bounds), list(args.deltas)
    inc_sum, apps_sum, losses, rows = [], [], {b: [] for b in bounds}, []

    def add(rec, label, secs):
        _, inc, _ = ltt.window_means(rec["nll"] - ref["nll"], rec["window"])
        _, lapps, _ = ltt.window_means(rec["cost"], rec["window"])  # the rule's checks included
        inc_sum.append(inc * ntok)
        apps_sum.append(lapps * ntok)
        for b in bounds:
            losses[b].append(np.clip(inc, 0, b) / b)
        row = {"setting": label, "ce_increase": float(inc_sum[-1].sum() / ntok.sum()),
               "layer_applications": float(apps_sum[-1].sum() / ntok.sum()),
               "risk": {str(b): float(losses[b][-1].mean()) for b in bounds},
               "clipped_at_bound": {str(b): float((inc > b).mean()) for b in bounds}, "seconds": secs}
        rows.append(row)
        print(f"  {label:>24s}  CE increase {row['ce_increase']:+.5f}  layer applications "
              f"{row['layer_applications']:6.2f}  risk " + " ".join(f"b={b:g}: {row['risk'][str(b)]:.4f}" for b in bounds)
              + f"  ({secs:.0f} s)", flush=True)
        return row

    add(ref, f"fixed-{N} (full depth)", secs)  # index 0: full depth, the fallback of both methods
    stop_inc, stop_risk = 2 * max(deltas), {b: 2 * max(deltas) / b for b in bounds}
    chunk = max(1, args.ltt_shared_rows // W)  # settings decoded side by side (0: one by one)

    def decoded_path():
        for i in range(0, len(path), chunk):
            part = path[i : i + chunk]
            if len(part) == 1:
                yield part[0], *decode(policy(part[0]))[::2]
                continue
            t = time.perf_counter()
            out = evaluate_exits(model, tokens, [policy(s) for s in part], W * T,
                                 settings.replace(batch_size=args.ltt_shared_rows))
            secs = (time.perf_counter() - t) / len(part)
            for s, (_, rec) in zip(part, out, strict=True):
                yield s, rec, secs

    for s, rec, secs in decoded_path():
        row = add(rec, " ".join(f"{grid[i]:g}" for i in sorted(set(s))) if len(set(s)) == 1
                  else "[" + ",".join(f"{grid[i]:g}" for i in s) + "]", secs)
        if row["ce_increase"] > stop_inc and all(row["risk"][str(b)] > stop_risk[b] for b in bounds):
            break
    decoded = len(rows) - 1  # settings of the path decoded (row 0 is the reference)
    inc_sum, apps_sum = np.stack(inc_sum), np.stack(apps_sum)
    L = {b: np.stack(v) for b, v in losses.items()}

    rng = np.random.default_rng(args.seed)
    P, half = args.partitions, W // 2
    parts = [rng.permutation(W) for _ in range(P)]
    results = []
    for b in bounds:
        for d in deltas:
            a = ltt.alpha(d, b)
            rec = {m: {"viol": 0, "viol_ce": 0, "apps": [], "ce_inc": [], "risk": [], "none": 0, "truncated": 0}
                   for m in ("ltt", "empirical")}
            for perm in parts:
                cal, test = perm[:half], perm[half:]
                tok_c, tok_t = ntok[cal].sum(), ntok[test].sum()
                # LTT over the path (rows 1..), full depth (row 0) if nothing is certified
                ps = [ltt.hoeffding_bentkus_p(float(L[b][j, cal].mean()), half, a) for j in range(1, decoded + 1)]
                k = ltt.fixed_sequence(ps, args.epsilon)
                chosen = {"ltt": k}  # row index: k-th path setting, or 0 = full depth
                # empirical: cheapest (calibration layer applications) with calibration CE increase <= δ
                inc_c = inc_sum[:, cal].sum(axis=1) / tok_c
                apps_c = apps_sum[:, cal].sum(axis=1) / tok_c
                ok = np.flatnonzero(inc_c <= d)
                chosen["empirical"] = int(ok[np.argmin(apps_c[ok])])
                for m, j in chosen.items():
                    r = rec[m]
                    risk_t = float(L[b][j, test].mean())
                    ce_t = float(inc_sum[j, test].sum() / tok_t)
                    r["viol"] += risk_t > a
                    r["viol_ce"] += ce_t > d
                    r["risk"].append(risk_t)
                    r["ce_inc"].append(ce_t)
                    r["apps"].append(float(apps_sum[j, test].sum() / tok_t))
                    r["none"] += j == 0
                    r["truncated"] += (j == decoded) and decoded < len(path)
            pool_ok = [j for j in range(decoded + 1) if L[b][j].mean() <= a]
            best_pool = min(pool_ok, key=lambda j: apps_sum[j].sum())
            for m in ("ltt", "empirical"):
                r = rec[m]
                lo, hi = ltt.clopper_pearson(r["viol"], P)
                lo2, hi2 = ltt.clopper_pearson(r["viol_ce"], P)
                results.append({
                    "loss_bound": b, "delta": d, "alpha": a, "method": m, "partitions": P,
                    "violation_rate": r["viol"] / P, "violation_ci": [lo, hi],
                    "ce_violation_rate": r["viol_ce"] / P, "ce_violation_ci": [lo2, hi2],
                    "full_depth_rate": r["none"] / P, "truncated": r["truncated"],
                    "layer_applications": float(np.mean(r["apps"])), "test_risk": float(np.mean(r["risk"])),
                    "test_ce_increase": float(np.mean(r["ce_inc"])),
                    "pool_best_layer_applications": float(apps_sum[best_pool].sum() / ntok.sum()),
                    "min_alpha": ltt.min_alpha(half, args.epsilon)})
    print(f"\n{W} windows ({half} calibration / {W - half} test per partition), {P} partitions, epsilon "
          f"{args.epsilon:g}; violation = test-half risk > alpha (the guarantee's event) or test-half CE "
          f"increase > delta; 95% Clopper-Pearson intervals over partitions; layer applications per token on the "
          f"test half (full depth {rows[0]['layer_applications']:.1f}); min alpha certifiable with {half} windows: "
          f"{ltt.min_alpha(half, args.epsilon):.4f}\n")
    head = ("| loss bound b | δ | α = δ/b | method | violation: risk > α [95% CI] | violation: CE incr. > δ [95% CI] "
            "| full depth | layer applications / token | test CE increase | cheapest on the pool with risk ≤ α |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        print(f"| {r['loss_bound']:g} | {r['delta']:g} | {r['alpha']:.3g} | "
              f"{'LTT' if r['method'] == 'ltt' else 'empirical (no guarantee)'} | "
              f"{r['violation_rate']:.3f} [{r['violation_ci'][0]:.3f}, {r['violation_ci'][1]:.3f}] | "
              f"{r['ce_violation_rate']:.3f} [{r['ce_violation_ci'][0]:.3f}, {r['ce_violation_ci'][1]:.3f}] | "
              f"{r['full_depth_rate']:.0%} | {r['layer_applications']:.2f} | {r['test_ce_increase']:+.5f} | "
              f"{r['pool_best_layer_applications']:.2f} |")
    if any(r["truncated"] for r in results):
        print("WARNING: some partitions chose the last decoded setting; decode more of the path (the stop rule)")
    out = {"ckpt": str(args.ckpt), "rule": rule, "path": args.ltt_path, "grid": grid, "max_steps": N, "windows": W,
           "block_size": T, "partitions": P, "epsilon": args.epsilon, "seed": args.seed, "decoded": decoded,
           "path_length": len(path), "settings": rows, "results": results,
           "window_tokens": ntok.tolist(), "window_ce_increase_sum": inc_sum.tolist(),
           "window_layer_applications_sum": apps_sum.tolist(),
           "seconds": time.perf_counter() - t_start}
    print(f"\ntotal {out['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
    return out


def _bench_tau_grid() -> list[float]:
    """bench ltt's default τ path: calibration.TAU_GRID from 1e-3 to 1, two values per decade
    below 1e-2 (1e-3, 3.16e-3: the conservative end, where kl's CE barely moves on the
    default model) and all four from 1e-2 to 1."""
    from recdepth.exits.calibration.search import TAU_GRID

    return [t for i, t in enumerate(TAU_GRID) if 1e-3 <= t <= 1.0 and (t >= 1e-2 or i % 2 == 0)]


def bench_intervals(args) -> dict:
    """A finished frontier sweep (`--sweep <dir>`, e.g. `make frontier`'s) under the older
    statistics (tokens resampled as if independent; cost = applications averaged over
    groups) and the current ones (whole windows resampled; cost = layer applications,
    docs/spec.md §4b), verdict by verdict, with the width of each fixed job's absolute CE
    interval and of its paired difference to the deepest fixed job both ways. Reads the
    jobs' eval_tokens.csv; decodes nothing."""
    import numpy as np

    from recdepth.analysis import frontier, stats

    d = Path(args.sweep)
    rows = frontier.collect(d)
    inputs = frontier.frontier_inputs(d, rows)
    if inputs is None:
        raise SystemExit(f"--sweep: {d} has fewer than two fixed-depth jobs (not a frontier sweep)")
    tokens, fixed, _ = inputs
    n = len(next(iter(fixed.values()))["nll"])
    by_tok, by_win = stats.Bootstrap(np.arange(n), args.resamples), frontier.bootstrap(inputs, args.resamples)
    # before: no timing spread either (the latency verdict took each ms/token as exact)
    old = frontier.frontier_rows(inputs, [{**r, "ms_repeats": ""} for r in rows], by_tok, None)
    new = frontier.frontier_rows(inputs, rows, by_win, frontier.sweep_cost(rows))
    ref = fixed[max(fixed)]["nll"]
    widths = []
    for k in sorted(fixed):
        x = fixed[k]["nll"]
        w = [stats.mean_ci(x, b) for b in (by_tok, by_win)]
        p = [stats.diff_ci(x, ref, b) for b in (by_tok, by_win)]
        widths.append({"n": k, "ce": float(np.mean(x)), "ce_width_tokens": w[0][2] - w[0][1],
                       "ce_width_windows": w[1][2] - w[1][1], "paired_width_tokens": p[0][2] - p[0][1],
                       "paired_width_windows": p[1][2] - p[1][1]})
    print(f"{n} tokens in {by_win.n_units} windows, {args.resamples} resamples; cost: "
          f"{frontier.sweep_cost(rows) or 'mean applications (the jobs do not say their group sizes)'}")
    print("fixed n | CE | CE 95% width: tokens / windows (ratio) | CE - CE(fixed max) width: tokens / windows")
    for w in widths:
        print(f"{w['n']:7d} | {w['ce']:.4f} | {w['ce_width_tokens']:.4f} / {w['ce_width_windows']:.4f} "
              f"({w['ce_width_windows'] / w['ce_width_tokens']:.2f}x) | {w['paired_width_tokens']:.4f} / "
              f"{w['paired_width_windows']:.4f}")
    fmt = lambda r, k="d_hull": ("—" if r[k] in ("", None) else  # noqa: E731
                                 f"{r[k]:+.4f} [{r[k + '_lo']:+.4f}, {r[k + '_hi']:+.4f}]")
    print("job | family | tau | mean apps | layer apps | before: CE - frontier at A (tokens, mean apps) -> verdict "
          "| after: CE - frontier at cost (windows, layer apps) -> verdict | after, Holm "
          "| CE - frontier at its ms/token: before (tokens, ms exact) | after (windows, spread of repeats)")
    out = []
    for a, b in zip(old, new):
        changed = "" if a["verdict"] == b["verdict"] else "  <- changed"
        print(f"{a['job']} | {a['family']} | {frontier.tau_label(a)} | {a['mean_applications']:.2f} | "
              f"{b['layer_applications']:.2f} | {fmt(a)} {a['verdict']} | {fmt(b)} {b['verdict']} | "
              f"{b.get('verdict_holm', '')} | {fmt(a, 'd_ms')} | {fmt(b, 'd_ms')}{changed}")
        keep = ("d_hull", "d_hull_lo", "d_hull_hi", "verdict", "d_ms", "d_ms_lo", "d_ms_hi")
        out.append({"job": a["job"], "family": a["family"],
                    "before": {k: a[k] for k in (*keep, "mean_applications")},
                    "after": {k: b[k] for k in (*keep, "verdict_holm", "layer_applications", "p_hull", "p_holm")}})
    return {"widths": widths, "rows": out}


def bench_settings(args) -> dict:
    """A frontier grid's quality pass, setting by setting against one mixed batch."""
    import numpy as np

    from recdepth import exits
    from recdepth.app.checkpoints import checkpoint_data, load_checkpoint
    from recdepth.decode.scoring import decode_policies, evaluate_exit
    from recdepth.decode.settings import DecodeSettings

    if args.ckpt is None:
        raise ValueError("settings: --ckpt <training checkpoint> is required")
    tune_cpu_allocator()
    module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
    dm = checkpoint_data(module, data, 0)
    n = args.tokens
    tokens, labels = torch.as_tensor(dm.heldout_tokens(n + 1, 0)), dm.heldout_labels(n + 1, 0)
    grid = [exits.build("fixed", None, max_steps=k) for k in (1, 2, 3, 4, 6, 8, 16, 32)]
    grid += [exits.build(r, t, max_steps=32) for r, ts in (("stepnorm", (0.01, 0.03, 0.1, 0.3)),
                                                            ("kl", (1e-4, 1e-3, 1e-2, 3e-2)),
                                                            ("accel", (0.01, 0.03, 0.1, 0.3))) for t in ts]
    settings = DecodeSettings(seed=0, context_steps=args.context_steps)
    t0 = time.perf_counter()
    alone = [evaluate_exit(module.model, tokens, p, n, settings.replace(batch_size=args.batch, latency_tokens=0,
                                                                         answers=False), labels=labels)[1]
             for p in grid]
    t_alone = time.perf_counter() - t0
    print(f"{args.ckpt}: {len(grid)} settings x {n} tokens (context_steps={args.context_steps}), "
          f"{torch.get_num_threads()} threads\n  setting by setting at batch {args.batch}: {t_alone:.1f} s")
    out = {"settings": len(grid), "tokens": n, "alone_s": t_alone, "mixed": []}
    for rows in args.rows:
        recs, secs = decode_policies(module.model, tokens, grid, n, settings.replace(batch_size=rows), labels=labels)
        dn = max(float(np.abs(a["nll"] - r["nll"]).max()) for a, r in zip(alone, recs, strict=True))
        mm = sum(int((a["apps"] != r["apps"]).sum()) for a, r in zip(alone, recs, strict=True))
        print(f"  mixed, {rows} rows a batch: {secs:.1f} s ({t_alone / secs:.2f}x); max |NLL difference| "
              f"{dn:.2e}, applications differing {mm} of {len(grid) * n}")
        out["mixed"].append({"rows": rows, "s": secs, "speedup": t_alone / secs, "max_dnll": dn, "apps_mismatch": mm})
    return out


@torch.no_grad()
def bench_oracle(args) -> dict:
    """The oracle (SPEC §4b, `scoring.evaluate_oracle`) with the first group looped once per
    window (`engine.loop_shared`) against every row looping it, timed in `--rounds`
    interleaved rounds on `--tokens` tokens at `--batch` windows and N = `--max-steps`, for
    `--ckpt`'s model on its test split, or for fresh models of the default shape (groups
    [[4], [5, 6], [7]]) and of one group over the same layers (Huginn's layout) on random
    tokens; the records of the two are compared (largest NLL difference, applications equal)."""
    import statistics

    import numpy as np

    from recdepth.decode.scoring import evaluate_oracle
    from recdepth.decode.settings import DecodeSettings
    from recdepth.exits.policy import build
    from recdepth.model.looped import GPTConfig, LoopedGPT

    tune_cpu_allocator()
    if args.ckpt is not None:
        from recdepth.app.checkpoints import checkpoint_data, load_checkpoint

        module, data = load_checkpoint(args.ckpt, torch.device("cpu"))
        tokens = torch.as_tensor(checkpoint_data(module, data, 0).heldout_tokens(args.tokens + 1, 0))
        models = [("checkpoint", module.model.eval())]
    else:
        tokens = torch.randint(0, 50257, (args.tokens + 1,), generator=torch.Generator().manual_seed(0))
        models = [(f"default shape, groups {g}", LoopedGPT(GPTConfig.from_size("cpu", vocab_size=50257, groups=g))
                   .eval()) for g in ([[4], [5, 6], [7]], [[4, 5, 6, 7]])]
    policy = build("oracle", 0.01, max_steps=args.max_steps)
    print(f"oracle, N = {args.max_steps}, {args.tokens} tokens, {args.batch} windows a batch, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds (median seconds)")
    out = []
    for name, model in models:
        secs = {True: [], False: []}
        recs = {}
        for _ in range(args.rounds):
            for share in (True, False):
                t0 = time.perf_counter()
                _, recs[share] = evaluate_oracle(model, tokens, policy, args.tokens,
                                                 DecodeSettings(seed=0, batch_size=args.batch, share_first=share))
                secs[share].append(time.perf_counter() - t0)
        shared, every = statistics.median(secs[True]), statistics.median(secs[False])
        dn = float(np.abs(recs[True]["nll_by_n"] - recs[False]["nll_by_n"]).max())
        same = bool((recs[True]["apps"] == recs[False]["apps"]).all())
        print(f"  {name}: every row {every:.1f} s, first group once per window {shared:.1f} s "
              f"({every / shared:.2f}x); max |NLL difference| {dn:.1e}, applications {'equal' if same else 'DIFFER'}")
        out.append({"model": name, "every_row_s": every, "shared_s": shared, "speedup": every / shared,
                    "max_dnll": dn, "apps_equal": same})
    return {"rows": out}
