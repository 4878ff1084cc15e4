"""`--model recdepth` in EleutherAI's lm-evaluation-harness (recdepth/app/lm_eval.py), run
offline on the local tasks of tests/fixtures/lm_eval (task YAMLs over JSONL files, no hub).

Every number is checked against recdepth's own engine called directly here on the same
text, tokenized here with the checkpoint's codec: a rolling log-likelihood is the summed
NLL `scoring.evaluate_exit` gives the text alone (what `recdepth.evaluate` computes on a
held-out stream); a multiple-choice log-likelihood is the summed NLL of the choice's
tokens after its context, each (context + choice) decoded alone at batch 1; a generation
is `generation.greedy` from the same prompt ids, cut at the stop string; the applications
per task are the mean of those references' applications."""

import json
import subprocess
import sys
from pathlib import Path

import lm_eval  # the [eval] extra; `make test` installs it with [dev]
import numpy as np
import pytest
import torch

from recdepth.app.checkpoints import open_model
from recdepth.app.jobs import for_model
from recdepth.app.prompts import codec_of
from recdepth.config.schema import ModelJob
from recdepth.decode.generation import greedy
from recdepth.decode.scoring import evaluate_exit
from recdepth.decode.settings import DecodeSettings
from recdepth.exits import build

TASKS = Path(__file__).parents[1] / "fixtures" / "lm_eval"
RULE = dict(exit="kl", tau=0.1, max_steps=6)  # 2 to 4 applications per token on the tiny model
pytestmark = pytest.mark.usefixtures("one_thread")


def reference(tiny_ckpt):
    opened = open_model(ModelJob(ckpt=str(tiny_ckpt), device="cpu"), torch.device("cpu"))
    policy = for_model(build(RULE["exit"], RULE["tau"], max_steps=RULE["max_steps"]), opened)
    return opened.model.eval(), codec_of(opened), policy


def score(model, policy, ids):
    """NLL and applications of ids[1:] given what precedes each, the text alone at batch 1."""
    _, rec = evaluate_exit(model, torch.as_tensor(ids), policy, len(ids) - 1,
                           DecodeSettings(warmup_tokens=0, seed=0, batch_size=1, latency_tokens=0))
    return rec


@pytest.fixture(scope="module")
def run(tiny_ckpt, ckpt_env, tmp_path_factory):
    from lm_eval.tasks import TaskManager

    import recdepth.app.lm_eval  # noqa: F401  (registers --model recdepth)

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(TASKS)  # the YAMLs name their JSONL files relative to here
        out = lm_eval.simple_evaluate(
            model="recdepth", model_args={"ckpt": str(tiny_ckpt), **RULE}, device="cpu",
            tasks=["recdepth_rolling", "recdepth_choice", "recdepth_gen"], batch_size=3, log_samples=True,
            task_manager=TaskManager(include_path=str(TASKS)))
    return out


def test_rolling_loglikelihood_is_the_engines_nll_of_the_text_alone(run, tiny_ckpt):
    model, codec, policy = reference(tiny_ckpt)
    texts = [json.loads(line)["text"] for line in (TASKS / "docs.jsonl").read_text().splitlines()]
    samples = sorted(run["samples"]["recdepth_rolling"], key=lambda s: s["doc_id"])
    assert len(samples) == len(texts)
    for s, text in zip(samples, texts, strict=True):
        ids = codec.encode(text)[0]
        ll = float(np.ravel(s["resps"])[0])
        assert ll == pytest.approx(-score(model, policy, ids)["nll"].sum(), rel=1e-5, abs=1e-4)
    assert run["results"]["recdepth_rolling"]["word_perplexity,none"] > 1


def test_choice_loglikelihoods_greedy_flags_and_applications_per_task(run, tiny_ckpt):
    model, codec, policy = reference(tiny_ckpt)
    docs = [json.loads(line) for line in (TASKS / "choice.jsonl").read_text().splitlines()]
    samples = sorted(run["samples"]["recdepth_choice"], key=lambda s: s["doc_id"])
    apps = []
    for s, doc in zip(samples, docs, strict=True):
        for resp, choice in zip(s["resps"], doc["choices"], strict=True):
            ctx = codec.encode(doc["context"])[0]
            whole = codec.encode(doc["context"] + " " + choice)[0]  # lm_eval's target delimiter: one space
            rec = score(model, policy, whole)
            k = len(whole) - len(ctx)  # the choice's tokens: the last k targets
            ll, is_greedy = resp[0]
            assert ll == pytest.approx(-rec["nll"][-k:].sum(), rel=1e-5, abs=1e-4)
            assert is_greedy == bool(rec["correct"][-k:].all())
            apps.append(rec["apps"][-k:])
    a = np.concatenate(apps)
    info = run["config"]["recdepth"]["tasks"]["recdepth_choice"]
    assert info["tokens"] == len(a)
    # float32: a batch of 3 rounds like batch 1 up to ~1e-7, so at most a token or two can
    # sit on the other side of τ
    assert np.abs(np.asarray(info["mean_applications"]) - a.mean(0)).max() <= 2 / len(a)
    assert len(set(a.reshape(-1).tolist())) > 1  # the rule does vary the depth here
    assert run["config"]["recdepth"]["exit"] == RULE["exit"]


def test_generate_until_is_greedy_under_the_rule_cut_at_the_stop(run, tiny_ckpt):
    model, codec, policy = reference(tiny_ckpt)
    docs = [json.loads(line) for line in (TASKS / "gen.jsonl").read_text().splitlines()]
    samples = sorted(run["samples"]["recdepth_gen"], key=lambda s: s["doc_id"])
    for s, doc in zip(samples, docs, strict=True):
        gen = greedy(model, codec.encode(doc["context"])[0], policy, 8)
        text = codec.decode(gen.ids)
        assert s["resps"][0][0] == text.split("\n")[0]
    assert run["config"]["recdepth"]["tasks"]["recdepth_gen"]["tokens"] == 8 * len(docs)


def test_bad_model_args_fail_in_one_line(tiny_ckpt):
    from recdepth.app.lm_eval import RecdepthLM

    with pytest.raises(ValueError) as e:
        RecdepthLM(ckpt=str(tiny_ckpt), device="cpu", taus=0.1)  # a typo'd key
    assert "model_args: unknown key 'taus'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError) as e:
        RecdepthLM(ckpt=str(tiny_ckpt), hf="x", device="cpu")
    assert str(e.value).startswith("ckpt: give exactly one of")
    with pytest.raises(ValueError) as e:
        RecdepthLM(ckpt=str(tiny_ckpt), device="cpu", batch_size="auto")
    assert str(e.value).startswith("batch_size:")


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_the_command_line_writes_results_with_applications(tiny_ckpt, env, tmp_path):
    """`recdepth lm-eval` is lm_eval's command line with the model registered: a real run
    in a subprocess writes lm_eval's results file with the recdepth block."""
    args = [sys.executable, "-m", "recdepth", "lm-eval", "--model", "recdepth", "--model_args",
            f"ckpt={tiny_ckpt},exit=fixed,max_steps=2", "--device", "cpu", "--tasks", "recdepth_choice",
            "--include_path", str(TASKS), "--output_path", str(tmp_path / "out"), "--batch_size", "2"]
    p = subprocess.run(args, cwd=TASKS, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert len(files) == 1
    res = json.loads(files[0].read_text())
    block = res["config"]["recdepth"]["tasks"]["recdepth_choice"]
    assert block["mean_applications"] == [2.0] * len(res["config"]["recdepth"]["groups"])
    assert 0 <= res["results"]["recdepth_choice"]["acc,none"] <= 1
    assert "recdepth_choice" in p.stdout  # lm_eval's table
