"""The offline GPT-2 tokenizer: known answers, and identity with tiktoken's own encodings."""

import hashlib
import lzma
from importlib import resources

import pytest
import tiktoken

from recdepth.data.tokenizer import GPT2_RANKS_SHA256, gpt2


def test_known_answers():
    enc = gpt2()
    # Published GPT-2 ids (e.g. the HF gpt2 tokenizer docs): "Hello world!" -> 15496, 995, 0.
    assert enc.encode("Hello world!") == [15496, 995, 0]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler…"
    assert enc.decode(enc.encode(text)) == text


def _shipped_ranks() -> bytes:
    blob = resources.files("recdepth").joinpath("assets", "gpt2.tiktoken.xz").read_bytes()
    return lzma.decompress(blob)


def test_shipped_ranks_are_r50k_base():
    assert hashlib.sha256(_shipped_ranks()).hexdigest() == GPT2_RANKS_SHA256


def test_identical_to_tiktoken_r50k_base(tmp_path, monkeypatch):
    """tiktoken builds r50k_base (GPT-2's ranks) with its own pattern and special tokens,
    and checks the file's hash itself; we feed its download cache our shipped file."""
    url = "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken"
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(_shipped_ranks())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    ref = tiktoken.get_encoding("r50k_base")
    ours = gpt2()
    assert ref._pat_str == ours._pat_str
    texts = [
        "Hello world!", "  leading spaces\tand\ttabs\n\n\nnewlines ", "numbers 1234567 3.14159",
        "unicode: naïve café 東京 😀", "'s 't 're 've 'm 'll 'd contractions", "x" * 300,
    ]
    from recdepth.data.sources.shakespeare import iter_shakespeare

    texts.append(next(iter(iter_shakespeare()))[:20000])
    for t in texts:
        assert ours.encode_ordinary(t) == ref.encode_ordinary(t)
    assert ours.encode("a<|endoftext|>b", allowed_special="all") == ref.encode(
        "a<|endoftext|>b", allowed_special="all")


def test_identical_to_tiktoken_gpt2_when_loadable():
    try:
        ref = tiktoken.get_encoding("gpt2")
    except Exception as exc:  # offline: tiktoken downloads gpt2's vocab.bpe/encoder.json
        pytest.skip(reason=f"tiktoken.get_encoding('gpt2') cannot be loaded here ({type(exc).__name__}); "
                           "r50k_base identity is tested above")
    text = "Hello world! " * 10 + "The quick brown fox."
    assert gpt2().encode_ordinary(text) == ref.encode_ordinary(text)


def test_no_network_needed(monkeypatch):
    import socket

    def deny(*a, **k):
        raise OSError("network disabled in test")

    monkeypatch.setattr(socket, "create_connection", deny)
    monkeypatch.setattr(socket.socket, "connect", deny)
    gpt2.cache_clear()
    assert gpt2().encode("Hello world!") == [15496, 995, 0]
