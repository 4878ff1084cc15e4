"""The lean decode step (recdepth/decode/lean_step.py, `eval.backend`): the static-shape single-token
layer equals `Block.forward` on the decoding cache, eager and compiled, for every option
of the block, and the engine really takes it where it applies."""

import pytest
import torch
import torch.nn.functional as F

from recdepth.config.groups import EvalConfig
from recdepth.decode import engine as D
from recdepth.decode import scoring as S
from recdepth.decode.lean_step import LeanSteps
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build
from recdepth.model.looped import Block, GPTConfig, LoopedGPT, gated_silu, linear

PLAIN = {}
HUGINN = dict(position="rope", qk_bias=True, mlp="gated_silu", scale_embeddings=True, latent_norm=True)


def model(kw, dtype, groups=((1,), (2, 3)), seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=16, block_size=20, vocab_size=40, groups=[list(g) for g in groups],
                    state_init="normal", **kw)
    m = LoopedGPT(cfg).to(dtype).eval()
    with torch.no_grad():  # leave the init's zeros (q/k bias, ...) so every weight matters
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def evaluate(m, step, policy, batch_size, n=57, cache="latest"):
    """The eval block and the record of `n` tokens decoded under `step`."""
    tokens = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(3))
    run = DecodeSettings(batch_size=batch_size, latency_tokens=0, warmup_tokens=0, cache=cache, seed=5, backend=step)
    return S.evaluate_exit(m, tokens, policy, n, run)


def score(m, step, policy, batch_size, n=57, cache="latest"):
    return evaluate(m, step, policy, batch_size, n, cache)[1]


@pytest.mark.parametrize("kw", [PLAIN, HUGINN], ids=["plain", "huginn"])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rule, tau", [("fixed", None), ("stepnorm", 0.3), ("kl", 1e-2)])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_lean_step_equals_block_forward(kw, dtype, tol, rule, tau, batch_size):
    """Scored records under the lean step equal the module path's: NLL within rounding,
    applications identical (batch 3 exercises the row mask and, once rows exit, the
    compacted batch: one row left attends over a copy of its entries, two over the whole
    cache, as `Block.forward` does)."""
    m = model(kw, dtype)
    policy = build(rule, tau, max_steps=9)
    ref = score(m, "module", policy, batch_size)
    ev, lean = evaluate(m, "lean", policy, batch_size)
    assert ev["backend"] == "lean" and not D.lean_steps(m, "lean").compiled  # the run decoded with the eager lean step
    assert abs(lean["nll"] - ref["nll"]).max() <= tol
    assert (lean["apps"] == ref["apps"]).all()
    assert len(set(ref["apps"].ravel().tolist())) > 1 or rule == "fixed"  # the rule really varies depth


def test_lean_step_replaces_block_forward_at_batch_one(monkeypatch):
    """At batch 1, with the latest cache and with per_step caches (each application on its
    own slot of the cache, `engine.cache_views`), no token reaches Block.forward: every
    layer and group application is the lean step; under the module step every one does."""
    m = model(PLAIN, torch.float64)
    calls = []
    real = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    score(m, "lean", build("accel", 0.05, max_steps=9), 1, n=10)
    score(m, "lean", build("accel", 0.05, max_steps=9), 1, n=10, cache="per_step")
    assert calls == []
    score(m, "module", build("accel", 0.05, max_steps=9), 1, n=10, cache="per_step")
    assert len(calls) >= 10 * m.cfg.n_layer


def test_compacted_batches_take_the_lean_step_and_give_the_module_records_bit_for_bit(monkeypatch):
    """Once rows exit, a batch runs the rows still looping only (a compacted batch): with
    the latest cache it takes the lean step too (no Block.forward call), and its records
    are the module path's exactly, in float32 as well (the same kernels on the same
    operands, so a sweep's frontier.csv does not change with the step)."""
    calls = []
    real = Block.forward
    for kw in (PLAIN, HUGINN):
        m = model(kw, torch.float32)
        policy = build("stepnorm", 0.3, max_steps=9)
        ref = score(m, "module", policy, 8)
        monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
        lean = score(m, "lean", policy, 8)
        monkeypatch.setattr(Block, "forward", real)
        assert calls == []
        assert len(set(ref["apps"].ravel().tolist())) > 1  # rows exited at different depths: compacted batches ran
        assert (lean["nll"] == ref["nll"]).all() and (lean["apps"] == ref["apps"]).all()


def test_per_step_cache_under_lean_equals_module():
    """per_step caches: the lean step on each application's slot (batch 3: masked and
    compacted rows too) gives the module path's records."""
    m = model(HUGINN, torch.float64)
    policy = build("stepnorm", 0.3, max_steps=7)
    ref, lean = (score(m, s, policy, 3, cache="per_step") for s in ("module", "lean"))
    assert abs(lean["nll"] - ref["nll"]).max() <= 1e-12 and (lean["apps"] == ref["apps"]).all()


def test_lean_steps_are_built_once_per_step_and_module_has_none(monkeypatch):
    """`engine.lean_steps`: the lean steps of a model are built once and kept (a decode
    under them reuses them, asking again returns the same object, not rebuilt), the
    compiled ones are their own; "module" has none, and a decode under it runs
    Block.forward whatever was built before (no step is left attached to the model)."""
    m = model(PLAIN, torch.float32)
    lean = D.lean_steps(m, "lean")
    assert lean is not None and not lean.compiled
    score(m, "lean", build("fixed", None, max_steps=2), 1, n=3)
    assert D.lean_steps(m, "lean") is lean  # the decode used the steps built, not new ones
    assert D.lean_steps(m, "lean") is lean  # the same steps again, not rebuilt
    compiled = D.lean_steps(m, "compiled")
    assert compiled.compiled and compiled is not lean and D.lean_steps(m, "compiled") is compiled
    assert D.lean_steps(m, "lean") is lean  # building the compiled steps leaves the eager ones
    assert D.lean_steps(m, "module") is None and DecodeSettings().backend == "module"  # the reference: Block.forward
    calls, real = [], Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    score(m, "module", build("fixed", None, max_steps=2), 1, n=3)
    assert len(calls) >= 3 * m.cfg.n_layer  # module after lean: every layer through Block.forward


@pytest.mark.parametrize("shared", [False, True], ids=["one setting", "settings side by side"])
def test_latency_backend_times_with_its_step_and_leaves_the_quality_pass_alone(monkeypatch, shared):
    """eval.latency_backend: the batch-1 latency passes run the lean step (no Block.forward
    call) while the quality pass keeps eval.backend=module; the records are those of a run
    without it, the model decodes with the module step afterwards, the eval block names
    both steps, and batch_check sees the two steps agree (float32 rounding)."""
    m = model(HUGINN, torch.float32)
    tokens = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(3))
    policies = [build("stepnorm", 0.3, max_steps=9), build("fixed", None, max_steps=3)]
    calls, timing = [], [False]  # Block.forward calls: made in a latency pass or not
    real_forward, real_time = Block.forward, S.time_tokens

    def time_tokens(*a, **k):
        timing[0] = True
        try:
            return real_time(*a, **k)
        finally:
            timing[0] = False

    monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(timing[0]) or real_forward(self, *a, **k))
    monkeypatch.setattr(S, "time_tokens", time_tokens)

    def run(latency_backend):
        calls.clear()
        run = DecodeSettings(warmup_tokens=2, seed=5, backend="module", latency_tokens=12, repeats=2,
                             latency_backend=latency_backend, batch_size=4)
        if shared:
            return S.evaluate_exits(m, tokens, policies, 40, run), set(calls)
        return [S.evaluate_exit(m, tokens, p, 40, run) for p in policies], set(calls)

    (plain, seen_plain), (lat, seen) = run(None), run("lean")
    assert seen_plain == {True, False}  # without it the latency passes run Block.forward too ...
    assert seen == {False}  # ... with it they do not; the quality pass still does
    calls.clear()  # afterwards the model decodes with the module step (nothing of the lean one left attached)
    S.evaluate_exit(m, tokens, policies[1], 4, DecodeSettings(backend="module", latency_tokens=0, warmup_tokens=0))
    assert calls and not any(calls)
    for (ev0, rec0), (ev, rec) in zip(plain, lat, strict=True):
        assert (ev0["backend"], ev0["latency_backend"], ev["backend"], ev["latency_backend"]) == ("module", "module", "module", "lean")
        assert (rec["nll"] == rec0["nll"]).all() and (rec["apps"] == rec0["apps"]).all()
        assert ev["batch_check"]["apps_mismatch"] == 0 and ev["batch_check"]["max_abs_dnll"] <= 1e-5
        assert ev["latency_tokens"] == 12 and ev["repeats"] == 2


def test_auto_latency_backend_compiles_a_sweep_where_a_compiler_is(monkeypatch):
    """eval.latency_backend=auto (the default): the compiled step for the latency passes of at
    least AUTO_COMPILE_SETTINGS settings on a CPU with a C++ compiler, else the quality
    pass's step; an explicit step is kept whatever the count."""
    m = model(PLAIN, torch.float32)
    n = S.AUTO_COMPILE_SETTINGS
    for found in (True, False):
        monkeypatch.setattr(S, "has_cpp_compiler", lambda found=found: found)
        for quality in ("module", "lean"):  # eval.backend: the quality pass's
            auto = DecodeSettings(backend=quality, latency_backend="auto")
            assert S.latency_backend_for(m, auto, n) == ("compiled" if found else quality)
            assert S.latency_backend_for(m, auto, n - 1) == quality and S.latency_backend_for(m, auto, 1) == quality
            for step in (None, "module", "lean", "compiled"):
                fixed = DecodeSettings(backend=quality, latency_backend=step)
                assert S.latency_backend_for(m, fixed, 1) == S.latency_backend_for(m, fixed, n) == (step or quality)
    assert EvalConfig().latency_backend == "auto"


@pytest.mark.parametrize("settings", [2, 3])
def test_auto_latency_backend_reaches_the_timed_passes(monkeypatch, settings):
    """evaluate_exits hands the latency passes the step auto resolves to for its count of
    timed settings (the oracle, decoded alone, not among them), and evaluate_exit, one
    setting, keeps eval.backend: seen at `latency_backend_for` (the compiled step swapped for the
    lean one here, not to compile) and at the timed passes, the eval blocks name the step used."""
    m = model(PLAIN, torch.float32)
    tokens = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(S, "has_cpp_compiler", lambda: True)
    monkeypatch.setattr(S, "AUTO_COMPILE_SETTINGS", 3)
    asked, real = [], S.latency_backend_for

    def latency_backend_for(model, settings, timed):
        step = real(model, settings, timed)
        asked.append(step)
        return "lean" if step == "compiled" else step

    timed, real_time = [], S.time_tokens

    def time_tokens(model, tokens, policy, n_tokens, settings, *a, **k):
        timed.append(settings.backend)
        return real_time(model, tokens, policy, n_tokens, settings, *a, **k)

    monkeypatch.setattr(S, "latency_backend_for", latency_backend_for)
    monkeypatch.setattr(S, "time_tokens", time_tokens)
    policies = [build("fixed", None, max_steps=k) for k in range(1, settings + 1)] + [build("oracle", 0.01, max_steps=3)]
    run = DecodeSettings(warmup_tokens=1, seed=5, backend="module", latency_tokens=3, repeats=1, latency_backend="auto",
                         batch_size=4)
    out = S.evaluate_exits(m, tokens, policies, 20, run)
    assert asked == (["compiled"] if settings >= 3 else ["module"])  # the oracle: no latency pass
    assert timed == ["lean" if settings >= 3 else "module"] * settings
    assert [ev["latency_backend"] for ev, _ in out[:-1]] == ["lean" if settings >= 3 else "module"] * settings
    asked.clear()
    timed.clear()
    ev, _ = S.evaluate_exit(m, tokens, policies[0], 20, run)
    assert asked == ["module"] and timed == ["module"] and ev["latency_backend"] == "module"


def test_has_cpp_compiler_follows_torchs_search(monkeypatch):
    """`runtime.has_cpp_compiler`: True where torch's compiler search answers, False where it
    raises (no compiler on the machine)."""
    from torch._inductor import cpp_builder

    from recdepth.core import runtime

    def missing():
        raise RuntimeError("no C++ compiler")

    for search, found in ((lambda: "g++", True), (missing, False)):
        monkeypatch.setattr(cpp_builder, "get_cpp_compiler", search)
        runtime.has_cpp_compiler.cache_clear()
        assert runtime.has_cpp_compiler() is found
    runtime.has_cpp_compiler.cache_clear()


def test_bad_backend_is_one_line():
    m = model(PLAIN, torch.float32)
    with pytest.raises(ValueError, match=r"^eval\.backend: expected one of module, lean, compiled, got 'fast'$"):
        D.lean_steps(m, "fast")
    with pytest.raises(ValueError, match=r"^eval\.backend: expected one of module, lean, compiled, got 'fast'$"):
        DecodeSettings(backend="fast")
    with pytest.raises(ValueError, match=r"^eval\.backend: expected one of module, lean, compiled, got 'fast'$"):
        EvalConfig(backend="fast")
    bad = r"^eval\.latency_backend: expected null, auto or one of module, lean, compiled, got 'fast'$"
    with pytest.raises(ValueError, match=bad):
        EvalConfig(latency_backend="fast")
    tokens = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(3))
    for run in (lambda: S.evaluate_exit(m, tokens, build("fixed", None, max_steps=2), 10,
                                        DecodeSettings(latency_backend="fast")),
                lambda: S.evaluate_exits(m, tokens, [build("fixed", None, max_steps=2)], 10,
                                         DecodeSettings(latency_tokens=0).replace(latency_backend="fast"))):
        with pytest.raises(ValueError, match=bad):  # before any decoding, latency_tokens 0 or not
            run()


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_compiled_step_equals_eager():
    """torch.compile'd lean step against the module path on the tiny model (float32):
    NLL within float rounding, applications identical here (a criterion within rounding
    of τ could flip one; bench decode counts those on real checkpoints). The third window
    runs alone: the batch-1 graph, whose matrix-vector products are a product and a sum
    (`model.linear`) and whose attention reads a span, is compiled and checked too."""
    m = model(HUGINN, torch.float32, groups=((1, 2),))  # one group: two graphs to compile, not five
    policy = build("kl", 1e-2, max_steps=9)
    ref = score(m, "module", policy, 2)
    ev, comp = evaluate(m, "compiled", policy, 2)
    assert ev["backend"] == "compiled" and D.lean_steps(m, "compiled").compiled  # the run decoded with the compiled step
    assert abs(comp["nll"] - ref["nll"]).max() <= 1e-5
    assert (comp["apps"] == ref["apps"]).all()
    assert len(set(ref["apps"].ravel().tolist())) > 1
    # batches attend the whole block: a second batch size turns the batch dynamic (a graph
    # per function at most), a third builds none (no graph per batch size and span)
    from torch._dynamo.utils import counters

    graphs = [counters["stats"]["unique_graphs"]]
    for b in (3, 4):
        assert abs(score(m, "compiled", policy, b)["nll"] - ref["nll"]).max() <= 1e-5
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] - graphs[0] <= 2 and graphs[2] == graphs[1]


FUSED = [("kl", (1e-2, 3e-2), (0, 3), {"kl_direction": "old_new"}), ("gate", (0.5, 0.4), (1, 0), {})]
FUSED_SLOW = [("accel", (0.3, 0.1), (2, 0), {}), ("argmax_stability", None, (0, 1), {"patience": 2}), ("fixed", None, 0, {}), ("stepnorm", 0.3, 0, {}), ("stepnorm_rel", 0.1, 0, {}), ("accel_rel", 0.6, 0, {}),
              ("entropy_diff", 1e-2, 0, {}), ("cosine", 1e-3, 0, {}), ("kl", 1e-2, 0, {})]


def _fused_against_step_by_step(rule, tau, min_steps, kw, warm_start=False):
    """The compiled batch-1 loop as one graph (`LeanSteps.loop`: torch.while_loop, the rule's
    check `exits.observe_step` inside) against the compiled step called per application with
    the eager `ExitMonitor`, and against the eager lean step: NLL within float32 rounding,
    applications identical; the fused loop really ran (for each group at every token)."""
    m = model(HUGINN, torch.float32, groups=((1,), (2,)), seed=2)  # two one-layer groups: a graph per rule
    G = torch.Generator().manual_seed(4)
    gate = (torch.randn(2, 16, generator=G), torch.randn(2, generator=G)) if rule == "gate" else None
    policy = build(rule, tau, min_steps=min_steps, max_steps=9, gate=gate, **kw)
    tokens = torch.randint(0, 40, (80,), generator=torch.Generator().manual_seed(3))

    def run(step, fuse):
        lean = D.lean_steps(m, step)
        lean.fuse_loops = fuse
        calls, real = [], lean.loop

        def counted(*a):
            calls.append(1)
            return real(*a)

        lean.loop = counted
        _, rec = S.evaluate_exit(m, tokens, policy, 19, DecodeSettings(batch_size=1, latency_tokens=0, warmup_tokens=0,
                                                                       seed=5, backend=step, warm_start=warm_start))
        del lean.loop
        return rec, len(calls)

    (eager, _), (steps, n_steps), (fused, n_fused) = run("lean", False), run("compiled", False), run("compiled", True)
    assert n_steps == 0 and n_fused >= 2 * 19  # both groups at every scored token (and the warm-up's span steps)
    for ref in (eager, steps):
        assert abs(fused["nll"] - ref["nll"]).max() <= 1e-5
        assert (fused["apps"] == ref["apps"]).all()
    assert len(set(eager["apps"].ravel().tolist())) > 1 or rule == "fixed"  # the rule really varies depth


@pytest.mark.parametrize("rule, tau, min_steps, kw", FUSED, ids=[r[0] for r in FUSED])
def test_compiled_loop_as_one_graph_equals_the_step_by_step_loop(rule, tau, min_steps, kw):
    """Per-group τ and min_steps, kl's other direction (its history carried through the
    loop), the gate (the other rules, warm start and argmax_stability's patience: the slow
    test below; every rule's check against the slow reference: tests/exits/test_exits.py): see
    `_fused_against_step_by_step`."""
    _fused_against_step_by_step(rule, tau, min_steps, kw)


@pytest.mark.slow
@pytest.mark.parametrize("rule, tau, min_steps, kw", FUSED_SLOW, ids=[r[0] for r in FUSED_SLOW])
def test_compiled_loop_as_one_graph_equals_the_step_by_step_loop_every_rule(rule, tau, min_steps, kw):
    _fused_against_step_by_step(rule, tau, min_steps, kw, warm_start=rule == "stepnorm")


@pytest.mark.parametrize("block", [20, 64, 100, 256])
def test_compiled_attention_span_holds_the_position_and_at_most_twice_it(block):
    """The compiled step's attention at position p reads spans[p] entries: enough for
    positions 0 .. p, at most the block, and at most twice what p needs (or 16)."""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=block, vocab_size=40, groups=[[1]])
    lean = LeanSteps(LoopedGPT(cfg), compile=True)
    for p, span in enumerate(lean.spans):
        assert p + 1 <= span <= min(block, max(16, 2 * (p + 1)))
    starts = lean.span_starts(8)
    assert all(lean.spans[p] != lean.spans[p - 1] for p in starts)
    assert len(starts) == len(set(lean.spans[8:])) - (lean.spans[8] == lean.spans[7])


def test_compiled_warm_up_builds_every_span_so_a_timed_pass_compiles_nothing():
    """Under the compiled step the untimed warm-up (2 positions) also decodes one step at
    the first position of each later span, so the timed pass over positions 0 .. 18
    (spans 16 and 20) builds no graph: the compile stays out of the latency."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    m = model(PLAIN, torch.float32, groups=((1, 2),), seed=1)
    run = DecodeSettings(backend="compiled", cache="latest", seed=5)
    policy = build("fixed", None, max_steps=2)
    tokens = torch.randint(0, 40, (40,), generator=torch.Generator().manual_seed(3))
    start = counters["stats"]["unique_graphs"]
    D.warm_up(m, tokens, policy, run.replace(warmup_tokens=2))
    warmed = counters["stats"]["unique_graphs"]
    S.time_tokens(m, tokens, policy, 19, run)
    assert warmed > start and counters["stats"]["unique_graphs"] == warmed


def test_bench_decode_bound_is_the_models_arithmetic():
    """bench decode's lower bound: one layer application's FLOPs, counted by hand for the
    plain block (qkv 3d², proj d², MLP 2·d·4d, attention 4·T·d, the adapter's d² spread over
    the group's layers), and the bytes it must read (the layers' and adapters' weights once,
    each row's K/V)."""
    from recdepth.benchmarks import decode as bd

    m = model(PLAIN, torch.float32)  # d = 16, groups [1], [2, 3]: 3 looped layers, 2 adapters
    d, T, B = 16, 10, 4
    layer = 2 * (4 * d * d + 2 * d * 4 * d) + 4 * T * d
    flops = (3 * layer + 2 * 2 * d * d) / 3  # per looped layer, per application of every group
    assert bd.bound_seconds(m, B, T, 2, 6, peak=1.0) == pytest.approx(B * flops)
    weights = 3 * (4 * d + 4 * d * d + 2 * d * 4 * d) + 2 * d * d  # norms, attention, MLP; the adapters' W_s
    assert bd.bytes_per_layer(m, B, T) == pytest.approx(4 * (weights / 3 + 2 * T * d * B))


def test_bench_decode_times_each_backend_on_a_checkpoint(tiny_ckpt, ckpt_env, capsys):
    from recdepth import bench

    out = bench.main(["decode", "--ckpt", str(tiny_ckpt), "--no-paper", "--batches", "1", "2", "--rounds", "1",
                      "--decode-reps", "2", "--context", "4", "--backends", "module", "lean", "--tokens", "20"])
    rows = [r for r in out["rows"] if "backend" in r]
    assert [(r["batch"], r["backend"]) for r in rows] == [(1, "module"), (1, "lean"), (2, "module"), (2, "lean")]
    assert all(r["bound_ms"] > 0 and r["over_bound"] == pytest.approx(r["ms"] / r["bound_ms"]) for r in rows)
    assert all(r["vs_module"] == 1.0 for r in rows if r["backend"] == "module")
    rec = next(r["records"] for r in out["rows"] if "records" in r)
    assert rec["module"]["max_dnll"] == 0.0 and rec["lean"]["max_dnll"] <= 1e-5
    assert rec["lean"]["tokens"] == 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_decode_on_a_missing_gpu_says_so():
    from recdepth import bench

    with pytest.raises(ValueError, match=r"--device: cuda asked for, but torch sees no CUDA GPU"):
        bench.main(["decode", "--device", "cuda", "--no-paper", "--batches", "1"])


def _block_out_variant(x, y, w, eps, gated):
    """`model.block_out` with one change a researcher might make: the MLP's residual
    branch halved (what the recipe "change the block" in docs/contributing.md edits)."""
    B, T, C = x.shape
    x = F.rms_norm(linear(y.transpose(1, 2).reshape(B, T, C), w.proj) + x, (C,), w.norm2, eps)
    h = linear(F.rms_norm(x, (C,), w.norm3, eps), w.fc)
    h = gated_silu(h) if gated else F.silu(h)
    return F.rms_norm(0.5 * linear(h, w.mlp_proj) + x, (C,), w.norm4, eps)


@pytest.mark.parametrize("kw", [PLAIN, HUGINN], ids=["plain", "huginn"])
def test_a_change_to_the_block_reaches_every_path(monkeypatch, kw):
    """The block's math is written once (`model.qkv_of`, `model.block_out`): editing
    `block_out` (its code replaced in place, as an edit of the source would) changes the
    module path, and the lean step, which calls the same function, gives the module path's
    records under the change too."""
    import recdepth.model.looped as M

    m = model(kw, torch.float64)
    policy = build("stepnorm", 0.3, max_steps=9)
    before = score(m, "module", policy, 3)
    monkeypatch.setattr(M.block_out, "__code__", _block_out_variant.__code__)
    ref, lean = score(m, "module", policy, 3), score(m, "lean", policy, 3)
    assert abs(ref["nll"] - before["nll"]).max() > 1e-3  # the change took effect
    assert abs(lean["nll"] - ref["nll"]).max() <= 1e-12 and (lean["apps"] == ref["apps"]).all()
