"""Generation under an exit rule (docs/spec.md §4d): greedy decoding, self-speculative
decoding and its exactness, the chunk pass, and `python -m recdepth.generate`."""

import csv
import dataclasses
import html
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recdepth import exits
from recdepth.cli.runner import compose_job
from recdepth.config import schema
from recdepth.config.build import conf_dir
from recdepth.decode import generation
from recdepth.decode.engine import RowNoise, decode_step
from recdepth.decode.generation import accepted, chunk_step, greedy, new_chunk_caches, speculative
from recdepth.decode.kv_cache import new_caches
from recdepth.decode.settings import DecodeSettings
from recdepth.model.looped import GPTConfig, LoopedGPT
from tests.conftest import REPO

V = 50
N = 6  # full depth of the test rules


pytestmark = pytest.mark.usefixtures("one_thread")


HUGINN_OPTIONS = dict(position="rope", mlp="gated_silu", qk_bias=True, scale_embeddings=True, latent_norm=True,
                      logit_bias=False)


def model(state_init="normal", seed=0, block_size=32, dtype=torch.float64, **options):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=32, block_size=block_size, vocab_size=V, groups=[[1], [2, 3]],
                    mean_recurrence=3, state_init=state_init, **options)
    m = LoopedGPT(cfg).to(dtype).eval()
    if options.get("qk_bias"):  # weights at their init would hide where they act: a zero q/k bias,
        with torch.no_grad():  # and ln_f at ones on a state the layer's own norm left at RMS 1
            for layer in m.h:
                layer.attn.qk_bias.normal_(0, 0.5)
            m.ln_f.weight.uniform_(0.5, 1.5)
    return m


RULES = {"fixed": exits.build("none", None, max_steps=N), "accel": exits.build("accel", 5.0, max_steps=N)}
PROMPTS = [[3], [7, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9]]


def same(a, b):
    """Token for token, with the applications of every token and every prompt position."""
    return a.ids == b.ids and [r.apps for r in a.records] == [r.apps for r in b.records] \
        and a.prompt_apps == b.prompt_apps


# -------------------------------------------------------------- exactness
@pytest.mark.parametrize("options", [{}, HUGINN_OPTIONS], ids=["gpt2", "huginn"])
@pytest.mark.parametrize("rule", RULES)
def test_speculative_equals_greedy_with_per_step_cache(rule, options):
    m, policy = model(**options), RULES[rule]
    apps_seen = set()
    for p, prompt in enumerate(PROMPTS):
        ref = greedy(m, prompt, policy, 10, DecodeSettings(cache="per_step", seed=p))
        apps_seen |= {a for r in ref.records for a in r.apps}
        for lookahead in (1, 3, 8):
            for draft_steps in (1, 2):
                got = speculative(m, prompt, policy, 10, draft_steps, lookahead, DecodeSettings(cache="per_step", seed=p))
                assert same(got, ref), (rule, p, lookahead, draft_steps)
                assert [r.position for r in got.records] == list(range(len(prompt), len(prompt) + 10))
                assert got.stats["rounds"] + got.stats["accepted"] + 1 == 10  # each round: accepted + 1 token
    if rule == "accel":
        assert len(apps_seen) > 1  # the rule really exits at different depths


def test_speculative_with_full_depth_drafts_accepts_every_draft():
    """draft_steps = the full fixed depth: the draft is the verifier, so every draft is
    accepted and each pass commits lookahead + 1 tokens (closed form)."""
    m, policy = model(), RULES["fixed"]
    for lookahead in (1, 3):
        rounds = 4
        n_new = 1 + rounds * (lookahead + 1)  # the first token comes from the prompt's pass
        got = speculative(m, PROMPTS[1], policy, n_new, N, lookahead, DecodeSettings(cache="per_step", seed=0))
        s = got.stats
        assert (s["acceptance_rate"], s["rounds"], s["drafted"], s["accepted"]) == (1.0, rounds, rounds * lookahead,
                                                                                   rounds * lookahead)
        assert s["tokens_per_pass"] == lookahead + 1
        assert s["draft_applications"] == rounds * lookahead * N * m.n_groups
        assert s["verify_applications"] == s["verify_work"] == rounds * (lookahead + 1) * N * m.n_groups
        assert s["verify_steps"] == rounds * N * m.n_groups  # a chunk's positions loop side by side
        assert [r.source for r in got.records] == ["verify"] + (["draft"] * lookahead + ["verify"]) * rounds
        assert same(got, greedy(m, PROMPTS[1], policy, n_new, DecodeSettings(cache="per_step", seed=0)))


def test_speculative_with_one_step_drafts_on_an_untrained_model():
    """draft_steps=1 on an untrained model: most drafts are wrong; the output is still greedy's."""
    m, policy = model(), RULES["accel"]
    got = speculative(m, PROMPTS[2], policy, 16, 1, 4, DecodeSettings(cache="per_step", seed=3))
    assert same(got, greedy(m, PROMPTS[2], policy, 16, DecodeSettings(cache="per_step", seed=3)))
    s = got.stats
    assert s["acceptance_rate"] < 0.5
    assert s["acceptance_rate"] == s["accepted"] / s["drafted"]


@pytest.mark.parametrize("wrong", [True, False])
def test_forced_drafts_never_change_the_output(monkeypatch, wrong):
    """Drafts forced always wrong (greedy's token + 1) or always right (greedy's token, but
    drafted at 1 step, so the draft's cache entries are not the verifier's): the output is
    greedy's either way, and the acceptance is 0 or 1 exactly. The entries the draft
    wrote beyond the accepted prefix (or under the accepted tokens) are overwritten before
    any read."""
    m, policy = model(), RULES["accel"]
    prompt = PROMPTS[1]
    ref = greedy(m, prompt, policy, 12, DecodeSettings(cache="per_step", seed=1))
    seq = prompt + ref.ids
    real = generation.decode_step

    def draft(model_, tokens, pos, caches, pol, *a, **kw):
        logits, apps = real(model_, tokens, pos, caches, pol, *a, **kw)
        forced = torch.full_like(logits, -1e9)
        forced[:, (seq[pos + 1] + wrong) % V] = 0
        return forced, apps

    monkeypatch.setattr(generation, "decode_step", draft)
    got = speculative(m, prompt, policy, 12, 1, 4, DecodeSettings(cache="per_step", seed=1))
    assert same(got, ref)
    s = got.stats
    assert s["acceptance_rate"] == (0.0 if wrong else 1.0)
    assert s["rounds"] == (11 if wrong else math.ceil(11 / 5))


@pytest.mark.parametrize("state_init", ["normal", "zero"])
@pytest.mark.parametrize("rule", ["accel", "kl"])
def test_the_chunk_pass_equals_token_by_token_per_step_decoding(state_init, rule):
    """chunk_step over positions 0..3, then 4..11, against decode_step position by position
    (cache=per_step): the same logits, applications and cache contents."""
    m = model(state_init)
    policy = exits.build(rule, 5.0 if rule == "accel" else 3e-2, max_steps=N)
    toks = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5))
    noise = RowNoise(7, [2])
    seq_caches = new_caches(m, 1, 32, "per_step", N)
    ref = [decode_step(m, toks[p : p + 1], p, seq_caches, policy, noise=noise) for p in range(12)]
    ref_logits = torch.cat([r[0] for r in ref])
    ref_apps = torch.cat([r[1] for r in ref])
    caches = new_chunk_caches(m, 32, N)
    la, aa = chunk_step(m, toks[:4], 0, caches, policy, noise)
    lb, ab = chunk_step(m, toks[4:], 4, caches, policy, noise)
    torch.testing.assert_close(torch.cat([la, lb]), ref_logits, rtol=1e-9, atol=1e-9)
    assert torch.equal(torch.cat([aa, ab]), ref_apps)
    assert len(set(ab[:, 0].tolist())) > 1  # positions of one chunk exit at different depths
    for c, r in zip(caches, seq_caches):
        torch.testing.assert_close(c.k[..., :12, :], r.k[..., :12, :], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(c.v[..., :12, :], r.v[..., :12, :], rtol=1e-9, atol=1e-9)


def test_accepted_is_the_longest_agreeing_prefix():
    assert accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted([], [3]) == 0
    with pytest.raises(ValueError):
        accepted([1, 2], [1, 2])


def test_speculative_refuses_latest_sharing_in_one_line():
    m = model()
    with pytest.raises(ValueError) as e:
        speculative(m, [1, 2], RULES["fixed"], 4, 2, 2, DecodeSettings(cache="latest"))
    msg = str(e.value)
    assert msg.startswith("eval.cache: ") and "per_step" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="speculative.lookahead"):
        speculative(m, [1, 2], RULES["fixed"], 4, 2, 0)


# ---------------------------------------------------------------- greedy
def test_greedy_rows_of_a_batch_equal_batch_one():
    m, policy = model(), RULES["accel"]
    prompts = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(2))
    batch = greedy(m, prompts, policy, 8, DecodeSettings(cache="latest", seed=4), sequences=[10, 11, 12])
    for b in range(3):
        alone = greedy(m, prompts[b].tolist(), policy, 8, DecodeSettings(cache="latest", seed=4), sequences=[10 + b])
        assert same(batch[b], alone)
    assert len({tuple(g.ids) for g in batch}) > 1


def test_greedy_is_the_argmax_of_the_decoding_engine_and_records_why_loops_stopped():
    """Each token is the argmax of decode_step's logits at the position before it, with
    the applications decode_step reports; the exit reason is max_steps exactly where the
    cap was reached."""
    m = model()
    policy = exits.build("accel", [5.0, 0.5], max_steps=[N, 4])
    prompt = [5, 6, 7]
    gen = greedy(m, prompt, policy, 10, DecodeSettings(cache="latest", seed=9))
    caches, noise, seq = new_caches(m, 1, 32), RowNoise(9, [0]), prompt + gen.ids
    for pos in range(len(seq) - 1):
        logits, apps = decode_step(m, torch.tensor([seq[pos]]), pos, caches, policy, noise=noise)
        if pos >= len(prompt) - 1:
            r = gen.records[pos - len(prompt) + 1]
            assert (r.token, r.position, r.apps) == (int(logits.argmax()), pos + 1, apps[0].tolist())
            assert r.reasons == ["max_steps" if a == cap else "rule" for a, cap in zip(r.apps, (N, 4))]
    reasons = {x for r in gen.records for x in r.reasons}
    assert reasons == {"rule", "max_steps"}
    assert {x for r in greedy(m, prompt, RULES["fixed"], 3).records for x in r.reasons} == {"fixed"}


def test_warm_start_greedy_carries_each_groups_state_to_the_next_token():
    """greedy with settings.warm_start is the engine with a warm list carried across positions (spec
    §4, eval.warm_start): the same tokens and applications as a hand-written loop, and
    different from the cold greedy run after the first token (so the option does something)."""
    m = model()
    policy = exits.build("accel", 5.0, max_steps=N)
    prompt = [5, 6, 7]
    gen = greedy(m, prompt, policy, 8, DecodeSettings(cache="latest", seed=9, warm_start=True))
    caches, noise, seq = new_caches(m, 1, 32), RowNoise(9, [0]), prompt + gen.ids
    warm = [None] * m.n_groups
    for pos in range(len(seq) - 1):
        logits, apps = decode_step(m, torch.tensor([seq[pos]]), pos, caches, policy, noise=noise, warm=warm)
        assert all(w is not None for w in warm)
        if pos >= len(prompt) - 1:
            r = gen.records[pos - len(prompt) + 1]
            assert (r.token, r.apps) == (int(logits.argmax()), apps[0].tolist())
    cold = greedy(m, prompt, policy, 8, DecodeSettings(cache="latest", seed=9))
    assert [r.apps for r in cold.records] != [r.apps for r in gen.records]


def test_generation_stops_at_the_block_size():
    m, policy = model(block_size=12), RULES["accel"]
    prompt = list(range(1, 10))  # 9 tokens: room for 12 + 1 − 9 = 4 new ones
    g = greedy(m, prompt, policy, 10, DecodeSettings(cache="per_step"))
    s = speculative(m, prompt, policy, 10, 1, 8)
    assert len(g.ids) == 4 and g.stopped == "block_size" and g.records[-1].position == 12
    assert same(s, g) and s.stopped == "block_size"
    assert greedy(m, prompt, policy, 4).stopped == "max_new_tokens"
    with pytest.raises(ValueError, match=r"^prompt: 13 tokens, more than the model's block_size=12"):
        greedy(m, list(range(13)), policy, 1)
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        greedy(m, [], policy, 1)


# ------------------------------------------------------------ the command
def compose_generate(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("generate", overrides=list(overrides))


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def html_tokens(path):
    """(index, applications per group, the title's total) of each generated token's span."""
    doc = path.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r'<span class="t"[^>]*data-index="(\d+)" data-apps="([\d ]+)" title="([^"]*)"', doc):
        total = int(re.search(r"applications (\d+) ", html.unescape(m.group(3))).group(1))
        out.append((int(m.group(1)), [int(a) for a in m.group(2).split()], total))
    return out


def check_outputs(run_dir, n_groups=3):
    """The four files agree with each other; returns generation.json."""
    gen = json.loads((run_dir / "generation.json").read_text())
    rows = read_csv(run_dir / "tokens.csv")
    assert [int(r["token"]) for r in rows] == gen["ids"] and len(rows) == gen["tokens"] > 0
    assert [int(r["token_gpt2"]) for r in rows] == gen["ids_gpt2"]
    assert [int(r["index"]) for r in rows] == list(range(len(rows)))
    P = len(gen["prompt_ids"])
    assert [int(r["position"]) for r in rows] == list(range(P, P + len(rows)))
    apps = [[int(r[f"apps_{g}"]) for g in range(n_groups)] for r in rows]
    assert [int(r["applications"]) for r in rows] == [sum(a) for a in apps]
    for r, a in zip(rows, apps):
        cap = gen["settings"]["exit"]["max_steps"]
        assert [r[f"exit_{g}"] for g in range(n_groups)] == ["max_steps" if x == cap else "rule" for x in a]
    assert html_tokens(run_dir / "depth.html") == [(i, a, sum(a)) for i, a in enumerate(apps)]
    assert "".join(r["text"] for r in rows) == gen["text"]  # ASCII here: token texts add up
    assert gen["applications"]["total"] == sum(map(sum, apps))
    png = (run_dir / "depth.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    return gen


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_generate_command_writes_agreeing_files(tiny_ckpt, env, tmp_path):
    """The real CLI with prompt text and speculative decoding: stdout is the generated
    text, the files agree, and the comparison with greedy decoding ran."""
    out = tmp_path / "gen"
    cmd = [sys.executable, "-m", "recdepth.generate", f"ckpt={tiny_ckpt}", 'prompt="ROMEO: What, ho!"',
           "max_new_tokens=10", "exit=accel", "exit.tau=1e-2", "eval.cache=per_step", "speculative.draft_steps=2",
           "speculative.lookahead=4", "device=cpu", f"hydra.run.dir={out}"]
    p = subprocess.run(cmd, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    gen = check_outputs(out)
    assert gen["prompt"] == "ROMEO: What, ho!" and p.stdout == gen["text"] + "\n"
    assert "speculative:" in p.stderr
    s = gen["speculative"]
    assert s["drafted"] > 0 and 0 <= s["acceptance_rate"] <= 1 and s["greedy_seconds"] > 0
    assert s["rounds"] + s["accepted"] + 1 == gen["tokens"] == 10
    assert {r["source"] for r in read_csv(out / "tokens.csv")} <= {"draft", "verify"}


def test_generate_with_prompt_ids_in_process(tiny_ckpt, ckpt_env, tmp_path):
    from recdepth.generate import generate

    cfg = compose_generate(f"ckpt={tiny_ckpt}", "prompt_ids=[1,2,3]", "max_new_tokens=6", "exit=accel",
                           "exit.tau=1e-2", "stream=false", "device=cpu", f"run_dir={tmp_path / 'g'}")
    gen = generate(cfg)
    assert check_outputs(tmp_path / "g") == json.loads(json.dumps(gen))
    assert gen["prompt_ids"] == [1, 2, 3] and gen["speculative"] is None
    with pytest.raises(FileExistsError, match="^run_dir: "):
        generate(cfg)
    long = compose_generate(f"ckpt={tiny_ckpt}", f"prompt_ids=[{','.join(['5'] * 129)}]", "device=cpu",
                            f"run_dir={tmp_path / 'long'}")
    with pytest.raises(ValueError, match=r"^prompt: 129 tokens, more than the model's block_size=128"):
        generate(long)
    assert not (tmp_path / "long").exists()


@pytest.mark.parametrize("overrides, field, expected", [
    (["ckpt=a.ckpt", "hf=some/dir", "prompt=x"], "ckpt", "exactly one of ckpt"),
    (["prompt=x"], "ckpt", "got neither"),
    (["ckpt=a.ckpt", "prompt=''"], "prompt", "empty"),
    (["ckpt=a.ckpt"], "prompt", "exactly one of prompt"),
    (["ckpt=a.ckpt", "prompt=x", "prompt_ids=[1]"], "prompt", "got both"),
    (["ckpt=a.ckpt", "prompt_ids=[1,-2]"], "prompt_ids[]", ">= 0"),
    (["ckpt=a.ckpt", "prompt=x", "max_new_tokens=0"], "max_new_tokens", ">= 1"),
    (["ckpt=a.ckpt", "prompt=x", "speculative.draft_steps=2"], "eval.cache", "needs eval.cache=per_step"),
    (["ckpt=a.ckpt", "prompt=x", "eval.cache=per_step", "speculative.draft_steps=0"], "speculative.draft_steps", ">= 1"),
])
def test_bad_generate_settings_fail_in_one_line(overrides, field, expected):
    cfg = compose_generate(*overrides, "run_dir=unused")
    assert OmegaConf.get_type(cfg) is schema.GenerateConfig
    with pytest.raises(ValueError) as e:
        schema.validated(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and "\n" not in msg and expected in msg, msg


def test_the_command_line_prints_a_bad_setting_in_one_line(monkeypatch, tmp_path):
    """`python -m recdepth.generate ckpt=a.ckpt hf=b prompt=x`, in-process: one line, exit 1."""
    from hydra.core.global_hydra import GlobalHydra

    from recdepth.generate import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["recdepth.generate", "ckpt=a.ckpt", "hf=b", "prompt=x",
                                      f"hydra.run.dir={tmp_path / 'g'}"])
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        GlobalHydra.instance().clear()
    assert e.value.code.startswith("error: ckpt: give exactly one of ckpt") and "\n" not in e.value.code
    assert not (tmp_path / "g" / "generation.json").exists()


def test_generate_yaml_holds_no_value_and_composes_to_the_schema_defaults():
    """conf/generate.yaml holds its defaults list and where runs go; every value of the
    composed config is GenerateConfig's default (its exit: the default rule's option)."""
    y = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "generate.yaml"))
    assert set(y) == {"defaults", "run_dir", "hydra"}
    run = schema.validated(compose_job("generate", ["ckpt=x", "prompt=y", "run_dir=/tmp/unused"]))
    ref = schema.GenerateConfig(ckpt="x", prompt="y")
    assert dataclasses.replace(run, run_dir=ref.run_dir) == ref


# ---------------------------------------------------------------- timing
class FakeClock:
    """`time` for recdepth.decode.generation: perf_counter() reads `now`, which the patched passes
    advance (issue 21: the benchmark times generation after the first token)."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


def test_decode_seconds_leave_out_the_prompt_and_the_tokens_stay_greedy_per_steps(monkeypatch):
    """On a fake clock that advances 1 s per decode_step and 10 s per chunk pass: greedy's
    first_token_seconds are its P − 1 prompt steps and the first token's step, speculative's
    its one prompt chunk pass; decode_seconds are the rest (greedy: one step per further
    token; speculative: its drafts and verify passes). The split leaves the tokens alone:
    speculative returns greedy per_step's tokens and applications."""

    def ticking(fn, dt):
        def f(*a, **k):
            FakeClock.now += dt
            return fn(*a, **k)
        return f

    monkeypatch.setattr(FakeClock, "now", 0.0)
    monkeypatch.setattr(generation, "time", FakeClock)
    monkeypatch.setattr(generation, "decode_step", ticking(generation.decode_step, 1.0))
    monkeypatch.setattr(generation, "chunk_step", ticking(generation.chunk_step, 10.0))
    m, prompt, n_new = model(), PROMPTS[2], 12
    P = len(prompt)
    for rule, policy in RULES.items():
        ref = greedy(m, prompt, policy, n_new, DecodeSettings(cache="per_step", seed=4))
        assert (ref.first_token_seconds, ref.decode_seconds, ref.seconds) == (P, n_new - 1, P + n_new - 1), rule
        latest = greedy(m, prompt, policy, n_new, DecodeSettings(cache="latest", seed=4))
        assert (latest.first_token_seconds, latest.decode_seconds) == (P, n_new - 1), rule
        s = speculative(m, prompt, policy, n_new, 2, 4, DecodeSettings(cache="per_step", seed=4))
        assert same(s, ref), rule
        assert s.first_token_seconds == 10.0, rule
        assert s.decode_seconds == 10.0 * s.stats["rounds"] + s.stats["drafted"], rule
        assert s.stats["rounds"] >= 3 and s.stats["drafted"] >= 3, rule  # 11 tokens after the first, L <= 4
