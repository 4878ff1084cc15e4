"""Tests for the data path: recdepth/data/sources/ (sources and their configs),
recdepth.data.token_cache (token caches), recdepth.data.vocabulary, recdepth.data.windows and
the TokenDataModule (recdepth.data.datamodule), unigram baseline, errors; a stored data
config of the old flat form read back (recdepth.data.config).

Every test writes its caches under tmp_path. Expected values come from independent
computations (tiktoken's own encode/decode of the raw text, pure-Python loops, slicing the
memmaps by hand), never from the package's output.
"""

from __future__ import annotations

import copy
import json
import lzma
import math
import random
from collections import Counter
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from recdepth.config.schema import data_config
from recdepth.data import token_cache as tokens
from recdepth.data.datamodule import TokenDataModule
from recdepth.data.tokenizer import EOT_ID, gpt2
from recdepth.data.windows import TrainOrder

WORDS = (
    "the king queen sword crown night day love death honour thou thee art hath doth "
    "wherefore fair foul storm sea ship ghost blood letter garden 1599 — café naïve !? ;"
).split()


def make_text(seed: int, n_words: int = 400) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_words // 10):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(10)).capitalize() + ".")
    return "\n".join(lines) + "\n"


def expected_stream(texts: list[str]) -> list[int]:
    """The GPT-2 token stream of `texts`, EOT after each, straight from tiktoken."""
    out: list[int] = []
    for t in texts:
        out += gpt2().encode_ordinary(t) + [EOT_ID]
    return out


WINDOWS = ("block_size", "batch_size", "max_steps", "seed")  # the data module's own arguments


def make_dm(source: str, **kw) -> TokenDataModule:
    """The data module of `source`: data.* keys from kw (validated, `schema.data_config`),
    the windows' arguments (WINDOWS) beside them."""
    win = {k: kw.pop(k) for k in WINDOWS if k in kw}
    d = {"source": source, **{k: str(v) if isinstance(v, Path) else v for k, v in kw.items()}}
    return TokenDataModule(data_config(d), **win)


def full_stream(dm: TokenDataModule) -> np.ndarray:
    """train + val as GPT-2 ids."""
    return dm.vocab.to_gpt2(np.concatenate([dm.train_tokens, dm.val_tokens]))


def dm_files(tmp_path, paths, **kw) -> TokenDataModule:
    args = dict(
        block_size=8, batch_size=4, max_steps=5, val_fraction=0.25, cache_dir=tmp_path / "cache"
    )
    args.update(kw)
    dm = make_dm("files", paths=paths, **args)
    dm.setup()
    return dm


@pytest.fixture
def build_counter(monkeypatch):
    """Counts how many times a cache is actually built."""
    calls = []
    real = tokens.build_cache

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(tokens, "build_cache", counting)
    return calls


# ---------------------------------------------------------------------------------------
# Tokenization


def test_shakespeare_roundtrip_and_eot(tmp_path):
    raw = lzma.decompress(
        resources.files("recdepth").joinpath("assets", "shakespeare.jsonl.xz").read_bytes()
    )
    docs = [json.loads(line)["text"] for line in raw.decode("utf-8").splitlines() if line.strip()]
    assert len(docs) == 42

    dm = make_dm(
        "shakespeare", block_size=128, batch_size=4, max_steps=2, cache_dir=tmp_path, compact_vocab=False
    )
    dm.setup()
    stream = full_stream(dm)
    n = len(stream)
    # Tail split, nanoGPT style.
    assert len(dm.train_tokens) == int(n * 0.95) and len(dm.val_tokens) == n - int(n * 0.95)
    # One EOT after every play, the stream ends with one, and cutting at the EOTs gives
    # back each play's text exactly.
    eots = np.flatnonzero(stream == EOT_ID)
    assert len(eots) == len(docs) and eots[-1] == n - 1
    starts = np.concatenate([[0], eots[:-1] + 1])
    for doc, s, e in zip(docs, starts, eots):
        assert gpt2().decode(stream[s:e].tolist()) == doc
    # Compact vocab (the shakespeare default): exactly the distinct GPT-2 ids of the train
    # split, sorted, then the shared "other" entry; held-out ids unseen in train map to it.
    cm = make_dm("shakespeare", block_size=128, batch_size=4, max_steps=2, cache_dir=tmp_path)
    cm.setup()
    train_ids = np.unique(stream[: len(dm.train_tokens)])
    assert np.array_equal(cm.id_map[:-1], train_ids) and cm.id_map[-1] == -1
    assert cm.vocab_size == len(train_ids) + 1 < 50257 and cm.other_id == len(train_ids)
    assert cm.n_other == 50257 - len(train_ids)
    assert cm.eot_id == int(np.searchsorted(train_ids, EOT_ID))
    seen = np.isin(stream, train_ids)
    assert np.array_equal(full_stream(cm), np.where(seen, stream, -1))
    assert seen[: len(dm.train_tokens)].all() and not seen.all()  # some held-out ids never occur in train
    assert cm.cache.meta["val_other_tokens"] == int((~seen).sum())


def test_tiny_files_stream_has_eot_after_each_document(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("To be, or not to be")
    b.write_text("that is the question\n")
    dm = dm_files(tmp_path, [str(a), str(b)], block_size=2, val_fraction=0.3)
    stream = full_stream(dm).tolist()
    ta = gpt2().encode_ordinary("To be, or not to be")
    tb = gpt2().encode_ordinary("that is the question\n")
    assert stream == ta + [EOT_ID] + tb + [EOT_ID]
    assert (
        gpt2().decode(stream)
        == "To be, or not to be<|endoftext|>that is the question\n<|endoftext|>"
    )


# ---------------------------------------------------------------------------------------
# Cache


def test_cache_invalidation_on_changed_file(tmp_path, build_counter):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(0))
    dm1 = dm_files(tmp_path, [str(f)])
    assert len(build_counter) == 1 and dm1.cache.built
    meta = dm1.cache_path / "meta.json"
    mtime = meta.stat().st_mtime_ns
    tokens1 = full_stream(dm1).copy()

    # Unchanged file: same cache directory, not tokenized again.
    dm2 = dm_files(tmp_path, [str(f)])
    assert dm2.cache_path == dm1.cache_path
    assert len(build_counter) == 1 and not dm2.cache.built
    assert meta.stat().st_mtime_ns == mtime

    # Changed contents (same path, same length class): new key, re-tokenized, new tokens.
    f.write_text(make_text(1))
    dm3 = dm_files(tmp_path, [str(f)])
    assert dm3.cache_path != dm1.cache_path
    assert len(build_counter) == 2
    tokens3 = full_stream(dm3)
    assert not np.array_equal(tokens1, tokens3)
    assert tokens3.tolist() == expected_stream([make_text(1)])


def test_key_depends_on_token_changing_options(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(0))
    base = dm_files(tmp_path, [str(f)]).cache_path
    assert dm_files(tmp_path, [str(f)], val_fraction=0.3).cache_path != base
    assert dm_files(tmp_path, [str(f)], compact_vocab=True).cache_path != base
    assert dm_files(tmp_path, [str(f)], max_tokens=100).cache_path != base
    # Options that don't change the tokens share the cache.
    assert dm_files(tmp_path, [str(f)], block_size=4, batch_size=2, seed=3).cache_path == base


@pytest.mark.parametrize(
    "damage", ["truncate_bin", "garbage_meta", "missing_meta", "missing_vocab"]
)
def test_damaged_cache_is_rebuilt(tmp_path, build_counter, damage):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(2))
    dm = dm_files(tmp_path, [str(f)], compact_vocab=True)
    expected = full_stream(dm).tolist()
    d = dm.cache_path
    if damage == "truncate_bin":
        with open(d / "train.bin", "r+b") as fh:
            fh.truncate(10)
    elif damage == "garbage_meta":
        (d / "meta.json").write_text("{not json")
    elif damage == "missing_meta":
        (d / "meta.json").unlink()
    else:
        (d / "vocab.npy").unlink()
    dm2 = dm_files(tmp_path, [str(f)], compact_vocab=True)
    assert len(build_counter) == 2 and dm2.cache.built
    assert full_stream(dm2).tolist() == expected


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 2, then 4 documents (tokens.BLOCK_*), so small corpora span several."""
    monkeypatch.setattr(tokens, "BLOCK_DOCS", 2)
    monkeypatch.setattr(tokens, "BLOCK_GROWTH", 2)


@pytest.fixture
def tokenized(monkeypatch):
    """The documents tokens.tokenize_batch is handed, one list per Dataset.map batch."""
    calls = []
    real = tokens.tokenize_batch

    def counting(batch):
        calls.append(list(batch["text"]))
        return real(batch)

    monkeypatch.setattr(tokens, "tokenize_batch", counting)
    return calls


def write_docs(tmp_path, docs) -> list[str]:
    paths = []
    for i, doc in enumerate(docs):
        (tmp_path / f"{i:02d}.txt").write_text(doc)
        paths.append(str(tmp_path / f"{i:02d}.txt"))
    return paths


def test_crash_mid_build_leaves_no_complete_looking_cache(tmp_path, monkeypatch, small_blocks):
    docs = [make_text(40 + i, 60) for i in range(7)]  # blocks: docs 0-1, 2-5, 6
    paths = write_docs(tmp_path, docs)
    dm = dm_files(tmp_path, paths)
    d = dm.cache_path
    blocks = tmp_path / "cache" / "hf-datasets" / "tokenized" / d.name
    assert not blocks.exists()  # the map cache goes once the token cache is complete
    # Rebuild after damaging it, and crash in the second block's Dataset.map.
    (d / "meta.json").write_text("{}")
    real, seen = tokens.tokenize_batch, []

    def boom(batch):
        if seen:
            raise RuntimeError("disk on fire")
        seen.append(list(batch["text"]))
        return real(batch)

    monkeypatch.setattr(tokens, "tokenize_batch", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        dm_files(tmp_path, paths)
    assert seen == [docs[:2]]
    assert not (d / "meta.json").exists()
    assert not [p for p in d.iterdir() if ".tmp-" in p.name]  # temp files cleaned up
    assert len(list(blocks.glob("*.arrow"))) == 1  # the finished block's map cache
    # The next build resumes: block 0 comes from datasets' cache, only the rest is mapped.
    seen.clear()
    monkeypatch.setattr(tokens, "tokenize_batch", lambda batch: seen.append(list(batch["text"])) or real(batch))
    assert full_stream(dm_files(tmp_path, paths)).tolist() == expected_stream(docs)
    assert seen == [docs[2:6], docs[6:]] and not blocks.exists()


@pytest.mark.parametrize("cap", [None, 50, 100, "two_blocks", 10**6])
def test_blockwise_map_equals_slow_reference(tmp_path, small_blocks, tokenized, cap):
    """Dataset.map over blocks, written into one memmap, is tiktoken's encoding of each
    document plus EOT, concatenated, token for token, and cut at exactly max_tokens; a cap
    stops mapping at the first block that reaches it."""
    docs = [make_text(50 + i, 20 + 15 * i) for i in range(9)]  # blocks: 0-1, 2-5, 6-8
    docs[3] = "naïve café 東京 😀\n" + docs[3]
    ref = expected_stream(docs)
    if cap == "two_blocks":  # exactly the tokens of blocks 0 and 1: block 2 is never mapped
        cap = len(expected_stream(docs[:6]))
    dm = dm_files(tmp_path, write_docs(tmp_path, docs), max_tokens=cap)
    assert full_stream(dm).tolist() == ref[:cap]
    assert dm.cache.meta["n_tokens"] == len(ref[:cap])
    mapped = [doc for batch in tokenized for doc in batch]
    ends = [b for b in (2, 6) if cap is not None and len(expected_stream(docs[:b])) >= cap]
    assert mapped == docs[: (ends + [9])[0]]  # a cap past the end: every document


def test_second_prepare_is_a_cache_hit(tmp_path, tokenized):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(60))
    data = data_config({"source": "files", "paths": [str(f)], "cache_dir": str(tmp_path / "cache")})
    first = data.prepare(8, progress=False)
    assert first.built and tokenized == [[make_text(60)]]
    again = data.prepare(8, progress=False)
    assert not again.built and again.path == first.path and len(tokenized) == 1  # not tokenized again
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)


# ---------------------------------------------------------------------------------------
# Vocabulary


def test_compact_vocab_maps_back(tmp_path):
    text = make_text(4)
    f = tmp_path / "doc.txt"
    f.write_text(text)
    dm = dm_files(tmp_path, [str(f)], compact_vocab=True)
    v = dm.vocab
    ref = gpt2().encode_ordinary(text) + [EOT_ID]  # independent encoding
    train = set(ref[: len(dm.train_tokens)])
    expect = [t if t in train else -1 for t in ref]  # held-out ids unseen in train -> "other"
    assert -1 in expect
    assert v.to_gpt2(np.concatenate([dm.train_tokens, dm.val_tokens])).tolist() == expect
    assert dm.vocab_size == len(train) + 1 and dm.n_other == 50257 - len(train)
    assert int(dm.val_tokens.max()) == dm.other_id == dm.vocab_size - 1
    # from_gpt2 inverts to_gpt2 on the train vocabulary, also on tensors; others -> "other".
    assert np.array_equal(v.from_gpt2(ref), np.concatenate([dm.train_tokens, dm.val_tokens]))
    t = torch.tensor(ref[:10])
    assert torch.equal(v.to_gpt2(v.from_gpt2(t)), t)
    absent = next(i for i in range(50257) if i not in set(ref))
    assert v.from_gpt2([ref[0], absent]).tolist() == [v.from_gpt2([ref[0]])[0], dm.other_id]
    with pytest.raises(ValueError, match="GPT-2 id 50257 is not in the model vocabulary"):
        v.from_gpt2([50257])
    n_train = len(dm.train_tokens)
    assert dm.decode(v.from_gpt2(ref[:n_train])) == gpt2().decode(ref[:n_train])
    assert dm.decode([dm.other_id]) == "\ufffd"


def test_full_vocab_is_identity(tmp_path):
    text = make_text(5)
    f = tmp_path / "doc.txt"
    f.write_text(text)
    dm = dm_files(tmp_path, [str(f)])  # compact off by default for files
    v = dm.vocab
    assert dm.id_map is None and dm.vocab_size == 50257 and dm.eot_id == EOT_ID
    raw = np.concatenate([dm.train_tokens, dm.val_tokens]).tolist()
    assert raw == gpt2().encode_ordinary(text) + [EOT_ID]
    assert v.to_gpt2(raw).tolist() == raw and v.from_gpt2(raw).tolist() == raw
    with pytest.raises(ValueError, match="50257"):
        v.from_gpt2([50257])


# ---------------------------------------------------------------------------------------
# Windows


def test_train_windows(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(6, 2000))
    T, B, S = 16, 4, 6
    dm = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=S, seed=7)
    train = np.asarray(dm.train_tokens, dtype=np.int64)
    batches = list(dm.train_dataloader())
    assert len(batches) == S
    starts = []
    for x, y in batches:
        assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (B, T)
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            # Find where this window sits in the train split and check y is the next tokens.
            hits = [s for s in range(len(train) - T) if np.array_equal(train[s : s + T], row_x)]
            assert hits
            assert any(np.array_equal(train[s + 1 : s + T + 1], row_y) for s in hits)
            starts.append(hits)
    assert len(starts) == S * B  # exactly max_steps * batch_size windows

    # Offsets: deterministic in the seed, different across seeds, in range, prefix-stable.
    same = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=S, seed=7)
    other = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=S, seed=8)
    longer = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=3 * S, seed=7)
    assert np.array_equal(dm.train_offsets, same.train_offsets)
    assert not np.array_equal(dm.train_offsets, other.train_offsets)
    assert np.array_equal(longer.train_offsets[: S * B], dm.train_offsets)
    assert dm.train_offsets.min() >= 0 and longer.train_offsets.max() <= len(train) - T - 1
    for (x1, y1), (x2, y2) in zip(batches, same.train_dataloader()):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # Each batch is the windows at its offsets.
    for k, (x, _) in enumerate(batches):
        for i in range(B):
            o = dm.train_offsets[k * B + i]
            assert np.array_equal(x[i].numpy(), train[o : o + T])

    # Skipping ahead gives exactly the remaining batches.
    resumed = list(dm.train_dataloader(start_step=2))
    assert len(resumed) == S - 2
    for (x1, y1), (x2, y2) in zip(batches[2:], resumed):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    dm.start_step = 5
    assert len(list(dm.train_dataloader())) == 1
    # Its length stays max_steps: Lightning's restored progress counters hold the rest.
    assert len(dm.train_dataloader()) == S

    # A worker process sees the same data (the memmap is reopened, not pickled).
    dm.num_workers = 1
    x_w, _ = next(iter(dm.train_dataloader(start_step=0)))
    assert torch.equal(x_w, batches[0][0])


def test_train_order_is_a_function_of_seed_and_step(tmp_path):
    """Step k's windows are the k-th batch of one sequential draw from Generator(seed)
    (rank r: its r-th slice of the global batch), whichever way they are computed, and
    the loader resumed at step k serves exactly them."""
    n, T, B, S, W = 5000, 16, 3, 7, 2
    seq = np.random.default_rng(11).integers(0, n - T, size=S * W * B, dtype=np.int64)
    order = TrainOrder(n, T, B, S, seed=11, world_size=W)
    for k in range(S):
        for r in range(W):
            want = seq[(k * W + r) * B : (k * W + r + 1) * B]
            assert np.array_equal(order.batch(k, r), want)
            assert np.array_equal(order.offsets(r)[k * B : (k + 1) * B], want)
    assert not np.array_equal(TrainOrder(n, T, B, S, seed=12).batch(3), order.batch(3))

    f = tmp_path / "doc.txt"
    f.write_text(make_text(9, 2000))
    dm = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=S, seed=11)
    train = np.asarray(dm.train_tokens, dtype=np.int64)
    order = dm.train_order()
    for k in (0, 4, S - 1):
        x, y = next(iter(dm.train_dataloader(start_step=k)))
        starts = order.batch(k)
        assert np.array_equal(x.numpy(), np.stack([train[o : o + T] for o in starts]))
        assert np.array_equal(y.numpy(), np.stack([train[o + 1 : o + T + 1] for o in starts]))


def test_val_windows(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(7, 2000))
    T, B = 16, 3
    for cap in (None, 100):
        dm = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, val_tokens=cap)
        val = np.asarray(dm.val_tokens, dtype=np.int64)
        used = len(val) if cap is None else min(cap, len(val))
        xs, ys = [], []
        for x, y in dm.val_dataloader():
            assert x.shape[1] == T and x.shape[0] <= B
            assert torch.equal(x[:, 1:], y[:, :-1])
            xs.append(x)
            ys.append(y)
        x, y = torch.cat(xs).numpy(), torch.cat(ys).numpy()
        n_windows = (used - 1) // T
        assert len(x) == n_windows
        # Non-overlapping, consecutive, in order: inputs tile val[:n*T], targets val[1:n*T+1].
        assert np.array_equal(x.reshape(-1), val[: n_windows * T])
        assert np.array_equal(y.reshape(-1), val[1 : n_windows * T + 1])
        assert n_windows * T + 1 <= used
        assert np.array_equal(dm.heldout_tokens(20), val[:20])


# ---------------------------------------------------------------------------------------
# Unigram baseline


@pytest.mark.parametrize("compact", [True, False])
def test_unigram_ce_matches_slow_loop(tmp_path, compact):
    f = tmp_path / "doc.txt"
    f.write_text(make_text(8, 600) + "Zyzzyva quixotic xylophone.\n")  # words only the val tail has
    dm = dm_files(tmp_path, [str(f)], block_size=8, compact_vocab=compact, val_tokens=None)
    # The reference works on GPT-2 ids (an uncompacted copy), over all 50257 of them:
    # the compact vocabulary and its "other" entry must not change the number.
    raw = dm_files(tmp_path, [str(f)], block_size=8, compact_vocab=False, val_tokens=None)
    train = [int(t) for t in raw.train_tokens]
    counts = Counter(train)
    assert dm.vocab_size == (len(set(train)) + 1 if compact else 50257)
    targets = [int(t) for _, y in raw.val_dataloader() for t in y.reshape(-1)]
    assert compact is False or any(t not in counts for t in targets)  # the "other" path is exercised
    slow = sum(-math.log((counts[t] + 1) / (len(train) + 50257)) for t in targets) / len(targets)
    assert dm.unigram_ce() == pytest.approx(slow, rel=1e-12)
    assert math.fsum(np.exp(dm.unigram_log_prior())) == pytest.approx(1.0, abs=1e-12)


# ---------------------------------------------------------------------------------------
# FineWeb, jsonl, parquet


FINEWEB_COLUMNS = [
    "text",
    "id",
    "dump",
    "url",
    "date",
    "file_path",
    "language",
    "language_score",
    "token_count",
]


def write_fineweb_parquet(path, texts):
    n = len(texts)
    table = pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i}>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "date": ["2024-02-21T00:00:00Z"] * n,
            "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.9] * n, type=pa.float64()),
            "token_count": pa.array(
                [len(gpt2().encode_ordinary(t)) for t in texts], type=pa.int64()
            ),
        }
    )
    assert table.column_names == FINEWEB_COLUMNS
    pq.write_table(table, path)


def test_fineweb_local_parquet(tmp_path):
    texts = [make_text(10 + i, 120) for i in range(6)]
    (tmp_path / "fw").mkdir()
    write_fineweb_parquet(tmp_path / "fw" / "000.parquet", texts[:3])
    write_fineweb_parquet(tmp_path / "fw" / "001.parquet", texts[3:])
    ref = expected_stream(texts)
    kw = dict(block_size=8, batch_size=2, max_steps=2, cache_dir=tmp_path / "cache", val_fraction=0.05)
    for path in (tmp_path / "fw", str(tmp_path / "fw" / "*.parquet")):
        dm = make_dm("fineweb", path=path, **kw)
        dm.setup()
        assert dm.vocab_size == 50257
        assert len(dm.train_tokens) + len(dm.val_tokens) == len(ref)
        assert full_stream(dm).tolist() == ref
    one = make_dm("fineweb", path=tmp_path / "fw" / "000.parquet", **kw)
    one.setup()
    assert full_stream(one).tolist() == expected_stream(texts[:3])
    capped = make_dm("fineweb", path=tmp_path / "fw", **{**kw, "max_tokens": 300})
    capped.setup()
    assert full_stream(capped).tolist() == ref[:300]
    assert capped.cache.meta["n_tokens"] == 300


class FakeHubStream:
    """Stands in for an endless streaming IterableDataset from the hub."""

    column_names = FINEWEB_COLUMNS

    def __init__(self):
        self.rows = 0

    def iter(self, batch_size):
        i = 0
        while True:
            texts = [make_text(i + j, 50) for j in range(batch_size)]
            i += batch_size
            self.rows += batch_size
            yield {"text": texts, "id": [str(j) for j in range(batch_size)]}


def test_fineweb_hub_stops_at_max_tokens(tmp_path, monkeypatch):
    import datasets

    seen = {}
    stream = FakeHubStream()

    def fake_load_dataset(path, **kw):
        seen.update(kw, path=path)
        return stream

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    dm = make_dm(
        "fineweb", block_size=8, batch_size=2, max_steps=2, max_tokens=5000, cache_dir=tmp_path, val_fraction=0.05
    )
    dm.setup()
    assert seen["path"] == "HuggingFaceFW/fineweb" and seen["name"] == "sample-10BT"
    assert seen["split"] == "train" and seen["streaming"] is True
    assert len(dm.train_tokens) + len(dm.val_tokens) == 5000
    ref: list[int] = []
    doc = 0
    while len(ref) < 5000:
        ref += expected_stream([make_text(doc, 50)])
        doc += 1
    assert full_stream(dm).tolist() == ref[:5000]
    assert stream.rows < 20000  # the endless stream was abandoned
    with pytest.raises(ValueError, match="data.max_tokens: required for data=fineweb"):
        make_dm(
            "fineweb", block_size=8, batch_size=2, max_steps=2, cache_dir=tmp_path, max_tokens=None
        ).setup()


def test_jsonl_and_parquet_files_with_text_column(tmp_path):
    texts = [make_text(20 + i, 80) for i in range(5)]
    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(texts[:3])))
    pqf = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": texts[3:], "n": [1, 2]}), pqf)
    txt = tmp_path / "tail.txt"
    txt.write_text("Exeunt.")
    dm = dm_files(tmp_path, [str(jl), str(pqf), str(txt)], text_column="body")
    assert full_stream(dm).tolist() == expected_stream(texts + ["Exeunt."])

    # Documents come in the order the paths are listed, across file types and .txt runs.
    t = [tmp_path / f"t{i}.txt" for i in range(3)]
    for i, g in enumerate(t):
        g.write_text(f"Act {i}.")
    dm = dm_files(tmp_path, [str(t[2]), str(t[0]), str(jl), str(t[1]), str(txt)], text_column="body",
                  block_size=2)
    assert full_stream(dm).tolist() == expected_stream(["Act 2.", "Act 0."] + texts[:3] + ["Act 1.", "Exeunt."])

    with pytest.raises(ValueError, match=r"data.text_column: column 'text' not in .*docs.jsonl"):
        dm_files(tmp_path, [str(jl)])
    with pytest.raises(ValueError, match=r"data.text_column: column 'text' not in .*docs.parquet"):
        dm_files(tmp_path, [str(pqf)])


def test_text_in_another_encoding(tmp_path):
    """A Latin-1 .txt or .jsonl (Gutenberg texts often are) fails with one line naming the
    file and data.encoding under the UTF-8 default, and reads exactly with
    data.encoding=latin-1; a binary file fails the same way; an unknown codec is refused."""
    text = "Ægypt's señor, naïve café - wherefore? ¶ £5\n" * 6
    lat = tmp_path / "latin.txt"
    lat.write_bytes(text.encode("latin-1"))
    jl = tmp_path / "latin.jsonl"
    jl.write_bytes((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("latin-1"))
    for f in (lat, jl):
        with pytest.raises(ValueError) as e:
            dm_files(tmp_path, [str(f)])
        msg = one_line(e)
        assert msg.startswith("data.encoding: ") and str(f) in msg and "data.encoding=latin-1" in msg
    dm = dm_files(tmp_path, [str(lat), str(jl)], encoding="latin-1")
    assert full_stream(dm).tolist() == expected_stream([text, text])
    assert dm_files(tmp_path, [str(lat)], encoding="ISO-8859-1").cache_path == \
        dm_files(tmp_path, [str(lat)], encoding="latin-1").cache_path  # one codec, one cache
    # In a run of .txt files (one `text` load) the one that fails is named, not its neighbours.
    ok = [tmp_path / "ok1.txt", tmp_path / "ok2.txt"]
    for g in ok:
        g.write_text(text)
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(ok[0]), str(lat), str(ok[1])])
    assert one_line(e).startswith(f"data.encoding: {str(lat)!r} is not utf-8 text (byte 0: ")
    binary = tmp_path / "model.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match=r"^data.encoding: .*model.txt.* is not utf-8 text"):
        dm_files(tmp_path, [str(binary)])
    with pytest.raises(ValueError, match=r"^data.encoding: unknown text encoding 'klingon'"):
        dm_files(tmp_path, [str(lat)], encoding="klingon")


# ---------------------------------------------------------------------------------------
# Errors


def one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_clear_errors(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [missing])
    assert one_line(e).startswith(
        f"data.paths: no file matches '{missing}'"
    ) and "expected" in one_line(e)

    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(tmp_path / "*.txt")])
    assert "data.paths: no file matches" in one_line(e) and "*.txt" in one_line(e)

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(empty)])
    assert "data.paths" in one_line(e) and "empty.txt" in one_line(e) and "is empty" in one_line(e)

    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(csv)])
    assert "data.paths: unsupported file type" in one_line(e) and "x.csv" in one_line(e)

    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, None)
    assert "data.paths: required for data=files" in one_line(e)

    with pytest.raises(ValueError) as e:
        make_dm("wikipedia", block_size=8, batch_size=2, max_steps=1, cache_dir=tmp_path)
    assert "data.source: unknown source 'wikipedia'" in one_line(e) and "shakespeare" in one_line(e)

    with pytest.raises(ValueError) as e:
        make_dm(
            "fineweb",
            path=str(tmp_path / "fw"),
            block_size=8,
            batch_size=2,
            max_steps=1,
            cache_dir=tmp_path,
        ).setup()
    assert "data.path: no file matches" in one_line(e)

    short = tmp_path / "short.txt"
    short.write_text(make_text(30, 200))  # ~ a few hundred tokens
    n = len(gpt2().encode_ordinary(make_text(30, 200))) + 1
    n_val = n - int(n * 0.75)
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(short)], block_size=n_val)
    assert one_line(e).startswith(
        f"data: block_size={n_val} is longer than the val split ({n_val} tokens"
    )
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(short)], block_size=8, val_tokens=5)
    assert (
        "block_size=8 is longer than the val split (5 tokens, capped by data.val_tokens=5)"
        in one_line(e)
    )
    with pytest.raises(ValueError) as e:
        dm_files(tmp_path, [str(short)], block_size=n, val_fraction=0.01)
    assert "longer than the train split" in one_line(e)
    # Exactly block_size + 1 val tokens is enough: one window.
    dm = dm_files(tmp_path, [str(short)], block_size=n_val - 1)
    assert len(dm.val_dataloader()) == 1


def test_ddp_ranks_split_each_global_batch(tmp_path):
    """W ranks at batch B see, step by step, the windows one process at batch W*B sees;
    the resumable loader's state restores the order and refuses a different one."""
    f = tmp_path / "doc.txt"
    f.write_text(make_text(8, 2000))
    T, B, S = 8, 2, 5
    one = dm_files(tmp_path, [str(f)], block_size=T, batch_size=2 * B, max_steps=S, seed=3)
    two = dm_files(tmp_path, [str(f)], block_size=T, batch_size=B, max_steps=S, seed=3)
    whole = [x for x, _ in one.train_dataloader()]
    r0 = [x for x, _ in DataLoader(two.train_dataset(rank=0, world_size=2), batch_size=None)]
    r1 = [x for x, _ in DataLoader(two.train_dataset(rank=1, world_size=2), batch_size=None)]
    assert len(whole) == len(r0) == len(r1) == S
    for k in range(S):
        assert torch.equal(torch.cat([r0[k], r1[k]]), whole[k])
    loader = one.train_dataloader()
    state = {**loader.state_dict(), "step": 3}
    fresh = one.train_dataloader()
    fresh.load_state_dict(state)
    got = [x for x, _ in fresh]
    assert len(got) == S - 3 and all(torch.equal(x, w) for x, w in zip(got, whole[3:]))
    with pytest.raises(ValueError, match="data order differs.*batch_size=4 -> 2"):
        two.train_dataloader().load_state_dict(state)


# ---------------------------------------------------------------------------------------
# One place per default; the old flat data config


def test_each_default_lives_in_its_source_class(tmp_path):
    """data.val_tokens and data.compact_vocab (once 65536 / None in the data module and
    32768 / true in the schema) are written once, in the source's dataclass: the data module
    takes the validated config and no default of its own, the default run's data module has
    the class's values, and no YAML under conf/ restates a source's defaults."""
    import dataclasses
    import inspect

    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir, data_module
    from recdepth.data import sources

    assert list(inspect.signature(TokenDataModule).parameters) == ["data", "block_size", "batch_size", "max_steps",
                                                                    "seed"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["run_dir=/tmp/unused"])
    dm = data_module(cfg, block_size=32)
    fields = {f.name: f.default for f in dataclasses.fields(sources.ShakespeareData)}
    assert type(dm.data) is sources.ShakespeareData
    assert (dm.val_token_cap, dm.data.compact_vocab) == (fields["val_tokens"], fields["compact_vocab"]) == (32768, True)
    # every source: a config naming only its source is its class's defaults, nothing added on the way
    for name in sources.names():
        cls = sources.lookup(name)
        extra = {"paths": ["a.txt"]} if name == "files" else {}
        assert data_config({"source": name, **extra}) == cls(**extra), name
    assert not (Path(conf_dir()) / "data").exists()  # the `data` options are the registered classes


# The flat `data` of a run of `experiment=hops` before the per-source configs, as its
# config.yaml held it: the flat DataConfig's defaults (git show 02e523d:recdepth/config/groups.py),
# conf/data/task.yaml's, experiment=addition's and experiment=hops's values on top.
FLAT_DEFAULTS = dict(source="shakespeare", path=None, paths=None, text_column="text", encoding="utf-8",
                     max_tokens=None, dataset_name="HuggingFaceFW/fineweb", dataset_config="sample-10BT",
                     val_fraction=0.05, val_tokens=32768, compact_vocab=True, cache_dir=None, num_workers=0,
                     task="hops", size=[1, 4], extrapolation=[5, 8], chains=2, distractors=2, layout="shuffled",
                     names=16, nines=0.25, modulus=10, train_records=20000, test_records=256,
                     validation_records=256, extrapolation_records=256, instance_seed=0, loss="all")
FLAT_TASK = {**FLAT_DEFAULTS, "source": "task", "loss": "answers", "val_tokens": None}  # conf/data/task.yaml
FLAT_ADDITION = {**FLAT_TASK, "task": "addition", "size": [1, 6], "extrapolation": [7, 8], "nines": 0.5,
                 "train_records": 40000, "test_records": 64, "validation_records": 64, "extrapolation_records": 64}
FLAT_HOPS = {**FLAT_ADDITION, "task": "hops", "layout": "sorted", "names": 16, "size": [1, 4],
             "extrapolation": [5, 8], "chains": 3, "distractors": 1}
FLAT_MODSUM = {**FLAT_ADDITION, "task": "modsum", "size": [1, 6], "extrapolation": [7, 9], "modulus": 10}


@pytest.mark.parametrize("flat, experiment", [(FLAT_HOPS, "hops"), (FLAT_MODSUM, "modsum"),
                                              (FLAT_ADDITION, "addition")])
def test_an_old_flat_task_config_reads_back_as_today_s(flat, experiment):
    """A run's data config of the flat form (a checkpoint's data_config, a stored
    config.yaml) is upgraded to the nested one (recdepth.data.config.upgrade): the task's
    options move under data.task, other tasks' and the text sources' keys go; it is the
    typed config experiment=<task> composes today, and `load_checkpoint` hands it on so."""
    from dataclasses import asdict

    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import validated
    from recdepth.data.config import is_flat, upgrade

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        now = validated(compose("config", overrides=[f"experiment={experiment}", "run_dir=/tmp/unused"])).data
    up = upgrade(flat)
    assert is_flat(flat) and not is_flat(up) and upgrade(up) == up  # once is enough
    assert up["task"]["name"] == experiment and "chains" not in up and "paths" not in up
    assert data_config(flat) == now and asdict(data_config(flat)) == {**up, "cache_dir": None, "num_workers": 0,
                                                                         "extrapolation_task": {}}
    if experiment == "hops":
        assert up["task"] == {"name": "hops", "size": [1, 4], "extrapolation": [5, 8], "chains": 3, "distractors": 1,
                              "layout": "sorted", "names": 16}
    assert flat["task"] == experiment  # a copy: the input is left as it was
    # a whole stored config of the flat form validates too (a DDP rank's config.yaml)
    stored = asdict(validated(compose_default()))
    assert validated({**stored, "data": flat}).data == now


def compose_default():
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("config", overrides=["run_dir=/tmp/unused"])


@pytest.mark.parametrize("source, extra", [("shakespeare", {}), ("fineweb", {"max_tokens": 300_000_000,
                                                                             "val_fraction": 0.005,
                                                                             "val_tokens": 65536,
                                                                             "compact_vocab": False}),
                                           ("files", {"paths": ["a.txt"], "val_tokens": 65536,
                                                      "compact_vocab": False})])
def test_an_old_flat_text_config_keeps_its_training_identity(source, extra):
    """A text source's flat data config drops the other sources' keys, and its training
    identity's `data` is what the flat schema hashed (its source's keys, DATA_KEYS then):
    the identity of a shakespeare, fineweb or files run does not change."""
    from recdepth.training.runs import what_trains

    flat = {**FLAT_DEFAULTS, "source": source, **extra}
    common = ("source", "max_tokens", "val_fraction", "val_tokens", "compact_vocab")  # DATA_COMMON, less cache_dir
    read = {"shakespeare": common, "fineweb": (*common, "path", "dataset_name", "dataset_config", "text_column"),
            "files": (*common, "paths", "text_column", "encoding")}[source]  # and num_workers
    assert what_trains({"data": flat})["data"] == {k: flat[k] for k in read}
    typed = data_config(flat)
    assert what_trains({"data": asdict_of(typed)})["data"] == {k: flat[k] for k in read}
    # a key of another source at a value the flat schema refused is no key of this source
    with pytest.raises(ValueError) as e:
        data_config({**flat, "modulus": 7})
    assert one_line(e).startswith("data.modulus: no such key in data")


def asdict_of(obj) -> dict:
    from dataclasses import asdict

    return asdict(obj)


# ---------------------------------------------------------------------------------------
# A source is one class (docs/contributing.md, "Add a data source")


def test_a_source_is_one_class_selectable_by_its_name(monkeypatch, tmp_path):
    """A text source defined here as one class (`TextSource` with its name, one option and
    `documents`) is registered, `data=<name>` selects it through Hydra with its own key
    (another source's key is refused), and the data module's token streams are its
    documents' GPT-2 tokens, EOT after each, as tiktoken encodes them."""
    from dataclasses import dataclass, field

    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir, data_module
    from recdepth.config.schema import config_error, register_configs, validated
    from recdepth.data.sources import source as source_module
    from recdepth.data.sources.source import TextSource
    from recdepth.data.token_cache import SourceSpec

    monkeypatch.setattr(source_module, "_REGISTRY", copy.copy(source_module._REGISTRY))

    @dataclass
    class Generated(TextSource):
        source: str = "generated"
        documents_n: int = 6
        """How many generated documents (>= 1)."""
        compact_vocab: bool = field(default=False)

        def __post_init__(self):
            super().__post_init__()
            if isinstance(self.documents_n, bool) or not isinstance(self.documents_n, int) or self.documents_n < 1:
                raise ValueError(f"data.documents_n: expected an integer >= 1, got {self.documents_n!r}")

        def documents(self, hf_cache=None):
            texts = [make_text(100 + i) for i in range(self.documents_n)]
            return SourceSpec(self.source, {"documents_n": self.documents_n}, "generated-v1", lambda: iter(texts),
                              self.max_tokens)

    register_configs()  # what each command does before it composes (recdepth/cli/runner.py)
    over = ["data=generated", "data.documents_n=4", f"data.cache_dir={tmp_path}", "run_dir=/tmp/unused"]
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        run = validated(compose("config", overrides=over))
        with pytest.raises(Exception) as e:
            compose("config", overrides=["data=generated", "data.modulus=7", "run_dir=/tmp/unused"])
        bad = compose("config", overrides=["data=generated", "data.documents_n=0", "run_dir=/tmp/unused"])
    assert type(run.data) is Generated and run.data.documents_n == 4
    assert config_error(e.value).startswith("data.modulus: no such key in data")
    with pytest.raises(ValueError, match=r"^data\.documents_n: expected an integer >= 1, got 0$"):
        validated(bad)
    dm = data_module(run, block_size=16)
    dm.setup()
    stream = np.concatenate([dm.train_tokens, dm.val_tokens]).tolist()
    assert stream == expected_stream([make_text(100 + i) for i in range(4)])
    assert 0 < len(dm.val_tokens) <= 0.06 * len(stream)  # the default val_fraction's tail
