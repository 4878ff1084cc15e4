"""The real CLI: `python -m recdepth.train` runs and `--multirun` sweeps into temp dirs."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tiny but real: the shipped corpus, the paper's groups, every stage of a run.
TINY = ["batch_size=2", "sampler.mean=2", "sampler.backprop_depth=1", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.checkpoint_every=3", "data.val_tokens=512",
        "eval.tokens=6", "eval.warmup_tokens=1", "trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = dict(os.environ)
    e["RECDEPTH_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])  # this checkout's code
    e["WANDB_MODE"] = "offline"
    e.pop("WANDB_API_KEY", None)
    return e


def run(args, cwd, env, check=True):
    p = subprocess.run([sys.executable, "-m", "recdepth.train", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def test_cli_run_writes_config_checkpoint_and_metrics(tmp_path, env):
    # Run from an unrelated working directory: conf/ must be found from the package.
    run(["model=grouped", "exit=accel", "exit.tau=1e-2", *TINY], cwd=tmp_path, env=env)
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json")]
    m = json.loads((run_dir / "metrics.json").read_text())
    for key in ("val_ce", "val_ppl", "unigram_ce", "train_seconds", "tokens_seen"):
        assert isinstance(m[key], float | int), key
    assert m["tokens_seen"] == 3 * 2 * 128
    assert abs(m["val_ppl"] - 2.718281828459045 ** m["val_ce"]) < 1e-3 * m["val_ppl"]
    ev = m["eval"]
    assert ev["exit"] == "accel" and ev["tau"] == 1e-2 and ev["tokens"] == 6
    assert len(ev["applications_per_token"]) == 3
    assert all(3 <= a <= 32 for a in ev["applications_per_token"])  # accel exits at n >= 3
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    cfg = (run_dir / "config.yaml").read_text()
    assert "groups:" in cfg and "${" not in cfg  # resolved
    assert (run_dir / "csv" / "metrics.csv").is_file()
    # The checkpoint loads back, with the map from the compact vocabulary to GPT-2 ids.
    from recdepth.lit import LoopedLM
    from recdepth.tokenizer import gpt2

    mod = LoopedLM.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                                        weights_only=False)
    v = mod.vocab_to_gpt2
    assert v is not None and len(v) == mod.config.vocab_size
    assert int(v[-1]) == 50256 and gpt2().decode(v[:5].tolist())  # sorted ids, EOT last
    assert mod.model.lm_bias is not None and mod.model.lm_bias.abs().sum() > 0


def test_multirun_sweep_gives_each_job_its_own_tau(tmp_path, env):
    sweep = tmp_path / "sweep"
    # The README's form: overrides on both sides of --multirun.
    run(["model=grouped", "exit=accel", f"hydra.sweep.dir={sweep}", *TINY, "--multirun",
         "exit.tau=1e-4,1e-2"], cwd=tmp_path, env=env)
    taus = {}
    for job in ("0", "1"):
        m = json.loads((sweep / job / "metrics.json").read_text())
        taus[job] = m["eval"]["tau"]
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
    assert taus == {"0": 1e-4, "1": 1e-2}


@pytest.mark.parametrize("model, n_groups", [("baseline", 0), ("single", 1)])
def test_other_models_train(tmp_path, env, model, n_groups):
    run([f"model={model}", f"run_dir={tmp_path / 'run'}", *TINY], cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["model"] == model and len(m["eval"]["applications_per_token"]) == n_groups


def test_groups_override_on_the_command_line(tmp_path, env):
    run(["model.groups=[[3],[4,5]]", f"run_dir={tmp_path / 'run'}", *TINY], cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["groups"] == [[3], [4, 5]]


@pytest.mark.parametrize("override, message", [
    ("model.groups=[[4],[4,5]]", "model.groups"),
    ("exit.tau=-1", "exit.tau"),
    ("exit=nonsense", "exit"),
    ("model.n_head=3", "model.n_embd"),
    ("data=files", "data.paths: required"),
    ("sampler.backprop_depth=0", "sampler.backprop_depth"),
])
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, env, override, message):
    p = run(["exit=accel", f"run_dir={tmp_path / 'run'}", *TINY, override], cwd=tmp_path, env=env,
            check=False)  # the bad override last, so nothing in TINY overrides it
    assert p.returncode != 0
    assert message in p.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before any work


def test_existing_results_are_not_overwritten(tmp_path, env):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.json").write_text('{"mine": 1}')
    p = run([f"run_dir={rd}", *TINY], cwd=tmp_path, env=env, check=False)
    assert p.returncode != 0 and "already holds" in p.stderr
    assert json.loads((rd / "metrics.json").read_text()) == {"mine": 1}


def test_wandb_logger_runs_offline_without_network(tmp_path, env):
    e = dict(env)
    e.pop("WANDB_MODE")
    e["WANDB_API_KEY"] = "x" * 40
    e["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens: `auto` must go offline
    run(["logger=wandb", f"run_dir={tmp_path / 'run'}", *TINY], cwd=tmp_path, env=e)
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_wheel_ships_the_configs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    (whl,) = tmp_path.glob("recdepth-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in ("recdepth/conf/config.yaml", "recdepth/conf/model/grouped.yaml",
              "recdepth/conf/exit/accel.yaml", "recdepth/assets/gpt2.tiktoken.xz",
              "recdepth/assets/shakespeare.jsonl.xz", "recdepth/train.py"):
        assert f in names, f


@pytest.mark.slow
def test_paper_size_runs_on_cpu(tmp_path, env):
    """`model.size=paper trainer.max_steps=2` with a small batch: the paper's 12L/12H/d=768,
    block 512, r=12, k=8 model trains two steps, validates and decodes on a CPU."""
    rd = tmp_path / "run"
    run(["model.size=paper", "trainer.max_steps=2", "batch_size=1", "data.val_tokens=1024",
         "eval.tokens=4", "eval.warmup_tokens=1", "trainer.enable_progress_bar=false",
         f"run_dir={rd}"], cwd=tmp_path, env=env)
    m = json.loads((rd / "metrics.json").read_text())
    assert m["tokens_seen"] == 2 * 1 * 512 and m["params"] > 80e6
    cfg = (rd / "config.yaml").read_text()
    assert "size: paper" in cfg
