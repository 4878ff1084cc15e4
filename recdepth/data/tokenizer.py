"""GPT-2 BPE through tiktoken, offline.

`tiktoken.get_encoding("gpt2")` downloads its vocabulary on first use, which fails on a
machine without internet. recdepth ships the exact GPT-2 ranks file (the one tiktoken
calls r50k_base, taken from the `openai-whisper` sdist: `whisper/assets/gpt2.tiktoken`),
xz-compressed, and builds the same `tiktoken.Encoding` from it. The sha256 of the
decompressed file is checked against the hash tiktoken itself pins for r50k_base, so a
damaged asset fails loudly instead of tokenizing wrongly.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import lzma
from importlib import resources

import tiktoken

# The hash tiktoken pins for r50k_base.tiktoken (tiktoken_ext/openai_public.py).
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# GPT-2's pre-tokenisation regex, as tiktoken defines it for gpt2 / r50k_base.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257


def _ranks_bytes() -> bytes:
    blob = resources.files("recdepth").joinpath("assets", "gpt2.tiktoken.xz").read_bytes()
    raw = lzma.decompress(blob)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != GPT2_RANKS_SHA256:
        raise RuntimeError(
            f"recdepth/assets/gpt2.tiktoken.xz: sha256 {digest} does not match GPT-2's ranks "
            f"{GPT2_RANKS_SHA256}; reinstall recdepth"
        )
    return raw


def parse_ranks(raw: bytes) -> dict[bytes, int]:
    """Parse a `.tiktoken` file: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=1)
def gpt2() -> tiktoken.Encoding:
    """The GPT-2 BPE `tiktoken.Encoding`, built offline from the shipped ranks file."""
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=parse_ranks(_ranks_bytes()),
        special_tokens={EOT_TOKEN: EOT_ID},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def tokenizer_id() -> str:
    """A short identity of the tokenizer, part of every token-cache key."""
    return f"gpt2-{GPT2_RANKS_SHA256[:16]}"
