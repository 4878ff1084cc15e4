"""data=carry (recdepth/data/tasks/carry.py) and in-place targets (a scored stream) through
the token pipeline and the decoding engine.

Every sum bit and difficulty is checked by a solver written here from the task's statement
(the addends read back from the decoded pair tokens, added as Python integers, the bits of
the sum compared; the difficulty found by scanning back for the pair that decides the
carry), never by the generator's own code; the scored stream is followed from the generator
through the cache, the windows, the batches and the loader, and into `decode_windows`,
whose NLL is checked against a parallel forward's cross-entropy on the in-place targets.
Data without in-place targets yields what it yielded before."""

import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from recdepth.config.schema import data_config
from recdepth.data import tasks
from recdepth.data.datamodule import TokenDataModule
from recdepth.data.tokenizer import EOT_ID, gpt2
from tests.data.helpers import assert_splits_disjoint, in_place_expected, in_place_split, symbols_of

COUNTS = dict(train_records=48, test_records=24, validation_records=24, extrapolation_records=24)
SPLITS = ("train", "validation", "test", "extrapolation")
T = 64  # block_size: a few packed instances, the longest (24 bits) fits
PAIR = {"a": (0, 0), "b": (1, 0), "c": (0, 1), "d": (1, 1)}  # the task's statement: (a_i, b_i)


def carry_data(tmp_path, loss="answers", **task) -> dict:
    return {"source": "task", **COUNTS, "loss": loss, "cache_dir": str(tmp_path / "cache"),
            "task": {"name": "carry", **task}}


def data_module(tmp_path, block_size=T, batch_size=4, **kw) -> TokenDataModule:
    dm = TokenDataModule(data_config(carry_data(tmp_path, **kw)), block_size, batch_size, 6)
    dm.setup()
    return dm


# ------------------------------------------------------------------ the independent solver
def solve(pairs: list[str]) -> list[tuple[int, int]]:
    """(sum bit, difficulty) of every bit of the addition the pair symbols state."""
    bits = [PAIR[p] for p in pairs]
    a = sum(x << i for i, (x, _) in enumerate(bits))
    b = sum(y << i for i, (_, y) in enumerate(bits))
    total = a + b
    out = []
    for i in range(len(bits)):
        j = next((j for j in range(i - 1, -1, -1) if bits[j][0] == bits[j][1]), None)
        out.append(((total >> i) & 1, i + 1 if j is None else i - j))
    return out


def expected(syms: list[str]) -> tuple[list[str | None], list[int], list[int]]:
    """From a stream's symbols alone: each position's in-place target (the sum bit "0"/"1"
    where the token is the one after a pair, else None: the token itself), its label, and
    each instance's bit count."""
    return in_place_expected(syms, PAIR, solve)


# ------------------------------------------------------------------ the task
def test_carry_is_registered_in_place_and_the_others_are_not():
    assert "carry" in tasks.names() and tasks.lookup("carry") is tasks.Carry
    c = tasks.Carry()
    assert (c.size, c.extrapolation, c.propagate) == ([8, 16], [17, 24], 0.75)
    assert c.in_place() and not c.one_per_record() and not c.has_step_targets()
    for name in ("hops", "addition", "modsum", "roots"):
        assert not tasks.lookup(name)().in_place()


@pytest.mark.parametrize("split", SPLITS)
def test_carry_records_agree_with_an_independent_solver(tmp_path, split):
    """Every record: EOT, then whole instances (pairs, ` =`, a newline), the rest EOT; the
    scored stream holds each sum bit on the token after its pair, labelled with its
    difficulty, and equals the tokens everywhere else (label 0 there); sizes in range."""
    dm = data_module(tmp_path)
    toks, labs, scored = in_place_split(dm, split)
    assert toks.shape == labs.shape == scored.shape
    syms, scored_syms = symbols_of(dm.vocab, toks), symbols_of(dm.vocab, scored)
    want, want_labels, sizes = expected(syms)
    for p, w in enumerate(want):
        assert scored_syms[p] == (syms[p] if w is None else w), p
    assert labs.tolist() == want_labels
    lo, hi = dm.data.task.sizes(split)
    assert lo <= min(sizes) and max(sizes) <= hi and len(set(sizes)) > 1
    assert int((labs > 0).sum()) == sum(sizes)
    assert (scored != toks).sum() > 0 and set(scored_syms) - set(syms) <= {"0", "1"}
    d = labs[labs > 0]
    assert d.min() == 1 and d.max() >= 5  # long chains occur (propagate = 0.75)
    if split == "extrapolation":
        assert min(sizes) > dm.data.task.size[1]


def test_chains_follow_propagate():
    """P(a_i != b_i) = propagate: measured over many pairs, both kinds of deciding pair alike."""
    task = tasks.Carry(size=[8, 16], propagate=0.6)
    it = tasks.instances(task, "train", 0)
    pairs = [p for _ in range(2000) for p, *_ in next(it)[:-1]]
    n = len(pairs)
    prop = sum(p in ("b", "c") for p in pairs) / n
    assert abs(prop - 0.6) < 0.01 and abs(pairs.count("a") / n - 0.2) < 0.01


def test_carry_generator_is_deterministic_and_its_splits_share_no_instance():
    spec = tasks.Carry()
    ids = tasks.symbol_ids(gpt2().encode_ordinary)
    a = tasks.records(spec, "train", 0, 12, T, ids, EOT_ID)
    b = tasks.records(spec, "train", 0, 12, T, ids, EOT_ID)
    c = tasks.records(spec, "train", 1, 12, T, ids, EOT_ID)
    assert len(a) == 3 and a[2].shape == a[0].shape and a[2].dtype == np.uint16  # tokens, labels, scored stream
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], c[0])
    assert_splits_disjoint(tasks.Carry(size=[2, 4], extrapolation=[5, 6]))  # 336 instances of 2-4 bits


@pytest.mark.parametrize("task, field", [
    ({"size": [0, 4]}, "data.task.size"),
    ({"size": [5, 3]}, "data.task.size"),
    ({"size": [1, 20]}, "data.task.extrapolation"),  # not above size
    ({"extrapolation": [12, 30]}, "data.task.extrapolation"),
    ({"propagate": 0}, "data.task.propagate"),
    ({"propagate": 1}, "data.task.propagate"),
    ({"propagate": 1.5}, "data.task.propagate"),
    ({"ripple": -0.1}, "data.task.ripple"),
    ({"ripple": 2}, "data.task.ripple"),
    ({"nodes": 3}, "data.task.nodes"),  # another task's option
])
def test_bad_carry_config_is_one_line_naming_the_field(task, field):
    with pytest.raises(ValueError, match="^" + field.replace(".", r"\.") + ": ") as e:
        data_config({"source": "task", "task": {"name": "carry", **task}})
    assert "\n" not in str(e.value)


def test_a_rippling_instance_carries_through_every_bit_by_an_independent_solver():
    """ripple=1: pair 0 generates, every later pair propagates, so bit i's carry is decided at
    pair 0 (d_i = i, d_0 = 1 from the start) and every sum bit above 0 is 0 (a + b = 2^n):
    checked by `solve`, integer addition; ripple=0 draws exactly the instances of before."""
    task = tasks.lookup("carry")(size=[8, 16], extrapolation=[40, 40], ripple=1.0)
    rng = random.Random(3)
    for _ in range(20):
        inst = task.generate(rng, (40, 40))
        pairs = [t[0] for t in inst[:-1]]
        assert pairs[0] == "d" and all(p in "bc" for p in pairs[1:])
        got = [(int(t[3]), t[1]) for t in inst[1:]]  # the token after pair i carries s_i and d_i
        assert got == solve(pairs) == [(0, 1)] + [(0, i) for i in range(1, 40)]
    plain, none = tasks.lookup("carry")(), tasks.lookup("carry")(ripple=0.0)
    r1, r2 = random.Random(9), random.Random(9)
    assert [plain.generate(r1, (8, 16)) for _ in range(50)] == [none.generate(r2, (8, 16)) for _ in range(50)]


def test_a_scored_symbol_needs_an_in_place_task():
    spec = tasks.Modsum()
    spec.generate = lambda rng, sizes: [(tasks.DIGITS[rng.randrange(10)], 0, (), None), ("2", 1, (), "3")]
    with pytest.raises(ValueError, match=r"^data\.task: a modsum token states a scored symbol, but"):
        tasks.records(spec, "train", 0, 2, 16, tasks.symbol_ids(gpt2().encode_ordinary), EOT_ID)


# ------------------------------------------------------------------ through cache, windows and batches
def check_batch(dm: TokenDataModule, batch, answers_only: bool = True) -> int:
    """Each row of a batch (x, y) decoded to symbols and solved again: x at p is the token,
    y at a pair's position its sum bit, -1 elsewhere (answers only) or the next token (all)."""
    assert len(batch) == 2
    x, y = batch
    seen = 0
    for b in range(x.shape[0]):
        syms = symbols_of(dm.vocab, x[b])
        first = next(i for i, s in enumerate(syms) if s in ("<eot>", "\n"))  # a window starts inside no instance
        want, _, _ = expected(syms[first:])
        for p in range(first, x.shape[1] - 1):
            w = want[p + 1 - first]
            if w is None:
                assert y[b, p] == (-1 if answers_only else x[b, p + 1])
            else:
                assert syms[p] in PAIR and symbols_of(dm.vocab, [y[b, p]]) == [w]
                seen += 1
    return seen


def test_the_scored_stream_stays_aligned_through_cache_windows_batches_and_the_loader(tmp_path):
    dm = data_module(tmp_path)
    assert dm.has_scored_stream and dm.cache.meta["targets"] is True and dm.step_width == 0
    for split in ("train", "val"):
        f = dm.cache.path / f"{split}.targets.bin"
        assert f.stat().st_size == (dm.cache.path / f"{split}.bin").stat().st_size
    assert {"0", "1"} <= set(symbols_of(dm.vocab, range(dm.vocab_size - 1)))  # the vocabulary holds the sum bits
    seen = sum(check_batch(dm, dm.train_dataset()[k]) for k in range(3))
    for batch in dm.val_dataloader():
        seen += check_batch(dm, batch)
    assert seen > 0
    loader = list(dm.train_dataloader(start_step=1))
    assert all(torch.equal(a, b) for a, b in zip(loader[0], dm.train_dataset()[1], strict=True))
    ds = pickle.loads(pickle.dumps(dm.train_dataset()))
    assert all(torch.equal(a, b) for a, b in zip(ds[2], dm.train_dataset()[2], strict=True))
    dm_all = data_module(tmp_path, loss="all")
    x, y = dm_all.train_dataset()[0]
    assert (y >= 0).all() and check_batch(dm_all, (x, y), answers_only=False) > 0
    # what validation scores (and its unigram baseline reads) at the answers: the sum bits
    v0, nv = int(dm.val_offsets[0]), len(dm.val_offsets) * T
    answer = np.asarray(dm.cache.val_labels[v0 + 1 : v0 + nv + 1]) > 0
    assert set(symbols_of(dm.vocab, dm.val_targets()[answer])) == {"0", "1"}
    # a damaged scored stream is rebuilt, not trusted
    f = dm.cache.path / "val.targets.bin"
    want = f.read_bytes()
    with open(f, "r+b") as fh:
        fh.truncate(len(want) - 2)
    again = data_module(tmp_path)
    assert again.cache.built and f.read_bytes() == want


def test_data_without_in_place_targets_is_unchanged(tmp_path):
    dm = TokenDataModule(data_config({"source": "task", **COUNTS, "cache_dir": str(tmp_path),
                                      "task": {"name": "modsum", "size": [1, 6], "extrapolation": [7, 9]}}), 128, 4, 4)
    dm.setup()
    assert not dm.has_scored_stream and dm.cache.train_targets is None and "targets" not in dm.cache.meta
    assert not list(dm.cache.path.glob("*.targets.bin")) and dm.heldout_targets(8) is None
    x, y = dm.train_dataset()[0]
    w = torch.from_numpy(np.asarray(dm.cache.train)[dm.train_offsets[:4, None] + np.arange(129)].astype(np.int64))
    assert torch.equal(x, w[:, :-1]) and torch.equal(y[y >= 0], w[:, 1:][y >= 0])


# ------------------------------------------------------------------ decoding against the scored stream
def test_decode_windows_scores_against_the_scored_stream(tmp_path):
    """At a fixed depth under the per-step cache, decode_windows' NLL and correctness with
    `targets` equal a parallel forward's against the in-place targets; `records` reports
    them as the targets; without `targets` (or with the tokens as targets) it scores the
    next token, as before."""
    from recdepth.decode.engine import decode_windows, records
    from recdepth.decode.settings import DecodeSettings
    from recdepth.exits import build
    from recdepth.model.looped import GPTConfig, LoopedGPT

    dm = data_module(tmp_path)
    first, n = dm.region("test")
    toks = torch.as_tensor(dm.heldout_tokens(n, first))
    scored = dm.heldout_targets(n, first)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=T, vocab_size=dm.vocab_size, groups=[[1]],
                    attention_window=2, position="rope", state_init="input")
    m = LoopedGPT(cfg).double().eval()
    wins = [(0, T), (T, T)]
    fixed, run = build("fixed", None, max_steps=3), DecodeSettings(cache="per_step", seed=0)
    nll, apps, _, ok = decode_windows(m, toks, wins, fixed, run, targets=scored)
    assert (apps == 3).all()
    with torch.no_grad():
        logits, _ = m(torch.stack([toks[s : s + T] for s, _ in wins]), loops=[3])
    y = torch.stack([torch.as_tensor(scored[s + 1 : s + T + 1]) for s, _ in wins])
    ref = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # the model's nll: no "other" target here
    torch.testing.assert_close(nll, ref.double(), rtol=1e-9, atol=1e-9)
    assert torch.equal(ok, logits.argmax(-1) == y)
    rec = records(wins, nll, apps, toks, T, correct=ok, targets=scored)
    assert np.array_equal(rec["target"], scored[1 : 2 * T + 1]) and np.array_equal(rec["nll"], nll.reshape(-1).numpy())
    plain = decode_windows(m, toks, wins, fixed, run)
    same = decode_windows(m, toks, wins, fixed, run, targets=toks.numpy())
    assert all(torch.equal(a, b) for a, b in zip([plain[i] for i in (0, 1, 3)], [same[i] for i in (0, 1, 3)],
                                                 strict=True))
    assert not torch.equal(plain[0], nll)
    assert np.array_equal(records(wins, *plain[:2], toks, T)["target"], toks[1 : 2 * T + 1].numpy())
    # the scoring above the engine passes it on: the batched pass, the batch-1 timed pass, the oracle
    from recdepth.decode.scoring import evaluate_exit

    labels, timed = dm.heldout_labels(n, first), run.replace(latency_tokens=T, repeats=1, warmup_tokens=0)
    ev, rec = evaluate_exit(m, toks, fixed, 2 * T, timed, labels=labels, targets=scored)
    keep = labels[1 : 2 * T + 1] > 0
    assert np.array_equal(rec["target"], scored[1 : 2 * T + 1][keep]) and np.allclose(rec["nll"], nll.reshape(-1)[keep])
    assert ev["batch_check"]["max_abs_dnll"] == 0 and ev["answers"]["tokens"] == keep.sum()
    _, orc = evaluate_exit(m, toks, build("oracle", 1e-2, max_steps=3), 2 * T, run, labels=labels, targets=scored)
    assert np.allclose(orc["nll_by_n"][:, -1], nll.reshape(-1)[keep])


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
@torch.no_grad()
def test_gate_data_takes_its_losses_against_the_scored_stream(tmp_path):
    """The learned gate's labels on carry: decoding_gate_data with `targets` gives, at each
    kept answer and depth n, the NLL of the in-place target (the sum bit), checked against a
    slow batch-1 decode (history at N, the answer at n) scored by hand; at n = N against
    the parallel forward too; without `targets` it scores the next token."""
    from recdepth.decode.engine import RowNoise, decode_step
    from recdepth.decode.gate_states import decoding_gate_data
    from recdepth.decode.kv_cache import new_caches
    from recdepth.decode.settings import DecodeSettings
    from recdepth.exits import build
    from recdepth.model.looped import GPTConfig, LoopedGPT

    dm = data_module(tmp_path)
    first, n = dm.region("test")
    toks = torch.as_tensor(dm.heldout_tokens(n, first)).long()
    scored = torch.as_tensor(np.asarray(dm.heldout_targets(n, first), dtype=np.int64))
    labels = torch.as_tensor(np.asarray(dm.heldout_labels(n, first), dtype=np.int64))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=T, vocab_size=dm.vocab_size, groups=[[1]],
                    attention_window=2, position="rope", state_init="input")
    m = LoopedGPT(cfg).double().eval()
    starts, N, run = (0, T), 3, DecodeSettings(cache="per_step", seed=0)
    wins = torch.stack([toks[s : s + T + 1] for s in starts])
    tw = torch.stack([scored[s : s + T + 1] for s in starts])
    keep = torch.stack([labels[s + 1 : s + T + 1] > 0 for s in starts])
    nll_by_n = decoding_gate_data(m, wins, N, run, keep=keep, targets=tw)[0][1]
    assert nll_by_n.shape == (int(keep.sum()), N)
    k = 0
    for w in range(len(starts)):
        for t in torch.nonzero(keep[w]).flatten().tolist():
            for depth in range(1, N + 1):
                caches, noise = new_caches(m, 1, T, "per_step", N), RowNoise(0, [w])
                for pos in range(t):
                    decode_step(m, wins[w, pos : pos + 1], pos, caches, build("fixed", None, max_steps=N), noise=noise)
                logits, _ = decode_step(m, wins[w, t : t + 1], t, caches, build("fixed", None, max_steps=depth),
                                        noise=noise)
                want = -torch.log_softmax(logits[0, : dm.vocab_size], -1)[tw[w, t + 1]]
                torch.testing.assert_close(nll_by_n[k, depth - 1].double(), want, rtol=1e-6, atol=1e-6)
            k += 1
    logits, _ = m(wins[:, :-1], loops=[N])
    ref = F.cross_entropy(logits.transpose(1, 2), tw[:, 1:], reduction="none")[keep]
    torch.testing.assert_close(nll_by_n[:, -1].double(), ref, rtol=1e-6, atol=1e-6)
    plain = decoding_gate_data(m, wins, N, run, keep=keep)[0][1]
    assert (plain - nll_by_n).abs().max() > 1e-3  # the next token is not the sum bit
    with pytest.raises(ValueError, match="decoding_gate_data: targets") as e:
        decoding_gate_data(m, wins, N, run, keep=keep, targets=tw[:, :-1])
    assert "\n" not in str(e.value)


@torch.no_grad()
def test_parallel_gate_data_takes_its_losses_against_the_scored_stream(tmp_path):
    """collect_gate_data with `scored` (gate.states=parallel on carry): nll_by_n[:, n − 1] is
    the parallel forward at n scored against the in-place targets (one group, the state
    starting at its input: no noise)."""
    from recdepth.exits.gate import collect_gate_data
    from recdepth.model.looped import GPTConfig, LoopedGPT

    dm = data_module(tmp_path)
    first, n = dm.region("test")
    toks = torch.as_tensor(dm.heldout_tokens(n, first)).long()
    scored = torch.as_tensor(np.asarray(dm.heldout_targets(n, first), dtype=np.int64))
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=T, vocab_size=dm.vocab_size, groups=[[1]],
                    attention_window=2, position="rope", state_init="input")
    m = LoopedGPT(cfg).double().eval()
    wins = torch.stack([toks[s : s + T + 1] for s in (0, T, 2 * T)])
    tw = torch.stack([scored[s : s + T + 1] for s in (0, T, 2 * T)])
    N = 4
    feats, nll_by_n = collect_gate_data(m, [wins[:2], wins[2:]], N, scored=[tw[:2], tw[2:]])[0]
    assert feats.shape == (3 * T, N - 1, 16) and nll_by_n.shape == (3 * T, N)
    for depth in range(1, N + 1):
        logits, _ = m(wins[:, :-1], loops=[depth])
        ref = F.cross_entropy(logits.transpose(1, 2), tw[:, 1:], reduction="none").reshape(-1)
        torch.testing.assert_close(nll_by_n[:, depth - 1].double(), ref, rtol=1e-5, atol=1e-6)
    plain = collect_gate_data(m, [wins], N)[0][1]
    assert (plain - nll_by_n).abs().max() > 1e-3  # the next token is not the sum bit
    with pytest.raises(ValueError, match="collect_gate_data: scored"):
        collect_gate_data(m, [wins], N, scored=[tw[:, :-1]])


# ------------------------------------------------------------------ the config
def test_experiment_carry_composes_and_validates():
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = validated(compose("config", overrides=["experiment=carry", "run_dir=/tmp/unused"]))
    assert run.data.source == "task" and type(run.data.task) is tasks.Carry
    assert run.model.attention_window == 2 and run.sampler.name == "fixed" and run.loss.steps == "all"
    assert run.eval.cache == "per_step" and run.eval.context_steps is None
    assert run.eval.tokens == run.data.test_records * run.model.block_size
    longest = run.data.task.extrapolation[1] + 3  # EOT, the pairs, ` =`, the newline
    assert longest <= run.model.block_size


def test_a_packed_instance_starts_without_carry():
    """An instance's first pair is no answer-bearing token (label 0, scored as itself), and
    its first sum bit, on the next token, is difficulty 1: its carry-in is 0 by definition."""
    for _ in range(50):
        inst = tasks.Carry().generate(random.Random(_), (8, 16))
        assert inst[0][1] == 0 and inst[0][3] is None and inst[1][1] == 1
        assert inst[-1][0] == "=" and inst[-1][3] in ("0", "1")
