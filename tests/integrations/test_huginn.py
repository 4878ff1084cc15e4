"""Huginn's architecture as options of recdepth's model, and Huginn checkpoints in the
Hugging Face format (docs/spec.md §1b; issue 13).

The reference forward below is written here from seal-rg/recurrent-pretraining's
equations (recpre/raven_modeling_minimal.py), over tensors under Huginn's own names, and
shares no code with recdepth/model/looped.py or recdepth/integrations/hf.py. The checkpoint directories are
written here by hand (a config.json dict, safetensors.torch.save_file)."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.flop_counter import FlopCounterMode

from recdepth import exits
from recdepth.decode.engine import RowNoise
from recdepth.integrations.hf import load_hf, save_hf
from recdepth.model.looped import GPTConfig, LoopedGPT, apply_rope, rope_angles
from tests.decode.helpers import decode_all

# A tiny Huginn: prelude 1, core 2, coda 2 layers; d = 32, 4 heads of 8; gated MLP width 48.
D, HEADS, HD, INTER, P, C, K, V, BLOCK = 32, 4, 8, 48, 1, 2, 2, 100, 16
RAVEN = {  # config.json as Hugging Face writes RavenConfig (recpre/raven_config_minimal.json's keys)
    "architectures": ["RavenForCausalLM"], "model_type": "huginn_raven",
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig",
                 "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM"},
    "torch_dtype": "float64", "block_size": BLOCK, "vocab_size": V, "padding_multiple": 4096,
    "tie_embeddings": True, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "n_embd": D,
    "intermediate_size": INTER, "bias": False, "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock", "norm_class_name": "RMSNorm_llama", "norm_eps": 1e-5,
    "mlp_class_name": "GatedMLP", "nonlin_name": "SiLU", "init_strategy": "takase", "init_orthogonal": False,
    "state_init": "like-init", "injection_type": "linear", "n_layers_in_recurrent_block": C,
    "mean_recurrence": 4, "sampling_scheme": "poisson-lognormal-filling", "mean_backprop_depth": 2,
    "n_layers_in_prelude": P, "n_layers_in_coda": K, "qk_bias": True, "rope_base": 500.0,
}
PREFIXES = ([f"transformer.prelude.{i}" for i in range(P)] + [f"transformer.core_block.{j}" for j in range(C)]
            + [f"transformer.coda.{k}" for k in range(K)])


def raven_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 weights under Huginn's names, at scales that keep activations O(1);
    norm weights and q/k biases away from their init, so a swapped name would show."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=None):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * (scale or shape[-1] ** -0.5)

    t = {"transformer.wte.weight": w(V, D, scale=0.2), "transformer.adapter.weight": w(D, 2 * D),
         "transformer.ln_f.weight": 1 + w(D, scale=0.2)}
    for pre in PREFIXES:
        for n in ("norm_1", "norm_2", "norm_3", "norm_4"):
            t[f"{pre}.{n}.weight"] = 1 + w(D, scale=0.2)
        t[f"{pre}.attn.Wqkv.weight"] = w(3 * D, D)
        t[f"{pre}.attn.qk_bias"] = w(2, 1, HEADS, HD, scale=0.5)
        t[f"{pre}.attn.proj.weight"] = w(D, D)
        t[f"{pre}.mlp.fc.weight"] = w(2 * INTER, D)
        t[f"{pre}.mlp.proj.weight"] = w(D, INTER)
    return t


def raven_forward(t: dict, idx: torch.Tensor, n: int, s0: torch.Tensor, cfg: dict = RAVEN, variant: str = "") -> torch.Tensor:
    """Huginn's forward from the reference's equations (recpre/raven_modeling_minimal.py):
    embeddings · sqrt(d); prelude; s <- core(adapter(cat[s, e])) n times; ln_f; coda; ln_f;
    tied head. Attention: fused Wqkv -> q, k, v; q/k bias; complex RoPE on adjacent pairs
    (float32 table, as precompute_freqs_cis); causal softmax. `variant` breaks one pinned
    detail, to show the comparison would notice it."""
    d, H, eps = cfg["n_embd"], cfg["num_attention_heads"], cfg["norm_eps"]
    hd, inter = d // H, cfg["intermediate_size"]
    B, T = idx.shape
    inv = 1.0 / (cfg["rope_base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    # e^{iθ} [T, hd/2] from the float32 cos and sin of precompute_freqs_cis (torch.polar in
    # float32 rounds differently in the last bit), multiplied in complex128
    rot = torch.complex(angles.cos().double(), angles.sin().double())

    def rms(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * wt

    def rope(x):  # x [B, T, H, hd]
        if variant == "rope_halves":  # GPT-NeoX pairing (i, i + hd/2): not Huginn's
            z = torch.complex(x[..., : hd // 2], x[..., hd // 2 :]) * rot[None, :, None]
            return torch.cat([z.real, z.imag], -1)
        z = torch.view_as_complex(x.reshape(B, T, H, hd // 2, 2).contiguous()) * rot[None, :, None]
        return torch.view_as_real(z).reshape(B, T, H, hd)

    def attention(x, pre):
        q, k, v = (x @ t[f"{pre}.attn.Wqkv.weight"].T).split(d, -1)
        q, k, v = (z.reshape(B, T, H, hd) for z in (q, k, v))
        bias = t[f"{pre}.attn.qk_bias"]
        if variant != "bias_after_rope":
            q, k = q + bias[0], k + bias[1]
        q, k = rope(q), rope(k)
        if variant == "bias_after_rope":
            q, k = q + bias[0], k + bias[1]
        scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(B, T, d)
        return y @ t[f"{pre}.attn.proj.weight"].T

    def mlp(x, pre):
        h = x @ t[f"{pre}.mlp.fc.weight"].T
        gate, up = h[..., :inter], h[..., inter:]
        if variant == "mlp_halves_swapped":
            gate, up = up, gate
        return (F.silu(gate) * up) @ t[f"{pre}.mlp.proj.weight"].T

    def block(x, pre):
        x = rms(attention(rms(x, t[f"{pre}.norm_1.weight"]), pre) + x, t[f"{pre}.norm_2.weight"])
        return rms(mlp(rms(x, t[f"{pre}.norm_3.weight"]), pre) + x, t[f"{pre}.norm_4.weight"])

    x = t["transformer.wte.weight"][idx]
    if variant != "no_embedding_scale":
        x = x * math.sqrt(d)
    for i in range(cfg["n_layers_in_prelude"]):
        x = block(x, f"transformer.prelude.{i}")
    e, s = x, s0
    for _ in range(n):
        u = torch.cat([e, s], -1) if variant == "adapter_input_first" else torch.cat([s, e], -1)
        s = u @ t["transformer.adapter.weight"].T
        for j in range(cfg["n_layers_in_recurrent_block"]):
            s = block(s, f"transformer.core_block.{j}")
    x = s if variant == "no_latent_norm" else rms(s, t["transformer.ln_f.weight"])
    for k in range(cfg["n_layers_in_coda"]):
        x = block(x, f"transformer.coda.{k}")
    return rms(x, t["transformer.ln_f.weight"]) @ t["transformer.wte.weight"].T


def huginn_noise(shape, d: int, seed: int) -> torch.Tensor:
    """Huginn's initialize_state: truncated normal at std sqrt(2/(5d)), cut at ±3 std, then
    times emb_scale = sqrt(d) (float64, drawn from a generator seeded with `seed`)."""
    std = math.sqrt(2 / (5 * d))
    x = torch.empty(shape, dtype=torch.float64)
    torch.nn.init.trunc_normal_(x, 0.0, std, -3 * std, 3 * std, generator=torch.Generator().manual_seed(seed))
    return x * math.sqrt(d)


def write_dir(path, tensors: dict, cfg: dict = RAVEN, shards: int = 1):
    """A checkpoint directory written the way save_pretrained lays it out: config.json and
    model.safetensors, or `shards` files with model.safetensors.index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    names = list(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    wmap = {}
    for i in range(shards):
        f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}  # interleaved, not in order
        save_file(part, path / f, metadata={"format": "pt"})
        wmap.update(dict.fromkeys(part, f))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}))
    return path


def expected_config(**kw) -> GPTConfig:
    """The GPTConfig RAVEN describes, worked out by hand (the key table: docs/huginn.md, "The checkpoint format")."""
    base = dict(n_layer=P + C + K, n_head=HEADS, n_embd=D, block_size=BLOCK, vocab_size=V, pad_vocab_multiple=1,
                groups=[list(range(P, P + C))], mean_recurrence=4.0, state_init="normal", logit_bias=False,
                position="rope", rope_base=500.0, mlp="gated_silu", intermediate_size=INTER, qk_bias=True,
                scale_embeddings=True, latent_norm=True, norm_eps=1e-5)
    return GPTConfig(**{**base, **kw})


def own_model(t: dict) -> LoopedGPT:
    """recdepth's model of RAVEN with the weights of `t` put in by hand (not by hf.py)."""
    m = LoopedGPT(expected_config()).double().eval()
    with torch.no_grad():
        m.wte.weight.copy_(t["transformer.wte.weight"])
        m.ln_f.weight.copy_(t["transformer.ln_f.weight"])
        m.adapters[0].state.weight.copy_(t["transformer.adapter.weight"][:, :D])
        m.adapters[0].input.weight.copy_(t["transformer.adapter.weight"][:, D:])
        for layer, pre in enumerate(PREFIXES):
            b = m.h[layer]
            for ours, theirs in ((b.norm1, "norm_1"), (b.norm2, "norm_2"), (b.norm3, "norm_3"), (b.norm4, "norm_4")):
                ours.weight.copy_(t[f"{pre}.{theirs}.weight"])
            b.attn.qkv.weight.copy_(t[f"{pre}.attn.Wqkv.weight"])
            b.attn.qk_bias.copy_(t[f"{pre}.attn.qk_bias"])
            b.attn.proj.weight.copy_(t[f"{pre}.attn.proj.weight"])
            b.mlp.fc.weight.copy_(t[f"{pre}.mlp.fc.weight"])
            b.mlp.proj.weight.copy_(t[f"{pre}.mlp.proj.weight"])
    return m


IDX = torch.randint(0, V, (3, BLOCK), generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tensors this small gain nothing from intra-op threads, and on a shared 2-core machine
    the threads' waiting made each op ~100x slower; restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def one_line(e, *parts):
    msg = str(e.value)
    assert "\n" not in msg, msg
    for p in parts:
        assert p in msg, (p, msg)


# ----------------------------------------------------- (a) the reference forward
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    t = raven_tensors()
    m, info = load_hf(write_dir(tmp_path_factory.mktemp("raven"), t), dtype=torch.float64)
    return t, m, info


def test_loaded_model_equals_the_reference_forward(loaded):
    """Logits of the loaded model = Huginn's equations over the same HF-named tensors, at a
    fixed loop count, from Huginn's noise (drawn as Huginn draws it) and from zero."""
    t, m, info = loaded
    n = 3
    ref = raven_forward(t, IDX, n, huginn_noise((3, BLOCK, D), D, seed=5))
    got, _ = m(IDX, loops=[n], generator=torch.Generator().manual_seed(5))  # recdepth: std sqrt(2/5) directly
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    m.cfg.state_init = "zero"
    try:
        got0, _ = m(IDX, loops=[n])
    finally:
        m.cfg.state_init = "normal"
    torch.testing.assert_close(got0, raven_forward(t, IDX, n, torch.zeros(3, BLOCK, D, dtype=torch.float64)),
                               rtol=1e-9, atol=1e-9)
    assert (got0 - got).abs().max() > 1e-3  # the noise matters, so the equal noise was tested
    assert info["optional"] == [] and info["files"] == ["model.safetensors"]


@pytest.mark.parametrize("variant", ["rope_halves", "bias_after_rope", "mlp_halves_swapped", "no_embedding_scale",
                                     "adapter_input_first", "no_latent_norm"])
def test_the_comparison_notices_each_pinned_detail(loaded, variant):
    """Each detail of docs/spec.md §1b, done the other way, changes the logits well beyond
    the tolerance above: the agreement is not an accident of a lenient comparison."""
    t, m, _ = loaded
    s0 = torch.zeros(1, BLOCK, D, dtype=torch.float64)
    ref = raven_forward(t, IDX[:1], 2, s0)
    assert (raven_forward(t, IDX[:1], 2, s0, variant=variant) - ref).abs().max() > 1e-3


def test_the_loaded_config_is_the_one_config_json_describes(loaded):
    _, m, info = loaded
    assert m.cfg == expected_config()
    assert (m.prelude, m.core, m.coda) == ([0], [1, 2], [3, 4])
    assert info["defaulted"] == ["test_time_noise"]  # every other key is in RAVEN (n_layers is derived)
    assert next(m.parameters()).dtype == torch.float64 and not m.training


# --------------------------------------------------- (b) hand-written directories
@pytest.mark.parametrize("shards", [1, 3])
def test_a_hand_written_checkpoint_loads_as_recdepths_own_model(tmp_path, shards):
    t = raven_tensors(seed=2)
    files = dict(t)
    if shards == 3:  # the optional tensors save_pretrained may write: the tied head and the rope table
        files["lm_head.weight"] = t["transformer.wte.weight"].clone()
        inv = 1.0 / (500.0 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
        ang = torch.outer(torch.arange(BLOCK, dtype=torch.float32), inv)
        files["freqs_cis"] = torch.stack([ang.cos(), ang.sin()], -1)[None, :, None]
    m, info = load_hf(write_dir(tmp_path, files, shards=shards), dtype=torch.float64)
    own = own_model(t)
    assert m.state_dict().keys() == own.state_dict().keys()
    for k, v in own.state_dict().items():
        assert torch.equal(m.state_dict()[k], v), k
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    torch.testing.assert_close(m(IDX, loops=[2], generator=gen())[0], own(IDX, loops=[2], generator=gen())[0],
                               rtol=0, atol=1e-12)
    assert len(info["files"]) == shards
    assert info["optional"] == ([] if shards == 1 else ["freqs_cis", "lm_head.weight"])


def test_dtype_and_device_are_the_callers(tmp_path):
    m, _ = load_hf(write_dir(tmp_path, raven_tensors()), device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert all(p.requires_grad and p.is_contiguous() for p in m.parameters())  # trainable as built
    logits, _ = m(IDX[:1, :4], loops=[2])
    assert torch.isfinite(logits).all()


# ------------------------------------------------------------ (c) the round trip
@pytest.mark.parametrize("max_shard_bytes", [10**9, 40_000])
def test_save_then_load_is_the_same_model(tmp_path, max_shard_bytes):
    """A model with a padded compact vocabulary and its "other" entry, zero initial state:
    what RavenConfig has no key for travels in config.json's recdepth block."""
    torch.manual_seed(3)
    cfg = GPTConfig.from_size("tiny", groups=[[2, 3, 4, 5]], vocab_size=90, n_other=7, state_init="zero",
                              mean_recurrence=5, logit_bias=False, position="rope", rope_base=50000.0,
                              mlp="gated_silu", qk_bias=True, scale_embeddings=True, latent_norm=True)
    m = LoopedGPT(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))  # off the init (qk_bias, norms), so each tensor is distinct
    out = save_hf(m, tmp_path, max_shard_bytes=max_shard_bytes)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert (raw["model_type"], raw["vocab_size"], raw["intermediate_size"], raw["n_layers_in_prelude"],
            raw["n_layers_in_recurrent_block"], raw["n_layers_in_coda"]) == ("huginn_raven", 128, 192, 2, 4, 2)

    def raven_config_init(tie_embeddings=True, **kwargs):  # RavenConfig.__init__'s call to PretrainedConfig
        return dict(tie_word_embeddings=tie_embeddings, **kwargs)

    assert raven_config_init(**raw)["tie_word_embeddings"] is True  # loads in Huginn's own code (no key twice)
    m2, info = load_hf(tmp_path)
    assert m2.cfg == dataclasses.replace(cfg, intermediate_size=cfg.mlp_hidden)
    assert m2.state_dict().keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v), k
    idx = torch.randint(0, 90, (2, 20))
    torch.testing.assert_close(m2(idx, loops=[3])[0], m(idx, loops=[3])[0], rtol=0, atol=0)
    n_shards = len([f for f in out["files"] if f.endswith(".safetensors")])
    assert (n_shards == 1) == (max_shard_bytes == 10**9) and info["optional"] == ["freqs_cis"]
    if n_shards > 1:  # every shard within the limit, the index covering every tensor once
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == sorted(f for f in out["files"] if "-of-" in f)
        for f in set(index["weight_map"].values()):
            sizes = [t.numel() * t.element_size() for t in load_file(tmp_path / f).values()]
            assert len(sizes) == 1 or sum(sizes) <= max_shard_bytes
    with pytest.raises(ValueError) as e:  # a second save into the same directory
        save_hf(m, tmp_path)
    one_line(e, str(tmp_path / "config.json") + ": exists", "overwrite=True")
    save_hf(m, tmp_path, overwrite=True)
    assert not (tmp_path / "model.safetensors.index.json").exists()  # the old shards went with it


@pytest.mark.parametrize("kw, key", [(dict(groups=[[1], [2, 3]]), "model.groups"), (dict(logit_bias=True), "model.logit_bias"),
                                     (dict(position="learned"), "model.position"), (dict(mlp="silu"), "model.mlp"),
                                     (dict(latent_norm=False), "model.latent_norm"),
                                     (dict(scale_embeddings=False), "model.scale_embeddings")])
def test_save_refuses_what_huginn_cannot_express(tmp_path, kw, key):
    base = dict(groups=[[1, 2]], logit_bias=False, position="rope", mlp="gated_silu", latent_norm=True,
                scale_embeddings=True)
    m = LoopedGPT(GPTConfig(n_layer=5, n_head=2, n_embd=16, block_size=8, vocab_size=64, **{**base, **kw}))
    with pytest.raises(ValueError) as e:
        save_hf(m, tmp_path)
    one_line(e, key)
    assert not any(tmp_path.iterdir())


def test_a_parameter_with_no_huginn_name_is_refused_on_save_and_missing_on_load_in_one_line(tmp_path, monkeypatch):
    """docs/contributing.md, "Change the block": a parameter added to the block that hf.py's
    name_map does not map is neither dropped by save_hf nor a raw RuntimeError in load_hf."""
    from recdepth.model import looped

    base = dict(groups=[[1, 2]], logit_bias=False, position="rope", mlp="gated_silu", latent_norm=True,
                scale_embeddings=True)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=16, block_size=8, vocab_size=64, **base)
    m = LoopedGPT(cfg)
    m.h[1].register_parameter("gain", torch.nn.Parameter(torch.ones(())))  # the newcomer's new parameter
    with pytest.raises(ValueError) as e:
        save_hf(m, tmp_path / "a")
    one_line(e, "save_hf", "'h.1.gain'", "name_map")
    assert not (tmp_path / "a" / "model.safetensors").exists()

    save_hf(LoopedGPT(cfg), tmp_path / "b")  # a checkpoint of the block as it was
    init = looped.Block.__init__

    def with_gain(self, *a, **kw):  # the block now has a gain: the mapping fills no tensor for it
        init(self, *a, **kw)
        self.gain = torch.nn.Parameter(torch.ones(()))

    monkeypatch.setattr(looped.Block, "__init__", with_gain)
    monkeypatch.setitem(looped.INIT, "h.gain", "ones")
    with pytest.raises(ValueError) as e:
        load_hf(tmp_path / "b")
    one_line(e, "load_hf", "missing h.0.gain", "name_map", str(tmp_path / "b"))


# ------------------------------------------------------------ (d) bad directories
@pytest.mark.parametrize("case, file, parts", [
    ("no_config", "config.json", ["missing"]),
    ("model_type", "config.json", ["model_type: expected 'huginn_raven'", "'llama'"]),
    ("bias", "config.json", ["bias: unsupported value True"]),
    ("gqa", "config.json", ["num_key_value_heads: expected 4", "got 2"]),
    ("untied", "config.json", ["tie_embeddings: unsupported value False"]),
    ("untied_hf_name", "config.json", ["tie_embeddings: unsupported value False"]),  # as PretrainedConfig spells it
    ("mlp_class", "config.json", ["mlp_class_name: unsupported value 'BaseMLP'", "'GatedMLP'"]),
    ("norm_class", "config.json", ["norm_class_name: unsupported value 'LayerNorm'"]),
    ("layers", "config.json", ["n_layers: expected", "= 5, got 6"]),
    ("missing_tensor", "model.safetensors", ["transformer.core_block.1.mlp.fc.weight: missing", "[96, 32]"]),
    ("unexpected_tensor", "model.safetensors", ["transformer.extra.weight: unexpected tensor"]),
    ("shape", "model.safetensors", ["transformer.coda.0.attn.Wqkv.weight: expected shape [96, 32], got [95, 32]"]),
    ("untied_head", "model.safetensors", ["lm_head.weight: expected the tied embedding"]),
    ("no_weights", "model.safetensors", ["missing", "model.safetensors.index.json"]),
    ("missing_shard", "model.safetensors.index.json", ["weight_map['transformer.",
                                                       "model-00003-of-00003.safetensors does not exist"]),
    ("index_missing_tensor", "model.safetensors.index.json", ["transformer.ln_f.weight: missing"]),
])
def test_a_bad_directory_fails_in_one_line_naming_file_and_key(tmp_path, case, file, parts):
    t, cfg = raven_tensors(), dict(RAVEN)
    changes = {"model_type": {"model_type": "llama"}, "bias": {"bias": True}, "gqa": {"num_key_value_heads": 2},
               "untied": {"tie_embeddings": False}, "mlp_class": {"mlp_class_name": "BaseMLP"},
               "norm_class": {"norm_class_name": "LayerNorm"}, "layers": {"n_layers": 6}}
    cfg.update(changes.get(case, {}))
    if case == "untied_hf_name":
        del cfg["tie_embeddings"]
        cfg["tie_word_embeddings"] = False
    if case == "missing_tensor":
        del t["transformer.core_block.1.mlp.fc.weight"]
    if case == "unexpected_tensor":
        t["transformer.extra.weight"] = torch.zeros(2)
    if case == "shape":
        t["transformer.coda.0.attn.Wqkv.weight"] = t["transformer.coda.0.attn.Wqkv.weight"][1:]
    if case == "untied_head":
        t["lm_head.weight"] = t["transformer.wte.weight"] + 1
    d = write_dir(tmp_path / "ckpt", t, cfg, shards=3 if case in ("missing_shard", "index_missing_tensor") else 1)
    if case == "no_config":
        (d / "config.json").unlink()
    if case == "no_weights":
        (d / "model.safetensors").unlink()
    if case == "missing_shard":
        (d / "model-00003-of-00003.safetensors").unlink()
    if case == "index_missing_tensor":
        index = json.loads((d / "model.safetensors.index.json").read_text())
        del index["weight_map"]["transformer.ln_f.weight"]
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError) as e:
        load_hf(d)
    one_line(e, str(d / file) + ":", *parts)


# ------------------------------------------------------------ (e) RoPE, closed form
def test_rope_rotates_adjacent_pairs_by_position_times_frequency():
    base, hd, T = 500.0, 8, 12
    theta = rope_angles(torch.arange(T), hd, base)
    cos, sin = theta.cos().double(), theta.sin().double()
    x = torch.randn(2, 3, T, hd, dtype=torch.float64)
    # position 0 is the identity
    torch.testing.assert_close(apply_rope(x[:, :, :1], cos[:1], sin[:1]), x[:, :, :1], rtol=0, atol=0)
    # the unit vector e_{2i} at position p goes to (cos, sin)(p · base^(−2i/hd)) in channels 2i, 2i+1
    for p in (1, 5, 11):
        for i in range(hd // 2):
            e = torch.zeros(hd, dtype=torch.float64)
            e[2 * i] = 1
            y = apply_rope(e.expand(1, 1, T, hd), cos, sin)[0, 0, p]
            want = torch.zeros(hd, dtype=torch.float64)
            angle = p * base ** (-2 * i / hd)
            want[2 * i], want[2 * i + 1] = math.cos(angle), math.sin(angle)
            torch.testing.assert_close(y, want, rtol=0, atol=1e-6)
    # rotations: norms kept; and q_m · k_n depends on m − n only
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(hd, dtype=torch.float64), torch.randn(hd, dtype=torch.float64)
    qs = apply_rope(q.expand(1, 1, T, hd), cos, sin)[0, 0]
    ks = apply_rope(k.expand(1, 1, T, hd), cos, sin)[0, 0]
    for delta in (0, 1, 4):
        dots = torch.stack([qs[m] @ ks[m - delta] for m in range(delta, T)])
        torch.testing.assert_close(dots, dots[:1].expand_as(dots), rtol=0, atol=1e-5)
    assert (qs[3] @ ks[1] - qs[3] @ ks[2]).abs() > 1e-3  # and it does depend on m − n
    # float32 and bfloat16 inputs rotate in float32 and come back in their dtype
    assert apply_rope(x.float(), cos.float(), sin.float()).dtype == torch.float32
    assert apply_rope(x.bfloat16(), cos.float(), sin.float()).dtype == torch.bfloat16


# ------------------------------------------------- the options in recdepth's model
def huginn_cfg(**kw) -> GPTConfig:
    base = dict(groups=[[2, 3, 4, 5]], vocab_size=128, logit_bias=False, position="rope", rope_base=50000.0,
                mlp="gated_silu", qk_bias=True, scale_embeddings=True, latent_norm=True, mean_recurrence=3)
    return GPTConfig.from_size("tiny", **{**base, **kw})


@pytest.mark.parametrize("kw, field", [(dict(position="alibi"), "model.position"), (dict(mlp="gelu"), "model.mlp"),
                                       (dict(rope_base=1.0), "model.rope_base"),
                                       (dict(intermediate_size=0), "model.intermediate_size"),
                                       (dict(qk_bias=1), "model.qk_bias"), (dict(norm_eps=0.0), "model.norm_eps"),
                                       (dict(n_head=64, n_embd=64 * 3), "model.position")])
def test_bad_options_are_refused_in_one_line(kw, field):
    with pytest.raises(ValueError) as e:
        huginn_cfg(**kw)
    one_line(e, field + ": ")
    assert str(e.value).startswith(field)


def test_prelude_core_coda_and_their_refusal_with_several_groups():
    m = LoopedGPT(huginn_cfg())
    assert (m.prelude, m.core, m.coda) == ([0, 1], [2, 3, 4, 5], [6, 7])
    m3 = LoopedGPT(GPTConfig(n_layer=6, n_head=2, n_embd=16, block_size=8, vocab_size=64, groups=[[1], [2, 3]]))
    with pytest.raises(ValueError) as e:
        _ = m3.core
    one_line(e, "model.groups: core", "exactly one recurrence group", "2")


# The std of a unit normal truncated at ±3, in closed form: Var = 1 − 2·3·φ(3)/(2Φ(3) − 1),
# with 2Φ(3) − 1 = erf(3/√2). Not 0.9733, which is the variance.
TRUNC_STD = math.sqrt(1 - 2 * 3 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))


def test_the_truncated_normal_std_factor_is_what_torch_draws():
    """What reset_parameters draws (nn.init.trunc_normal_ at a = −3σ, b = 3σ) has std
    σ · TRUNC_STD: 10⁶ draws, relative standard error of their std ~0.0007; rel=0.003 is
    ~4.5 of them and excludes the variance (0.97334, 1.35 % lower)."""
    assert TRUNC_STD == pytest.approx(0.98658, abs=1e-5) and TRUNC_STD**2 == pytest.approx(0.97334, abs=1e-5)
    for s in (1.0, math.sqrt(2 / (5 * 256))):
        t = torch.empty(10**6)
        torch.nn.init.trunc_normal_(t, 0.0, s, -3 * s, 3 * s, generator=torch.Generator().manual_seed(0))
        assert t.abs().max().item() <= 3 * s
        assert t.std().item() == pytest.approx(s * TRUNC_STD, rel=0.003)
        assert t.std().item() != pytest.approx(s * TRUNC_STD**2, rel=0.003)


def test_the_options_parameters_and_init():
    """No wpe under rope; qk_bias [2, 1, H, hd] at zero; gated fc [2I, d] with Huginn's
    init_glu (the SiLU half at σ, the linear half at σ/sqrt(2·L_eff)); I defaults to 8d/3
    rounded up to 64 (gated) or 4d (silu); the sizes' presets."""
    cfg = huginn_cfg(n_embd=256, n_head=4)
    torch.manual_seed(0)
    m = LoopedGPT(cfg)
    names = dict(m.named_parameters())
    assert m.wpe is None and not any(n.startswith("wpe") for n in names)
    assert names["h.0.attn.qk_bias"].shape == (2, 1, 4, 64) and torch.all(names["h.0.attn.qk_bias"] == 0)
    assert cfg.mlp_hidden == 704  # ceil(8 · 256 / 3) = 683 -> 704
    fc = names["h.3.mlp.fc.weight"]
    assert fc.shape == (2 * 704, 256)
    sigma = math.sqrt(2 / (5 * 256))
    trunc = TRUNC_STD  # std of a unit normal cut at ±3 (0.98658; its variance is 0.97334)
    # 180224 draws a half: the sample std's relative standard error is ~0.0016, so rel=0.006 is
    # ~4 of them and still tells this factor from the variance (1.35 % lower)
    assert fc[:704].std().item() == pytest.approx(sigma * trunc, rel=0.006)
    assert fc[704:].std().item() == pytest.approx(sigma / math.sqrt(2 * cfg.effective_depth) * trunc, rel=0.006)
    assert GPTConfig.from_size("tiny", groups=[[2]]).mlp_hidden == 256
    assert GPTConfig.from_size("huginn-0125", groups=[[2, 3, 4, 5]]).mlp_hidden == 17920
    assert huginn_cfg().emb_scale == 8.0 and GPTConfig.from_size("tiny", groups=[[2]]).emb_scale == 1.0


def test_flop_count_of_the_gated_mlp_matches_torch_flop_counter():
    m = LoopedGPT(huginn_cfg(intermediate_size=100))
    B, T, n = 2, 16, 3
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        m(torch.randint(0, 128, (B, T)), loops=[n])
    ours = m.flops_per_token([n], T, None, train=False) * B * T
    attention = (4 + 4 * n) * 4 * T * 64 * B * T  # nanoGPT's term, which the counter skips on CPU
    assert ours - attention == pytest.approx(fc.get_total_flops(), rel=1e-9)


def test_latent_norm_is_applied_where_the_loop_is_left():
    """The state leaving the group is ln_f of the last application's output, in the
    parallel forward (trace: the next layer's input) and nowhere else."""
    m = LoopedGPT(huginn_cfg(state_init="zero")).double()
    idx = torch.randint(0, 128, (2, 10))
    trace = []
    m(idx, loops=[3], trace=trace)
    last = trace[2][2][-1]  # ("group", 0, trajectory): the core's last state, before the norm
    torch.testing.assert_close(trace[3][2][0], m.h[6](m.ln_f(last)), rtol=0, atol=0)
    m.cfg.latent_norm = False
    plain = []
    m(idx, loops=[3], trace=plain)
    torch.testing.assert_close(plain[3][2][0], m.h[6](last), rtol=0, atol=0)


# ------------------------------ (f) model=huginn trains, evaluates and decodes exactly
@pytest.fixture(scope="module")
def huginn_run(env, tmp_path_factory):
    """python -m recdepth.train model=huginn model.size=tiny debug=tiny, in-process (without the
    loop-dynamics callback, for time: `python -m recdepth.train model=huginn debug=tiny` runs it)."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.train import train

    d = tmp_path_factory.mktemp("huginn")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECDEPTH_CACHE", env["RECDEPTH_CACHE"])
        mp.setenv("WANDB_MODE", "offline")
        with initialize_config_dir(conf_dir(), version_base="1.3"):
            cfg = compose("config", overrides=["model=huginn", "model.size=tiny", "debug=tiny", "logger=csv",
                                               "callbacks=none", f"runs_dir={d / 'runs'}", f"run_dir={d / 'run'}"])
        metrics = train(cfg)
    return metrics, d / "run" / "train" / "checkpoints" / "last.ckpt"


def test_model_huginn_trains(huginn_run):
    from recdepth.app.checkpoints import load_checkpoint

    metrics, ckpt = huginn_run
    assert metrics["steps"] == 3 and math.isfinite(metrics["val_ce"]) and math.isfinite(metrics["eval"]["ce"])
    module, _ = load_checkpoint(ckpt, torch.device("cpu"))
    cfg = module.model.cfg
    assert (cfg.position, cfg.mlp, cfg.qk_bias, cfg.scale_embeddings, cfg.latent_norm, cfg.logit_bias,
            cfg.rope_base, cfg.groups, cfg.n_embd) == ("rope", "gated_silu", True, True, True, False, 50000.0,
                                                       [[2, 3, 4, 5]], 64)
    sd = module.model.state_dict()
    assert all(torch.isfinite(v).all() for v in sd.values())
    # trained: the q/k biases and the norms left their init (0 and 1)
    assert all(sd[f"h.{i}.attn.qk_bias"].abs().max() > 0 for i in range(8))
    assert (sd["ln_f.weight"] != 1).any()
    assert module.model.lm_bias is None and "wpe.weight" not in sd


@pytest.fixture(scope="module")
def trained(huginn_run):
    """The trained model=huginn, in float64 for exact comparisons."""
    from recdepth.app.checkpoints import load_checkpoint

    module, _ = load_checkpoint(huginn_run[1], torch.device("cpu"))
    return module.model.double().eval()


MAX = 10  # max_steps of the decoding tests


def varied_policy(m, rule, idx, noise):
    """A policy of `rule` under which the rows of this model exit at different n (so the
    batched engine's compaction really runs), found by bisecting τ (a larger τ exits
    earlier, for every rule); argmax_stability tries patience 1, 2, 3."""
    if rule == "fixed":
        policy = exits.build("fixed", None, max_steps=6)
        return (policy, *decode_all(m, idx, policy, noise=noise))
    if rule == "argmax_stability":
        tries = [exits.build(rule, None, max_steps=MAX, patience=k) for k in (1, 2, 3)]
    else:
        tries = None
    g = torch.Generator().manual_seed(11)
    gate = {"gate": (0.3 * torch.randn(1, m.cfg.n_embd, generator=g, dtype=torch.float64), torch.tensor([0.2]))}
    lo, hi = (1e-3, 0.999) if rule == "gate" else (1e-6, 10.0)
    tau = 0.5 if rule == "gate" else 0.1
    for k in range(3 if tries else 16):
        policy = tries[k] if tries else exits.build(rule, tau, max_steps=MAX, **(gate if rule == "gate" else {}))
        logits, apps = decode_all(m, idx, policy, noise=noise)
        seen = set(apps.flatten().tolist())
        if len(seen) > 1:
            return policy, logits, apps
        if not tries:  # all at max_steps: τ too strict, raise it; all at one earlier n: lower it
            lo, hi = (tau, hi) if seen == {MAX} else (lo, tau)
            tau = math.sqrt(lo * hi)
    raise AssertionError(f"{rule}: found no setting at which rows exit at different n")


@pytest.mark.parametrize("rule", [n for n in exits.names() if not exits.lookup(n).reads_head])
def test_model_huginn_decodes_batched_exactly_under_every_exit_rule(trained, rule):
    """The trained model=huginn (rope at each position, the latent norm on leaving the loop)
    decoded token by token: a batch of windows gives each window its batch-1 result. (exit=halt
    needs a halting head, which this model has not: tests/exits/test_halt.py.)"""
    m = trained
    idx = torch.randint(0, m.cfg.vocab_size, (3, 6), generator=torch.Generator().manual_seed(4))
    policy, batched, apps = varied_policy(m, rule, idx, RowNoise(7, [10, 11, 12]))
    for r in range(3):
        alone, apps_1 = decode_all(m, idx[r : r + 1], policy, noise=RowNoise(7, [10 + r]))
        torch.testing.assert_close(batched[r : r + 1], alone, rtol=1e-10, atol=1e-10)
        assert torch.equal(apps[r : r + 1], apps_1)
    if rule == "fixed":  # and with a per-application cache, token by token is the parallel pass
        m.cfg.state_init = "zero"
        try:
            ref, _ = m(idx, loops=[6])
            per_step, _ = decode_all(m, idx, policy, sharing="per_step")
        finally:
            m.cfg.state_init = "normal"
        torch.testing.assert_close(per_step, ref, rtol=1e-9, atol=1e-9)


def test_the_training_identity_of_the_options():
    """Options at their defaults leave a run's identity as it was before them; Huginn's
    options make another network (recdepth/training/runs.py: what_trains)."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.training.runs import training_identity, what_trains

    with initialize_config_dir(conf_dir(), version_base="1.3"):
        single = compose("config", overrides=["model=single"])
        huginn = compose("config", overrides=["model=huginn"])
        rope = compose("config", overrides=["model=single", "model.position=rope"])
        rope_base = compose("config", overrides=["model=single", "model.rope_base=123.0"])
    _, sub = training_identity(single)
    assert set(sub["model"]) == {"n_layer", "n_head", "n_embd", "block_size", "groups", "state_init", "logit_bias"}
    ids = {training_identity(c)[0] for c in (single, huginn, rope)}
    assert len(ids) == 3
    assert training_identity(rope_base)[0] == training_identity(single)[0]  # learned positions never read it
    assert what_trains({"model": {"size": "tiny", "position": "rope", "rope_base": 123.0}})["model"]["rope_base"] == 123.0
