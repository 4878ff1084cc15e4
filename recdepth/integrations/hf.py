"""Huginn checkpoints in the Hugging Face format: read and write (docs/spec.md §1b).

The directory Hugging Face's `save_pretrained` writes for seal-rg/recurrent-pretraining's
`RavenForCausalLM` (Huginn-0125 on the Hub, model_type "huginn_raven"):

    config.json                             RavenConfig's keys
    model.safetensors                       every tensor, or N shards
    model-00001-of-0000N.safetensors ...    with
    model.safetensors.index.json            {"metadata": {"total_size": bytes},
                                             "weight_map": {tensor name: shard file}}

`load_hf(dir)` returns the `LoopedGPT` with Huginn's options (rope, gated SiLU MLP, q/k
bias, embedding scale, latent norm, no logit bias; groups [[p .. p + c − 1]] for p prelude
and c core layers) and the weights mapped onto recdepth's names; `save_hf(model, dir)`
writes the same format. The parameter names and the config keys: docs/huginn.md; the
numerics they pin: docs/spec.md §1b. No network and no `transformers`: JSON and `safetensors` only.

A key missing from config.json takes RavenConfig's default (recpre/raven_config_minimal.py),
as `transformers` would; a value recdepth's model cannot reproduce (a bias, grouped-query
attention, an untied head, another MLP/norm/block class) is refused. Every refusal is a
ValueError of one line naming the file, the key and what was expected.

config.json may carry a `recdepth` block with what RavenConfig has no key for (the real
vocabulary size under the padded embedding, the shared "other" entry, the initial state);
`save_hf` writes it, `transformers` ignores it, and `load_hf` reads it when present.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from recdepth.model.looped import GPTConfig, LoopedGPT, rope_angles

MODEL_TYPE = "huginn_raven"
CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# RavenConfig's defaults (recpre/raven_config_minimal.py: RavenConfig.__init__), taken by
# a key config.json leaves out.
RAVEN_DEFAULTS: dict[str, object] = dict(
    n_embd=5280, n_heads=55, block_size=4096, vocab_size=65536, padding_multiple=4096, tie_embeddings=True,
    intermediate_size=17920, bias=False, architecture_class_name="RecurrentGPT", block_class_name="SandwichBlock",
    norm_class_name="RMSNorm_llama", norm_eps=1e-6, mlp_class_name="GatedMLP", nonlin_name="SiLU",
    state_init="like-init", injection_type="linear", n_layers_in_recurrent_block=4, mean_recurrence=32,
    n_layers_in_prelude=2, n_layers_in_coda=2, qk_bias=True, rope_base=50000.0, test_time_noise=0,
)
# Keys whose value is the only one recdepth's model computes (anything else is refused).
FIXED = ("tie_embeddings", "bias", "architecture_class_name", "block_class_name", "norm_class_name",
         "mlp_class_name", "nonlin_name", "state_init", "injection_type", "test_time_noise")
# Aliases (RavenConfig.attribute_map): config.json may spell a key either way.
# tie_word_embeddings is the name PretrainedConfig writes for what RavenConfig passes it;
# it is read, never written: RavenConfig.__init__ passes tie_word_embeddings=tie_embeddings
# to PretrainedConfig beside **kwargs, so a config.json holding both fails to load there.
ALIASES = {"n_heads": "num_attention_heads", "n_embd": "hidden_size", "n_layers": "num_hidden_layers",
           "tie_embeddings": "tie_word_embeddings"}
# Tensors a file may hold besides the weights: the tied head (== wte) and the rope table.
OPTIONAL = ("lm_head.weight", "freqs_cis")
# One layer: Huginn's SandwichBlock names -> recdepth's Block names.
BLOCK = (("norm_1.weight", "norm1.weight"), ("norm_2.weight", "norm2.weight"), ("norm_3.weight", "norm3.weight"),
         ("norm_4.weight", "norm4.weight"), ("attn.Wqkv.weight", "attn.qkv.weight"),
         ("attn.qk_bias", "attn.qk_bias"), ("attn.proj.weight", "attn.proj.weight"),
         ("mlp.fc.weight", "mlp.fc.weight"), ("mlp.proj.weight", "mlp.proj.weight"))
ADAPTER = "transformer.adapter.weight"
ADAPTER_HALVES = ("adapters.0.state.weight", "adapters.0.input.weight")  # ours: Huginn's adapter split


# ------------------------------------------------------------------ names
def layer_names(cfg: GPTConfig) -> list[tuple[str, int]]:
    """(Huginn prefix, recdepth layer index) of every layer: transformer.prelude.{i},
    transformer.core_block.{j}, transformer.coda.{k}, for a model with one recurrence group."""
    if len(cfg.groups) != 1:
        raise ValueError(f"model.groups: a Huginn checkpoint has exactly one recurrence group (prelude / core / "
                         f"coda), got {cfg.groups}")
    g = cfg.groups[0]
    return ([(f"transformer.prelude.{i}", i) for i in range(g[0])]
            + [(f"transformer.core_block.{j}", layer) for j, layer in enumerate(g)]
            + [(f"transformer.coda.{k}", layer) for k, layer in enumerate(range(g[-1] + 1, cfg.n_layer))])


def name_map(cfg: GPTConfig) -> dict[str, str]:
    """Huginn tensor name -> recdepth parameter name, for every tensor but the adapter
    (Huginn's one Linear(2d -> d) is recdepth's two halves, adapters.0.state | adapters.0.input)."""
    out = {"transformer.wte.weight": "wte.weight", "transformer.ln_f.weight": "ln_f.weight"}
    for prefix, layer in layer_names(cfg):
        for hf, ours in BLOCK:
            if hf != "attn.qk_bias" or cfg.qk_bias:
                out[f"{prefix}.{hf}"] = f"h.{layer}.{ours}"
    return out


def freqs_cis(cfg: GPTConfig) -> Tensor:
    """Huginn's rope buffer `freqs_cis` [1, block_size, 1, head_dim/2, 2] (cos, sin) in
    float32, from recdepth's `rope_angles` (Huginn: precompute_freqs_cis)."""
    theta = rope_angles(torch.arange(cfg.block_size), cfg.head_dim, cfg.rope_base)
    return torch.stack([theta.cos(), theta.sin()], dim=-1)[None, :, None]


def to_hf(model: LoopedGPT, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The model's weights under Huginn's names (contiguous CPU copies, in `dtype` or their
    own), with the rope table `freqs_cis`; the tied head is left out, as
    `save_pretrained` leaves it."""
    cfg, sd = model.cfg, model.state_dict()
    names = name_map(cfg)
    unmapped = sorted(set(sd) - set(names.values()) - set(ADAPTER_HALVES))
    if unmapped:  # a parameter with no Huginn name would be dropped, and load_hf would then miss it
        raise ValueError(f"save_hf: parameter {unmapped[0]!r} has no Huginn name (add it to name_map in "
                         f"recdepth/integrations/hf.py; {len(unmapped)} unmapped: {', '.join(unmapped)})")
    out = {hf: sd[ours] for hf, ours in names.items()}
    out[ADAPTER] = model.adapters[0].weight()
    out = {k: v.detach().to("cpu", dtype or v.dtype).contiguous().clone() for k, v in out.items()}
    out["freqs_cis"] = freqs_cis(cfg)
    return out


def from_hf(cfg: GPTConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """recdepth's state dict from tensors under Huginn's names (the adapter split into its
    state and input halves: Huginn's adapter reads cat([state, input embeddings]))."""
    sd = {ours: tensors[hf] for hf, ours in name_map(cfg).items()}
    state, inp = tensors[ADAPTER].split(cfg.n_embd, dim=1)
    sd[ADAPTER_HALVES[0]], sd[ADAPTER_HALVES[1]] = state.contiguous(), inp.contiguous()
    return sd


def hf_shapes(model: LoopedGPT) -> dict[str, tuple[int, ...]]:
    """The shape every Huginn tensor must have for this model (a meta model will do)."""
    sd, d = model.state_dict(), model.cfg.n_embd
    out = {hf: tuple(sd[ours].shape) for hf, ours in name_map(model.cfg).items()}
    out[ADAPTER] = (d, 2 * d)
    return out


# ------------------------------------------------------------------ config
class _Keys:
    """config.json's values, read with RavenConfig's defaults and one-line errors."""

    def __init__(self, raw: dict, where: Path):
        self.raw, self.where, self.defaulted = raw, where, []

    def fail(self, key: str, msg: str):
        raise ValueError(f"{self.where}: {key}: {msg}")

    def get(self, key: str):
        names = [key] + ([ALIASES[key]] if key in ALIASES else [])
        given = [(n, self.raw[n]) for n in names if n in self.raw]
        if len({json.dumps(v) for _, v in given}) > 1:
            self.fail(key, f"{given[0][0]}={given[0][1]!r} and {given[1][0]}={given[1][1]!r} disagree")
        if given:
            return given[0][1]
        self.defaulted.append(key)
        return RAVEN_DEFAULTS[key]

    def int(self, key: str, lo: int) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            self.fail(key, f"expected an integer >= {lo}, got {v!r}")
        return v

    def number(self, key: str) -> float:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            self.fail(key, f"expected a finite number > 0, got {v!r}")
        return float(v)

    def bool(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            self.fail(key, f"expected true or false, got {v!r}")
        return v


def read_config(path: str | Path) -> tuple[GPTConfig, dict, list[str]]:
    """(GPTConfig, config.json as read, the keys that took RavenConfig's defaults) of a
    Huginn checkpoint directory."""
    d = Path(path)
    f = d / CONFIG
    if not f.is_file():
        raise ValueError(f"{f}: missing (expected a Hugging Face checkpoint directory with config.json)")
    raw = _json(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{f}: model_type: expected {MODEL_TYPE!r} (Huginn's RavenConfig), "
                         f"got {raw.get('model_type')!r}")
    k = _Keys(raw, f)
    for key in FIXED:
        v, want = k.get(key), RAVEN_DEFAULTS[key]
        if v != want or isinstance(want, bool) != isinstance(v, bool):  # 0 is not false here
            k.fail(key, f"unsupported value {v!r} (recdepth's model has {want!r} only)")
    heads, d_model = k.int("n_heads", 1), k.int("n_embd", 1)
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] != heads:
        k.fail("num_key_value_heads", f"expected {heads} (= n_heads; grouped-query attention is not supported), "
                                      f"got {raw['num_key_value_heads']!r}")
    p, c, co = (k.int("n_layers_in_prelude", 0), k.int("n_layers_in_recurrent_block", 1),
                k.int("n_layers_in_coda", 0))
    if "n_layers" in raw or "num_hidden_layers" in raw:
        n = k.int("n_layers", 1)
        if n != p + c + co:
            k.fail("n_layers", f"expected n_layers_in_prelude + n_layers_in_recurrent_block + n_layers_in_coda "
                               f"= {p + c + co}, got {n}")
    vocab, multiple = k.int("vocab_size", 1), k.int("padding_multiple", 1)
    ours = dict(vocab_size=vocab, pad_vocab_multiple=multiple if vocab % multiple == 0 else 1, n_other=0,
                state_init="normal", state_std=math.sqrt(2 / 5))
    extra = raw.get("recdepth", {})
    if not isinstance(extra, dict) or set(extra) - set(ours):
        k.fail("recdepth", f"expected an object with keys among {', '.join(ours)}, got {extra!r}")
    ours.update(extra)
    try:
        cfg = GPTConfig(
            n_layer=p + c + co, n_head=heads, n_embd=d_model, block_size=k.int("block_size", 1),
            groups=[list(range(p, p + c))], mean_recurrence=float(k.number("mean_recurrence")), logit_bias=False,
            position="rope", rope_base=k.number("rope_base"), mlp="gated_silu",
            intermediate_size=k.int("intermediate_size", 1), qk_bias=k.bool("qk_bias"), scale_embeddings=True,
            latent_norm=True, norm_eps=k.number("norm_eps"), **ours)
    except ValueError as e:  # GPTConfig's own one-line check, e.g. model.n_embd not divisible by model.n_head
        raise ValueError(f"{f}: {e}") from None
    if cfg.padded_vocab_size != vocab:
        k.fail("recdepth", f"vocab_size {cfg.vocab_size} padded to a multiple of {cfg.pad_vocab_multiple} is "
                           f"{cfg.padded_vocab_size}, expected vocab_size = {vocab} embedding rows")
    return cfg, raw, k.defaulted


def raven_config(cfg: GPTConfig, dtype: torch.dtype) -> dict:
    """config.json for a model with Huginn's options: RavenConfig's keys, plus the
    `recdepth` block (what RavenConfig has no key for)."""
    mr = cfg.mean_recurrence
    p, c = cfg.groups[0][0], len(cfg.groups[0])
    return {
        "architectures": ["RavenForCausalLM"], "model_type": MODEL_TYPE,
        "n_embd": cfg.n_embd, "n_heads": cfg.n_head, "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_head, "n_layers": cfg.n_layer, "block_size": cfg.block_size,
        "vocab_size": cfg.padded_vocab_size, "padding_multiple": cfg.pad_vocab_multiple, "tie_embeddings": True,
        "intermediate_size": cfg.mlp_hidden, "bias": False, "architecture_class_name": "RecurrentGPT",
        "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "norm_eps": cfg.norm_eps,
        "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "init_strategy": "takase", "state_init": "like-init",
        "injection_type": "linear", "n_layers_in_prelude": p, "n_layers_in_recurrent_block": c,
        "n_layers_in_coda": cfg.n_layer - p - c, "mean_recurrence": int(mr) if float(mr).is_integer() else mr,
        "qk_bias": cfg.qk_bias, "rope_base": cfg.rope_base, "torch_dtype": str(dtype).removeprefix("torch."),
        "recdepth": {"vocab_size": cfg.vocab_size, "pad_vocab_multiple": cfg.pad_vocab_multiple,
                     "n_other": cfg.n_other, "state_init": cfg.state_init, "state_std": cfg.state_std},
    }


def check_saveable(cfg: GPTConfig) -> None:
    """Refuse, in one line, a model whose architecture Huginn's RavenForCausalLM cannot express."""
    layer_names(cfg)  # exactly one recurrence group
    want = dict(position="rope", mlp="gated_silu", scale_embeddings=True, latent_norm=True, logit_bias=False,
                attention_window=None, halt_head=None)  # halt_head: a halting head (docs/spec.md §1d)
    for key, v in want.items():
        if getattr(cfg, key) != v:
            raise ValueError(f"save_hf: model.{key}: {getattr(cfg, key)!r} has no counterpart in Huginn's "
                             f"RavenForCausalLM (expected {v!r})")


# ------------------------------------------------------------------ files
def _json(f: Path):
    try:
        return json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not readable JSON ({str(e).splitlines()[0]})") from None


def weight_files(path: str | Path) -> tuple[dict[str, Path], Path]:
    """Tensor name -> the file holding it, and the file that lists them (model.safetensors,
    or model.safetensors.index.json with its weight_map over any number of shards)."""
    d = Path(path)
    if (d / SINGLE).is_file():
        return {name: d / SINGLE for name in _keys(d / SINGLE)}, d / SINGLE
    index = d / INDEX
    if not index.is_file():
        raise ValueError(f"{d / SINGLE}: missing, and no {INDEX} either (expected the weights beside {CONFIG})")
    raw = _json(index)
    wmap = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ValueError(f"{index}: weight_map: missing or empty (expected {{tensor name: shard file}})")
    out = {}
    for name, shard in wmap.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index}: weight_map[{name!r}]: expected a file name in this directory, got {shard!r}")
        if not (d / shard).is_file():
            raise ValueError(f"{index}: weight_map[{name!r}]: shard file {shard} does not exist")
        out[name] = d / shard
    return out, index


def _keys(f: Path) -> list[str]:
    try:
        with safe_open(f, framework="pt") as h:
            return list(h.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None


def _read(files: dict[str, Path], listing: Path, expected: dict[str, tuple[int, ...]],
          dtype: torch.dtype) -> tuple[dict[str, Tensor], list[str]]:
    """Every expected tensor (shape-checked before it is read, then cast to dtype) and the
    optional ones present, shard by shard."""
    for name, shape in expected.items():
        if name not in files:
            raise ValueError(f"{listing}: {name}: missing (expected a tensor of shape {list(shape)})")
    for name in files:
        if name not in expected and name not in OPTIONAL:
            raise ValueError(f"{files[name]}: {name}: unexpected tensor (not in a {MODEL_TYPE} model of this "
                             f"{CONFIG})")
    by_file: dict[Path, list[str]] = {}
    for name, f in files.items():
        by_file.setdefault(f, []).append(name)
    out, optional = {}, []
    for f, names in by_file.items():
        try:
            with safe_open(f, framework="pt") as h:
                present = set(h.keys())
                for name in names:
                    if name not in present:
                        raise ValueError(f"{f}: {name}: missing ({listing.name} lists it in this file)")
                    got = tuple(h.get_slice(name).get_shape())
                    if name in expected and got != expected[name]:
                        raise ValueError(f"{f}: {name}: expected shape {list(expected[name])}, got {list(got)}")
                    t = h.get_tensor(name)
                    if name in expected:
                        out[name] = t.to(dtype)
                    else:
                        out[name] = t
                        optional.append(name)
        except SafetensorError as e:
            raise ValueError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    return out, optional


def _check_optional(cfg: GPTConfig, files: dict[str, Path], tensors: dict[str, Tensor]) -> None:
    """lm_head.weight, if present, is the tied embedding; freqs_cis, if present, is the
    rope table of this config.json (bfloat16 storage allowed: within 1e-2)."""
    if "lm_head.weight" in tensors:
        head, wte = tensors["lm_head.weight"], tensors["transformer.wte.weight"]
        if head.shape != wte.shape or not torch.equal(head.to(wte.dtype), wte):
            raise ValueError(f"{files['lm_head.weight']}: lm_head.weight: expected the tied embedding "
                             f"(= transformer.wte.weight, shape {list(wte.shape)}); an untied head is not supported")
    if "freqs_cis" in tensors:
        ref, got = freqs_cis(cfg), tensors["freqs_cis"]
        if tuple(got.shape) != tuple(ref.shape):
            raise ValueError(f"{files['freqs_cis']}: freqs_cis: expected shape {list(ref.shape)}, "
                             f"got {list(got.shape)}")
        err = (got.float() - ref).abs().max().item()
        if not err <= 1e-2:
            raise ValueError(f"{files['freqs_cis']}: freqs_cis: differs from the rope table of rope_base="
                             f"{cfg.rope_base:g} by up to {err:.3g} (expected the table config.json describes)")


# ------------------------------------------------------------------ API
def load_hf(path: str | Path, device: str | torch.device = "cpu",
            dtype: torch.dtype = torch.float32) -> tuple[LoopedGPT, dict]:
    """A Huginn checkpoint directory as a LoopedGPT (in eval mode, on `device`, parameters
    in `dtype`) and an info dict: path, files, config (config.json as read), defaulted
    (keys that took RavenConfig's defaults), optional (lm_head.weight / freqs_cis found and
    checked), params, stored_dtype (config.json's torch_dtype)."""
    d = Path(path)
    cfg, raw, defaulted = read_config(d)
    with torch.device("meta"):  # no init work for weights about to be replaced
        model = LoopedGPT(cfg)
    files, listing = weight_files(d)
    tensors, optional = _read(files, listing, hf_shapes(model), dtype)
    _check_optional(cfg, files, tensors)
    sd = from_hf(cfg, tensors)
    missing, unexpected = sorted(set(model.state_dict()) - set(sd)), sorted(set(sd) - set(model.state_dict()))
    if missing or unexpected:  # the mapping and the model disagree (a parameter added to one of them)
        what = "; ".join(f"{k} {', '.join(v)}" for k, v in (("missing", missing), ("unexpected", unexpected)) if v)
        raise ValueError(f"{d}: load_hf: the mapped tensors and the model disagree ({what}; "
                         "name_map in recdepth/integrations/hf.py)")
    model.load_state_dict(sd, strict=True, assign=True)
    model = model.to(device).eval()
    info = {"path": str(d), "files": sorted({f.name for f in files.values()}), "config": raw,
            "defaulted": defaulted, "optional": sorted(optional), "params": model.num_params(),
            "stored_dtype": raw.get("torch_dtype")}
    return model, info


def save_hf(model: LoopedGPT, path: str | Path, max_shard_bytes: int = 5 * 2**30, dtype: torch.dtype | None = None,
            overwrite: bool = False) -> dict:
    """Write `model` as a Huginn checkpoint directory: config.json (RavenConfig's keys and
    the `recdepth` block), the tensors under Huginn's names in `dtype` (default: the
    model's) as model.safetensors, or, past `max_shard_bytes`, shards
    model-0000i-of-0000N.safetensors with model.safetensors.index.json. A directory
    already holding a checkpoint is refused unless `overwrite`, which first removes its
    config.json and weight files. Returns {"files": [...], "total_size": bytes}."""
    cfg = model.cfg
    check_saveable(cfg)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"save_hf: max_shard_bytes: expected a positive integer, got {max_shard_bytes!r}")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    old = sorted((f for f in d.iterdir() if f.name in (CONFIG, SINGLE, INDEX) or SHARD.fullmatch(f.name)),
                 key=lambda f: (f.name != CONFIG, f.name))  # the message names config.json first
    if old and not overwrite:
        raise ValueError(f"{old[0]}: exists (the directory already holds a checkpoint; overwrite=True replaces it)")
    for f in old:
        f.unlink()
    tensors = to_hf(model, dtype)
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # in order, a new shard when the next tensor would not fit
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    meta = {"format": "pt"}  # what transformers requires of a safetensors file
    if len(shards) == 1:
        save_file(shards[0], d / SINGLE, metadata=meta)
        files = [SINGLE]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for f, s in zip(files, shards):
            save_file(s, d / f, metadata=meta)
        wmap = {name: f for f, s in zip(files, shards) for name in s}
        (d / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2) + "\n")
        files.append(INDEX)
    w_dtype = dtype or next(model.parameters()).dtype
    (d / CONFIG).write_text(json.dumps(raven_config(cfg, w_dtype), indent=2) + "\n")
    return {"files": [CONFIG, *files], "total_size": total}


# ------------------------------------------------------------------------- text
class HFTokenizer:
    """A checkpoint directory's `tokenizer.json` (the `tokenizers` library), with the
    end-of-document id and the beginning-of-sequence id named by its `tokenizer_config.json`
    (`eos_token`, `bos_token`; `transformers`' eos_token_id and bos_token_id), if any."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        d = Path(directory)
        f = d / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"hf: {d} has no tokenizer.json (give prompt_ids=[...] to generate "
                                    "without it; evaluation needs it to tokenize data)")
        try:
            self.tok = Tokenizer.from_file(str(f))
        except Exception as e:  # the Rust side raises its own exception types
            raise ValueError(f"hf: {f} is not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.eos_id = self.bos_id = None
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            special = json.loads(cfg.read_text())
            self.eos_id, self.bos_id = (self._special_id(special.get(key)) for key in ("eos_token", "bos_token"))

    def _special_id(self, token) -> int | None:
        """The id of a special token as tokenizer_config.json names it (a string or an
        AddedToken dict with "content"); None if it is not named or not in the vocabulary."""
        if isinstance(token, dict):
            token = token.get("content")
        return self.tok.token_to_id(token) if isinstance(token, str) else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def stream(self, docs) -> np.ndarray:
        """The token stream of documents: each one's ids followed by the end-of-document id
        (when the tokenizer names one), as one int64 array."""
        parts = []
        docs = iter(docs)
        while batch := list(itertools.islice(docs, 256)):
            for enc in self.tok.encode_batch(batch, add_special_tokens=False):
                parts.append(np.asarray(enc.ids + ([] if self.eos_id is None else [self.eos_id]), dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
