"""`hf=<dir>` in the entry points (recdepth/app/checkpoints.py: open_model): a tiny Huginn-format
directory with its own tokenizer.json is evaluated and diagnosed on a local text file.
The scored tokens are checked against the file's tail tokenized here with the `tokenizers`
library directly, the CE against a parallel forward of the same weights (per-step cache at
a fixed depth equals the parallel pass, spec §4), and bad directories fail in one line."""

import json

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from recdepth.config.build import conf_dir
from recdepth.integrations.hf import save_hf
from recdepth.model.looped import GPTConfig, LoopedGPT

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "A stitch in time saves nine. "
        "All that glitters is not gold. To be or not to be, that is the question. ") * 12
EOS = "<|end_text|>"


def tiny_tokenizer(path):
    """A word-level tokenizer.json over TEXT's words (plus [UNK] and the end-of-text token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.replace(".", " .").replace(",", " ,").split()))
    vocab = {w: i for i, w in enumerate(["[UNK]", EOS, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("huginn")
    tok = tiny_tokenizer(d)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=32, vocab_size=64, pad_vocab_multiple=64,
                    groups=[[1, 2]], mean_recurrence=4, logit_bias=False, position="rope", mlp="gated_silu",
                    qk_bias=True, scale_embeddings=True, latent_norm=True)
    model = LoopedGPT(cfg)
    save_hf(model, d)
    text = d / "text.txt"
    text.write_text(TEXT)
    return d, text, tok, model


def compose_job(name, *overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def expected_heldout(tok, n):
    """The file's tokens plus the end-of-text id, its last 20% (data.val_fraction=0.2)."""
    ids = tok.encode(TEXT, add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    return np.asarray(ids[len(ids) - round(len(ids) * 0.2):][:n])


def test_evaluate_scores_the_tail_of_the_text_under_its_own_tokenizer(hf_dir, tmp_path):
    from recdepth.analysis.token_files import read_tokens
    from recdepth.evaluate import evaluate

    d, text, tok, model = hf_dir
    out = tmp_path / "e"
    m = evaluate(compose_job("evaluate", f"hf={d}", "data=files", f"data.paths={text}", "data.val_fraction=0.2",
                             f"run_dir={out}", "exit=fixed", "exit.max_steps=3", "eval.tokens=30",
                             "eval.cache=per_step", "eval.latency_tokens=0", "eval.batch_size=1", "device=cpu",
                             "eval.warmup_tokens=0"))
    assert m["hf"] == str(d.resolve())
    want = expected_heldout(tok, 31)
    rec = read_tokens(out / "eval_tokens.csv")
    assert np.array_equal(rec["target"], want[1:])
    assert len(rec["nll"]) == 30 and np.isfinite(rec["nll"]).all()
    assert m["eval"]["mean_applications"] == 3


def test_a_zero_state_model_decodes_exactly_like_its_parallel_forward(hf_dir, tmp_path):
    """With state_init=zero there is no noise, so the decoded NLLs must equal a parallel
    forward of the loaded weights at the same depth, token for token."""
    from recdepth.analysis.token_files import read_tokens
    from recdepth.evaluate import evaluate
    from recdepth.integrations.hf import load_hf

    d, text, tok, model = hf_dir
    z = tmp_path / "zero"
    zm = LoopedGPT(GPTConfig(**{**model.cfg.to_dict(), "state_init": "zero"}))
    zm.load_state_dict(model.state_dict())
    save_hf(zm, z)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (z / f).write_text((d / f).read_text())
    out = tmp_path / "e"
    evaluate(compose_job("evaluate", f"hf={z}", "data=files", f"data.paths={text}", "data.val_fraction=0.2",
                         f"run_dir={out}", "exit=fixed", "exit.max_steps=3", "eval.tokens=30", "eval.cache=per_step",
                         "eval.latency_tokens=0", "device=cpu", "eval.warmup_tokens=0"))
    rec = read_tokens(out / "eval_tokens.csv")
    loaded, _ = load_hf(z)
    ids = torch.as_tensor(expected_heldout(tok, 31))
    with torch.no_grad():
        logits, _ = loaded(ids[None, :-1], loops=[3])
        nll = loaded.nll(logits[0], ids[1:]).double().numpy()
    assert np.allclose(rec["nll"], nll, atol=1e-5)


def test_diagnose_accepts_hf(hf_dir, tmp_path):
    from recdepth.diagnose import diagnose

    d, text, tok, _ = hf_dir
    out = tmp_path / "g"
    m = diagnose(compose_job("diagnose", f"hf={d}", "data=files", f"data.paths={text}", "data.val_fraction=0.2",
                             f"run_dir={out}", "loop_dynamics.sequences=2", "loop_dynamics.seq_len=8",
                             "loop_dynamics.loops=4", "loop_dynamics.pca_tokens=4", "loop_dynamics.figures=false",
                             "device=cpu"))
    assert m["hf"] == str(d.resolve()) and m["global_step"] == 0
    rec = json.loads((out / "diagnostics" / "step_0.json").read_text())
    assert rec["pca"]["token_ids"] == expected_heldout(tok, 4).tolist()
    # Fig. 1's text is the directory's tokenizer's decoding of those ids
    assert rec["pca"]["text"] == tok.decode(rec["pca"]["token_ids"], skip_special_tokens=False)


def test_bad_hf_input_fails_in_one_line(hf_dir, tmp_path):
    from recdepth.evaluate import evaluate

    d, text, _, _ = hf_dir
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in d.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            (bare / f.name).write_bytes(f.read_bytes())
    base = ["data=files", f"data.paths={text}", "eval.tokens=4", "eval.latency_tokens=0", "device=cpu"]
    with pytest.raises(FileNotFoundError, match=r"^hf: .* has no tokenizer\.json"):
        evaluate(compose_job("evaluate", f"hf={bare}", f"run_dir={tmp_path / 'a'}", *base))
    with pytest.raises(ValueError, match=r"config\.json"):
        evaluate(compose_job("evaluate", f"hf={tmp_path}", f"run_dir={tmp_path / 'b'}", *base))
    with pytest.raises(ValueError, match=r"^ckpt: give exactly one of"):
        evaluate(compose_job("evaluate", f"hf={d}", "ckpt=x", f"run_dir={tmp_path / 'c'}", *base))
    with pytest.raises(ValueError, match=r"^data: .* held-out split of"):
        evaluate(compose_job("evaluate", f"hf={d}", f"run_dir={tmp_path / 'd'}", *base[:2], "eval.tokens=100000",
                             "eval.latency_tokens=0", "device=cpu"))


def test_generate_accepts_hf_with_its_tokenizer_and_without_one(hf_dir, tmp_path):
    """The prompt is encoded by the directory's tokenizer.json, and the generated ids are
    the core's greedy decoding of the loaded weights (run here directly); without a
    tokenizer, prompt_ids still work and text fails in one line."""
    from recdepth import exits
    from recdepth.decode.generation import greedy
    from recdepth.decode.settings import DecodeSettings
    from recdepth.generate import generate
    from recdepth.integrations.hf import load_hf

    d, _, tok, _ = hf_dir
    gen = generate(compose_job("generate", f"hf={d}", "prompt='the quick brown fox'", "max_new_tokens=5",
                               "exit=fixed", "exit.max_steps=3", "stream=false", "device=cpu",
                               f"run_dir={tmp_path / 'g'}"))
    ids = tok.encode("the quick brown fox", add_special_tokens=False).ids
    assert gen["prompt_ids"] == ids
    loaded, _ = load_hf(d)
    ref = greedy(loaded, ids, exits.build("fixed", None, max_steps=3), 5, DecodeSettings(cache="latest", seed=1337))
    assert gen["ids"] == ref.ids
    assert gen["text"] == tok.decode(ref.ids, skip_special_tokens=False)

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in d.iterdir():
        if f.suffix in (".json", ".safetensors") and not f.name.startswith("tokenizer"):
            (bare / f.name).write_bytes(f.read_bytes())
    g2 = generate(compose_job("generate", f"hf={bare}", f"prompt_ids={ids}", "max_new_tokens=5", "exit=fixed",
                              "exit.max_steps=3", "stream=false", "device=cpu", f"run_dir={tmp_path / 'g2'}"))
    assert g2["ids"] == ref.ids and g2["text"] is None
    with pytest.raises(ValueError, match=r"^prompt: .*prompt_ids"):
        generate(compose_job("generate", f"hf={bare}", "prompt=hello", "stream=false", "device=cpu",
                             f"run_dir={tmp_path / 'g3'}"))


# ------------------------------------------- calibrate, report, train_gate with hf=
HF_DATA = ["data=files", "data.val_fraction=0.2", "device=cpu"]


def test_calibrate_accepts_hf_test_then_calibration_split_of_the_tail(hf_dir, tmp_path):
    """The test split is the tail's tokens [0, eval.tokens], the calibration split the
    calibration.tokens + 1 after it, both under the directory's tokenizer."""
    from recdepth.analysis.token_files import read_tokens
    from recdepth.calibrate import calibrate

    d, text, tok, _ = hf_dir
    out = tmp_path / "c"
    res = calibrate(compose_job("calibrate", f"hf={d}", f"data.paths={text}", *HF_DATA, f"run_dir={out}",
                                "exit=stepnorm", "exit.max_steps=4", "target.max_ce_increase=0.05", "eval.tokens=30",
                                "calibration.tokens=40", "eval.latency_tokens=0", "eval.warmup_tokens=0"))
    want = expected_heldout(tok, 31 + 41)
    assert res["hf"] == str(d.resolve()) and res["splits"] == {"test": [0, 30], "calibration": [31, 71]}
    assert np.array_equal(read_tokens(out / "eval_tokens.csv")["target"], want[1:31])
    cal = read_tokens(out / "calibration_tokens.csv")
    assert np.array_equal(cal["target"], want[32:72]) and cal["position"].min() >= 31
    assert res["test"]["eval"]["exit"] == "stepnorm" and np.isfinite(res["test"]["eval"]["ce"])


@pytest.mark.parametrize("bos", [False, True])
def test_train_gate_accepts_hf_and_fits_on_the_head_of_the_text(hf_dir, tmp_path, monkeypatch, bos):
    """Every train window is a run of consecutive tokens of the text's head (the part before
    the held-out tail), after the tokenizer's BOS when it names one."""
    import recdepth.train_gate as tg

    d, text, tok, _ = hf_dir
    if bos:  # the same directory, its tokenizer naming the end-of-text token as BOS too
        b = tmp_path / "bos"
        b.mkdir()
        for f in d.iterdir():
            (b / f.name).write_bytes(f.read_bytes())
        (b / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "bos_token": EOS}))
        d = b
    seen = []
    real = tg.decoding_gate_data

    def spy(model, wins, *a, **kw):
        seen.append(wins.clone())
        return real(model, wins, *a, **kw)

    monkeypatch.setattr(tg, "decoding_gate_data", spy)
    meta = tg.train_gate(compose_job("train_gate", f"hf={d}", f"data.paths={text}", *HF_DATA,
                                     f"run_dir={tmp_path / 'g'}", "gate.tokens=96", "gate.max_steps=3"))
    assert meta["hf"] == str(d.resolve()) and (tmp_path / "g" / "gate.pt").is_file()
    ids = tok.encode(TEXT, add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    head = ids[: len(ids) - round(len(ids) * 0.2)]
    (wins,) = seen
    assert wins.shape[1] == 33  # block_size + 1
    for row in wins.tolist():
        if bos:
            assert row[0] == tok.token_to_id(EOS)
            row = row[1:]
        assert any(head[o : o + len(row)] == row for o in range(len(head) - len(row) + 1))


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_report_accepts_hf(hf_dir, tmp_path):
    from recdepth.analysis.token_files import read_tokens
    from recdepth.report import report

    d, text, tok, _ = hf_dir
    out = tmp_path / "r"
    drop = [f"report.rules.{r}=[]" for r in ("stepnorm_rel", "kl", "accel", "accel_rel", "entropy_diff", "cosine")]
    res = report(compose_job("report", f"hf={d}", f"data.paths={text}", *HF_DATA, f"run_dir={out}",
                             "report.max_steps=4", "report.fixed=[1,4]", "report.rules.stepnorm=[0.1]", *drop,
                             "report.patience=[]", "report.gate_tau=[]", "report.calibrate=[stepnorm]",
                             "eval.tokens=30", "calibration.tokens=40", "eval.latency_tokens=4",
                             "eval.warmup_tokens=0", "calibration.max_evals=4"))
    assert res["hf"] == str(d.resolve())
    want = expected_heldout(tok, 31)
    jobs = sorted((p for p in (out / "jobs").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == 2 + 1 + 1 + 2  # fixed 1 and 4, the oracle, stepnorm, stepnorm calibrated to two targets
    for j in jobs:
        assert np.array_equal(read_tokens(j / "eval_tokens.csv")["target"], want[1:])
    assert (out / "report.md").read_text().startswith(f"# Exit rules compared on {d}")
