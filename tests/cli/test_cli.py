"""The real CLI: `python -m recdepth.train` runs and `--multirun` sweeps into temp dirs."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import TINY, run


# Tiny but real: the shipped corpus, the paper's groups, every stage of a run
# (conf/debug/tiny.yaml; overrides given beside it win over its values).
def test_cli_run_writes_config_checkpoint_and_metrics(tmp_path, env):
    # Run from an unrelated working directory: conf/ must be found from the package.
    run(["model=grouped", "exit=accel", "exit.tau=1e-2", *TINY], cwd=tmp_path, env=env)
    (job_dir,) = [p.parent for p in (tmp_path / "outputs").glob("*/*/metrics.json")]
    m = json.loads((job_dir / "metrics.json").read_text())
    # The training run lives in outputs/runs/<identity>, linked from the job dir as train/.
    run_dir = Path(m["train_dir"])
    assert run_dir == tmp_path / "outputs" / "runs" / m["identity"] and (job_dir / "train").resolve() == run_dir
    assert json.loads((run_dir / "trained.json").read_text())["val_ce"] == m["val_ce"]
    for key in ("val_ce", "val_ppl", "unigram_ce", "train_seconds", "tokens_seen"):
        assert isinstance(m[key], float | int), key
    assert m["tokens_seen"] == 3 * 2 * 128
    assert abs(m["val_ppl"] - 2.718281828459045 ** m["val_ce"]) < 1e-3 * m["val_ppl"]
    ev = m["eval"]
    assert ev["exit"] == "accel" and ev["tau"] == 1e-2 and ev["tokens"] == 6
    assert len(ev["applications_per_token"]) == 3
    assert all(3 <= a <= 32 for a in ev["applications_per_token"])  # accel exits at n >= 3
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    cfg = (job_dir / "config.yaml").read_text()
    assert "groups:" in cfg and "${" not in cfg  # resolved
    assert (job_dir / "eval_tokens.csv").is_file()
    assert (run_dir / "csv" / "metrics.csv").is_file()
    # The checkpoint loads back, with the map from the compact vocabulary to GPT-2 ids.
    from recdepth.data.tokenizer import gpt2
    from recdepth.training.lit import LoopedLM

    mod = LoopedLM.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                                        weights_only=True)  # plain data only: loads without unpickling code
    v = mod.vocab_to_gpt2
    assert v is not None and len(v) == mod.config.vocab_size
    # sorted train-split ids, EOT the last of them, then the shared "other" entry (-1)
    assert int(v[-2]) == 50256 and int(v[-1]) == -1 and gpt2().decode(v[:5].tolist())
    assert mod.config.n_other == 50257 - (len(v) - 1)
    assert mod.model.lm_bias is not None and mod.model.lm_bias.abs().sum() > 0


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_run_writes_loop_diagnostics_and_figures(tmp_path, env):
    """Diagnostics at step 0, at every checkpoint and at the end; the four figures; and
    `python -m recdepth.figures` redraws them from the JSON alone."""
    run(["model=grouped", "exit=accel", f"run_dir={tmp_path / 'run'}", *TINY, "trainer.max_steps=4",
         "trainer.checkpoint_every=2"], cwd=tmp_path, env=env)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    rd = Path(m["train_dir"])
    steps = sorted(int(p.stem[5:]) for p in (rd / "diagnostics").glob("step_*.json"))
    assert steps == [0, 2, 4]
    d = json.loads((rd / "diagnostics" / "step_4.json").read_text())
    assert d["global_step"] == 4 and d["loops"] == 30 and [g["name"] for g in d["groups"]] == ["4", "5-6", "7"]
    assert [b["name"] for b in d["dlr"]] == ["4→5-6", "5-6→7"] and d["batch"]["tokens"] == 4 * 128
    assert d["pca"]["text"]  # the sequence Fig. 1 shows, decoded
    figs = {p.name for p in (rd / "figures").iterdir()}
    assert figs == {f"{f}.{x}" for f in ("fig1_pca", "fig2_dlr", "fig3_loop_dynamics", "fig5_cosines")
                    for x in ("png", "pdf")}
    assert 0 < m["diagnostics_seconds"] < m["train_seconds"]
    only = tmp_path / "only_json"
    (only / "diagnostics").mkdir(parents=True)
    for p in (rd / "diagnostics").glob("step_*.json"):
        (only / "diagnostics" / p.name).write_bytes(p.read_bytes())
    p = subprocess.run([sys.executable, "-m", "recdepth.figures", str(only)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert {Path(f).name for f in p.stdout.split()} == figs


def test_multirun_sweep_gives_each_job_its_own_tau(tmp_path, env):
    sweep = tmp_path / "sweep"
    # The README's form: overrides on both sides of --multirun.
    run(["model=grouped", "exit=accel", f"hydra.sweep.dir={sweep}", *TINY, "--multirun",
         "exit.tau=1e-4,1e-2"], cwd=tmp_path, env=env)
    taus = {}
    for job in ("0", "1"):
        m = json.loads((sweep / job / "metrics.json").read_text())
        taus[job] = m["eval"]["tau"]
    assert taus == {"0": 1e-4, "1": 1e-2}
    # Trained once (job 0), evaluated twice.
    a, b = (json.loads((sweep / j / "metrics.json").read_text()) for j in ("0", "1"))
    assert a["train_dir"] == b["train_dir"] and (Path(a["train_dir"]) / "checkpoints" / "last.ckpt").is_file()
    assert "reused" not in a and b["reused"] is True


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_sweep_trains_once_and_aggregates_with_a_failed_job(tmp_path, env, cli_here):
    """exit settings are not part of a training run's identity: a sweep over them trains
    once; a job that fails (τ = −1) is recorded as failed and the others are aggregated."""
    sweep = tmp_path / "sweep"
    p = run(["model=grouped", f"hydra.sweep.dir={sweep}", *TINY, "--multirun", "exit=accel,stepnorm",
             "exit.tau=1e-2,-1"], cwd=tmp_path, env=env, check=False)
    assert p.returncode == 1 and "2 job(s) failed" in p.stderr
    import csv

    rows = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert [(r["job"], r["exit"], r["status"]) for r in rows] == [
        ("0", "accel", "ok"), ("1", "accel", "failed"), ("2", "stepnorm", "ok"), ("3", "stepnorm", "failed")]
    assert "exit.tau" in rows[1]["error"] and rows[0]["reused"] == "False" and rows[2]["reused"] == "True"
    assert len(rows[0]["applications_per_token"].split()) == 3 and float(rows[0]["ce"]) > 0
    assert (sweep / "fig4_exits.png").is_file() and (sweep / "fig4_exits.pdf").is_file()
    md = (sweep / "sweep_results.md").read_text()
    assert md.count("\n") == 2 + 4 and "failed: " in md
    # Trained once: one training dir; job 2 says it reused it.
    (train_dir,) = [d for d in (tmp_path / "outputs" / "runs").iterdir() if d.is_dir()]
    e = json.loads((train_dir / "trained.json").read_text())
    m2 = json.loads((sweep / "2" / "metrics.json").read_text())
    assert m2["reused"] is True and m2["train_dir"] == str(train_dir) and m2["val_ce"] == e["val_ce"]
    assert "reuse: training identity" in p.stderr + p.stdout

    # `recdepth.evaluate` on that checkpoint reproduces the training run's eval block.
    ev_sweep = tmp_path / "ev"
    run_eval = [sys.executable, "-m", "recdepth.evaluate", f"ckpt={sweep / '0' / 'train' / 'checkpoints' / 'last.ckpt'}",
                "eval.tokens=6", "eval.warmup_tokens=1", f"hydra.sweep.dir={ev_sweep}", "--multirun",
                "exit=accel,stepnorm", "exit.tau=1e-2"]
    q = subprocess.run(run_eval, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-2000:]
    for job, train_job in (("0", "0"), ("1", "2")):
        a = json.loads((ev_sweep / job / "metrics.json").read_text())["eval"]
        b = json.loads((sweep / train_job / "metrics.json").read_text())["eval"]
        assert (a["exit"], a["tau"], a["applications_per_token"]) == (b["exit"], b["tau"], b["applications_per_token"])
        assert a["ce"] == pytest.approx(b["ce"], rel=1e-9)
    assert len(list(csv.DictReader(open(ev_sweep / "sweep_results.csv")))) == 2
    # One exit value per group is checked against the checkpoint's groups (3), before any work.
    code, err, _ = cli_here("recdepth.evaluate", [run_eval[3], "exit=cosine", "exit.tau=[1e-2,1e-3]",
                                               f"run_dir={tmp_path / 'ev_bad'}"], tmp_path)
    assert code != 0 and "exit.tau: a list of 2 for 3 recurrence groups" in err, err[-2000:]
    assert not (tmp_path / "ev_bad").exists()


@pytest.mark.parametrize("args, message", [
    (["ckpt=/nonexistent/last.ckpt"], "ckpt: no checkpoint file at /nonexistent/last.ckpt"),
    ([], "ckpt: give exactly one of ckpt=<training checkpoint> or hf=<Hugging Face checkpoint directory>"),
    (["ckpt=/etc/hostname"], "is not a readable Lightning checkpoint"),
])
def test_evaluate_refuses_bad_checkpoints(tmp_path, cli_here, args, message):
    code, err, _ = cli_here("recdepth.evaluate", [*args, f"run_dir={tmp_path / 'ev'}"], tmp_path)
    assert code != 0 and message in err and err.count("\n") == 1
    assert not (tmp_path / "ev" / "metrics.json").exists()


class _Payload:
    """Unpickling this runs code: it creates the file named by `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_evaluate_refuses_a_checkpoint_that_would_run_code(tmp_path, env):
    import torch

    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "x": _Payload(str(marker))}, evil)
    p = subprocess.run([sys.executable, "-m", "recdepth.evaluate", f"ckpt={evil}", f"run_dir={tmp_path / 'ev'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "refused (recdepth loads checkpoints with weights_only=True)" in p.stderr
    assert not marker.exists()  # the payload never ran
    # The same file under a plain pickle load would have run it: the test's payload is real.
    torch.load(evil, weights_only=False)
    assert marker.exists()


# single: slow (default-suite time); model=grouped trains in the tests above, baseline here
@pytest.mark.parametrize("model, n_groups", [("baseline", 0), pytest.param("single", 1, marks=pytest.mark.slow)])
def test_other_models_train(tmp_path, cli_here, model, n_groups):
    code, err, _ = cli_here("recdepth.train", [f"model={model}", f"run_dir={tmp_path / 'run'}", *TINY], tmp_path)
    assert code == 0, err[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["model"] == model and len(m["eval"]["applications_per_token"]) == n_groups
    # Loop diagnostics: on for recurrent models, absent for the baseline.
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(tmp_path / "run" / "config.yaml")
    assert (cfg.callbacks.loop_dynamics is not None) == (n_groups > 0)
    assert (tmp_path / "run" / "train" / "diagnostics").is_dir() == (n_groups > 0)


def test_groups_override_on_the_command_line(tmp_path, cli_here):
    code, err, _ = cli_here("recdepth.train", ["model.groups=[[3],[4,5]]", f"run_dir={tmp_path / 'run'}", *TINY],
                            tmp_path)
    assert code == 0, err[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["groups"] == [[3], [4, 5]]


@pytest.mark.parametrize("override, message", [
    ("model.groups=[[4],[4,5]]", "model.groups"),
    ("exit.tau=-1", "exit.tau"),
    ("model.n_head=3", "model.n_embd"),
    ("data=files", "data.paths: required"),
    ("sampler.backprop_depth=0", "sampler.backprop_depth"),
    ("callbacks.loop_dynamics.loops=2", "callbacks.loop_dynamics.loops: expected >= 3"),
    ("callbacks.loop_dynamics.seq_len=1000", "callbacks.loop_dynamics.seq_len: expected 2..128"),
    ("model=baseline callbacks=loop_dynamics", "callbacks.loop_dynamics: model=baseline has no recurrence groups"),
    ("trainer.max_steps=0", "trainer.max_steps: expected an integer >= 1, got 0"),
    ("optim.lr=-1", "optim.lr: expected a finite number > 0, got -1.0"),
    ("optim.betas=[0.9,1.5]", "optim.betas: expected two numbers in [0, 1)"),
    ("eval.cache=shared", "eval.cache: expected one of latest, per_step, got 'shared'"),
    ("exit=accel exit.min_steps=5 exit.max_steps=3", "exit.max_steps: 3 is smaller than exit.min_steps=5"),
    ("exit.tau=nan", "exit.tau: expected a finite number > 0"),
    ("sampler.name=bogus", "sampler.name: unknown sampler 'bogus'"),
    ("model.block_size=100000", "longer than the val split"),
    ("model.size=huge", "model.size: unknown size 'huge'"),
    ("data=files data.paths=/nonexistent/*.txt", "data.paths: no file matches '/nonexistent/*.txt'"),
    ("trainer.precision=bf16", "trainer.precision: expected one of 32-true, bf16-mixed"),
    ("trainer.strategy=fsdp", "trainer.strategy: expected one of auto, ddp, got 'fsdp'"),
    ("trainer.devices=2", "trainer.devices: 2 processes need trainer.strategy=ddp (trainer=ddp)"),
    ("trainer=ddp trainer.num_nodes=2", "trainer.num_nodes: recdepth runs on one node (got 2)"),
])
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, env, monkeypatch, override, message):
    """The bad-input matrix, in-process: compose the config as the CLI does (Hydra's
    compose API), call train(cfg); one line naming the field, before any work."""
    from hydra import compose, initialize_config_dir

    from recdepth.config.build import conf_dir
    from recdepth.train import train

    monkeypatch.chdir(tmp_path)
    for k in ("RECDEPTH_CACHE", "WANDB_MODE"):
        monkeypatch.setenv(k, env[k])
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["exit=accel", f"run_dir={tmp_path / 'run'}", *TINY, *override.split()])
    with pytest.raises(Exception) as e:
        train(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.glob("outputs/runs/*/checkpoints"))  # failed before any training


@pytest.mark.parametrize("override, message", [
    ("exit=nonsense", "exit"),  # Hydra's own refusal; an unknown key and a range, as the CLI prints them
    ("foo=1", "error: foo: no such key in the config"),
    ("optim.betas=[0.9,1.5]", "optim.betas: expected two numbers in [0, 1)"),
])
def test_bad_input_on_the_command_line(tmp_path, cli_here, override, message):
    code, err, _ = cli_here("recdepth.train", ["exit=accel", f"run_dir={tmp_path / 'run'}", *TINY, *override.split()],
                         tmp_path)
    assert code != 0
    assert message in err
    assert not list(tmp_path.glob("outputs/runs/*/checkpoints"))  # failed before any training


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: trainer=gpu is valid")
def test_trainer_gpu_without_a_gpu_fails_fast(tmp_path, cli_here):
    code, err, _ = cli_here("recdepth.train", ["trainer=gpu", f"run_dir={tmp_path / 'run'}", *TINY], tmp_path)
    assert code != 0
    assert "trainer.accelerator: gpu asked for, but torch" in err and "sees no CUDA device" in err
    assert not list(tmp_path.glob("outputs/runs/*/checkpoints"))


def test_a_diverging_run_stops_with_a_clear_message(tmp_path, cli_here):
    rd = tmp_path / "run"
    code, err, _ = cli_here("recdepth.train", [f"run_dir={rd}", *TINY, "callbacks=none", "optim.lr=1e30",
                                            "optim.warmup_steps=1"], tmp_path)
    assert code != 0 and "training diverged and was stopped" in err
    assert "no checkpoint had been written yet" in err or "the last good checkpoint is" in err
    assert not (rd / "metrics.json").exists()  # no NaN results written as if they were real


def test_existing_results_are_not_overwritten(tmp_path, env):
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "metrics.json").write_text('{"mine": 1}')
    p = run([f"run_dir={rd}", *TINY], cwd=tmp_path, env=env, check=False)
    assert p.returncode != 0 and "already holds" in p.stderr
    assert json.loads((rd / "metrics.json").read_text()) == {"mine": 1}


def test_a_run_dir_in_use_is_refused(tmp_path, env):
    """Two runs started in the same second share a Hydra run dir: the second is refused
    (a real second process: the lock is the first one's)."""
    from filelock import FileLock

    rd = tmp_path / "run"
    rd.mkdir()
    with FileLock(rd / ".lock"):
        p = run([f"run_dir={rd}", *TINY], cwd=tmp_path, env=env, check=False)
    assert p.returncode != 0 and f"run_dir: {rd} is in use by another recdepth run" in p.stderr
    assert not (rd / "config.yaml").exists()


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_wandb_logger_runs_offline_without_network(tmp_path, env):
    e = dict(env)
    e.pop("WANDB_MODE")
    e["WANDB_API_KEY"] = "x" * 40
    e["WANDB_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens: `auto` must go offline
    p = run(["logger=wandb", "logger.wandb.init_timeout=2", f"run_dir={tmp_path / 'run'}", *TINY], cwd=tmp_path, env=e)
    assert "wandb: no answer from the server" in p.stdout + p.stderr and "wandb: offline mode" in p.stdout + p.stderr
    (wb,) = (tmp_path / "run" / "train" / "wandb").glob("offline-run-*")
    assert (tmp_path / "run" / "metrics.json").is_file()
    # Loop dynamics on the dashboard: the PCA image and per-k / DLR curves at steps 0 and 3.
    media = wb / "files" / "media"
    assert len(list(media.glob("images/loop_dynamics/pca_*.png"))) == 2
    assert len(list(media.glob("table/loop_dynamics/step_norm_g5-6_table_*.table.json"))) == 2
    *_, last = sorted(media.glob("table/loop_dynamics/dlr_table_*.table.json"), key=lambda p: int(p.name.split("_")[2]))
    t = json.loads(last.read_text())
    d0 = json.loads((tmp_path / "run" / "train" / "diagnostics" / "step_0.json").read_text())
    assert [0, "4→5-6", d0["dlr"][0]["mean"]] in t["data"] and {r[0] for r in t["data"]} == {0, 3}


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_sweep_summary_goes_to_a_wandb_table_offline(tmp_path, env):
    sweep = tmp_path / "sweep"
    run(["logger=wandb", "callbacks=none", "eval.tokens=4", f"hydra.sweep.dir={sweep}", *TINY, "--multirun",
         "exit=accel", "exit.tau=1e-3,1e-2"], cwd=tmp_path, env=env)
    (table,) = sweep.glob("wandb/offline-run-*/files/media/table/sweep/results_*.table.json")
    t = json.loads(table.read_text())
    col = {c: i for i, c in enumerate(t["columns"])}
    assert [(r[col["job"]], r[col["exit"]], r[col["tau"]], r[col["status"]]) for r in t["data"]] == [
        (0, "accel", 1e-3, "ok"), (1, "accel", 1e-2, "ok")]
    m1 = json.loads((sweep / "1" / "metrics.json").read_text())
    assert t["data"][1][col["ce"]] == pytest.approx(m1["eval"]["ce"])


def test_wheel_ships_the_configs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    (whl,) = tmp_path.glob("recdepth-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    for f in ("recdepth/conf/config.yaml", "recdepth/conf/model/grouped.yaml",
              "recdepth/conf/callbacks/loop_dynamics.yaml", "recdepth/exits/rules/builtin.py",
              "recdepth/data/tasks/hops.py", "recdepth/data/sources/shakespeare.py",
              "recdepth/conf/evaluate.yaml",
              "recdepth/assets/gpt2.tiktoken.xz",
              "recdepth/assets/shakespeare.jsonl.xz", "recdepth/train.py"):
        assert f in names, f
    # and the installed package finds them where conf_dir() looks, composing the default run
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    code = ("import recdepth, recdepth.config.build as c; from hydra import compose, initialize_config_dir; "
            f"assert recdepth.__file__.startswith({str(site)!r}), recdepth.__file__; "
            "initialize_config_dir(c.conf_dir(), version_base='1.3'); "
            "print(c.conf_dir(), compose('config', overrides=['experiment=paper']).model.size)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == [str(site / "recdepth" / "conf"), "paper"]


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
    # Loop diagnostics at 30 loops on 4 x 512 tokens, one row per capture (the memory bound).
    d = json.loads((rd / "train" / "diagnostics" / "step_2.json").read_text())
    assert d["batch"] == {"sequences": 4, "seq_len": 512, "tokens": 2048, "rows_per_pass": 1}


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_frontier_sweep_compares_every_rule_with_the_fixed_depths_and_the_oracle(tmp_path, env):
    """`hydra/sweeper=frontier` (what `make frontier` runs): one multirun of recdepth.evaluate
    with the fixed grid, the rules and the oracle; the summary's frontier.csv is built from
    the jobs' own per-token files and agrees with their metrics."""
    import csv

    import numpy as np

    rd = tmp_path / "job"
    run([f"run_dir={rd}", "callbacks=none", *TINY], cwd=tmp_path, env=env)
    sweep = tmp_path / "frontier"
    q = subprocess.run(
        [sys.executable, "-m", "recdepth.evaluate", "--multirun", "hydra/sweeper=frontier",
         f"ckpt={rd / 'train' / 'checkpoints' / 'last.ckpt'}", f"hydra.sweep.dir={sweep}", "eval.tokens=40",
         "eval.latency_tokens=4", "eval.repeats=2", "eval.warmup_tokens=1", "hydra.sweeper.fixed=[1,2,4]",
         "hydra.sweeper.rules.accel=[0.5]",
         "hydra.sweeper.rules.stepnorm=[1.0]", "hydra.sweeper.rules.kl=[]", "hydra.sweeper.oracle=[0.01]",
         "hydra.sweeper.warm_start=false",  # the warm-start family: tests/decode/test_warm_start.py
         "exit.max_steps=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert q.returncode == 0, q.stderr[-3000:]
    jobs = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert [(r["exit"], r["max_steps"], r["tau"]) for r in jobs] == [
        ("fixed", "1", ""), ("fixed", "2", ""), ("fixed", "4", ""), ("stepnorm", "4", "1.0"),
        ("accel", "4", "0.5"), ("oracle", "4", "0.01")]
    assert all(r["status"] == "ok" for r in jobs)
    for r in jobs:  # every job wrote its per-token record: 40 tokens
        assert len((sweep / r["job"] / "eval_tokens.csv").read_text().splitlines()) == 41
    fixed = {int(r["max_steps"]): float(r["ce"]) for r in jobs if r["exit"] == "fixed"}
    front = list(csv.DictReader(open(sweep / "frontier.csv")))
    assert [r["exit"] for r in front] == ["stepnorm", "accel", "oracle"]
    # the oracle is named for what it is (it reads the target; no bound on per-group rules),
    # and the Holm column covers the two rules, not the oracle
    assert front[2]["verdict"].startswith("oracle (best uniform depth within ε; reads the target: unreachable")
    assert front[2]["verdict_holm"] == "" and all(front[i]["verdict_holm"] for i in (0, 1))
    # a check's price (spec §4b): its statistic over one layer's matmuls, 24d² at the cpu size's d = 128;
    # stepnorm's 3d, accel's 4d; the oracle checks nothing
    price = {"stepnorm": 3 * 128 / (24 * 128 * 128), "accel": 4 * 128 / (24 * 128 * 128), "oracle": 0.0}
    for f in front:  # cost: outside + Σ_g |g| · applications_g + the checks (none at max_steps 4)
        job = next(r for r in jobs if r["job"] == f["job"])
        layers, outside = [int(x) for x in job["group_layers"].split()], int(job["outside_layers"])
        assert (layers, outside) == ([1, 2, 1], 8)  # groups [[4], [5, 6], [7]] of 12 layers

        def cost(n, outside=outside, layers=layers):
            return outside + n * sum(layers)

        t = list(csv.DictReader(open(sweep / f["job"] / "eval_tokens.csv")))
        apps = [[int(r[f"apps_{g}"]) for g in range(3)] for r in t]
        A = float(np.mean([outside + sum(k * a for k, a in zip(layers, ap)) + price[f["exit"]] *
                           sum(a - (a == 4) for a in ap) for ap in apps]))
        assert float(job["layer_applications"]) == pytest.approx(A)
        assert float(f["ce"]) == pytest.approx(float(job["ce"]), rel=1e-12)
        assert float(f["layer_applications"]) == pytest.approx(A)
        below = [n for n in fixed if cost(n) <= A]
        best = min(below, key=lambda n: fixed[n]) if below else None
        assert (f["frontier_n"] or None) == (None if best is None else str(best))
        reach = [n for n in sorted(fixed) if fixed[n] <= float(job["ce"])]
        assert int(f["fixed_n"]) == (reach[0] if reach else max(fixed))
        assert float(f["saving"]) == pytest.approx(1 - A / cost(int(f["fixed_n"])))
        assert float(f["saving_lo"]) <= float(f["saving"]) <= float(f["saving_hi"])
    # the oracle's NLLs at every n: its row n = 4 is the fixed-4 job's per-token NLL
    by_n = np.load(sweep / "5" / "oracle_nll.npy")
    nll4 = [float(r["nll"]) for r in csv.DictReader(open(sweep / "2" / "eval_tokens.csv"))]
    assert by_n.shape == (40, 4) and np.allclose(by_n[:, 3], nll4, atol=1e-5)
    assert (sweep / "frontier.md").is_file()
    fig4_draws_the_sweep(sweep, jobs, front)


def fig4_draws_the_sweep(sweep, jobs, front):
    """fig4_exits.png is Fig. 4 as `recdepth.sweep.summarize` draws it from this sweep's job
    files (drawn again here, on a copy, and compared pixel for pixel), and that figure plots
    the CSVs' numbers: each rule's CE and layer applications at its τ, the fixed frontier and
    each rule at (layer applications, CE − CE of the deepest fixed job), and each rule's CE
    minus the frontier at its cost (frontier.csv's d_hull)."""
    import shutil

    import numpy as np

    from recdepth import sweep as summary
    from recdepth.analysis import plots
    from tests.drawn import capture, curves, png_shows

    copy = sweep.parent / (sweep.name + "_redrawn")
    shutil.copytree(sweep, copy)
    with pytest.MonkeyPatch.context() as mp:
        figs = capture(mp, plots, "fig4")
        summary.summarize(copy)
    (fig,) = figs
    assert png_shows(fig, sweep / "fig4_exits.png")
    ok = [r for r in jobs if r["status"] == "ok"]
    fixed = sorted((r for r in ok if r["exit"] == "fixed"), key=lambda r: int(r["max_steps"]))
    deepest = float(fixed[-1]["ce"])
    rules = [r for r in ok if r["exit"] != "fixed"]  # one τ each here
    for ax, key in zip(fig.axes[:4], ("ms_per_token", "ppl", "ce", "layer_applications")):
        drawn = curves(ax)
        want = {r["exit"]: [[float(r["tau"]), float(r[key])]] for r in rules if r[key] != ""}  # the oracle is untimed
        assert set(drawn) == set(want), key
        for rule, xy in want.items():
            np.testing.assert_allclose(drawn[rule], xy, rtol=1e-12)
    drawn = curves(fig.axes[4])
    np.testing.assert_allclose(drawn["fixed (frontier)"],
                               [[float(r["layer_applications"]), float(r["ce"]) - deepest] for r in fixed], atol=1e-6)
    for r in rules:
        if r["exit"] != "oracle":
            np.testing.assert_allclose(drawn[r["exit"]], [[float(r["layer_applications"]), float(r["ce"]) - deepest]],
                                       atol=1e-6)
    hull = curves(fig.axes[6])
    for f in front:
        if f["exit"] != "oracle":
            np.testing.assert_allclose(hull[f["family"]], [[float(f["layer_applications"]), float(f["d_hull"])]])


@pytest.mark.slow  # default-suite time (33 s): the sweeper's shared path runs in the default suite through
# test_frontier_sweep_compares_every_rule...; shared = one by one is tested below the CLI (test_decoding,
# test_report, test_ltt); this compares the two whole sweeps (make test-slow runs it)
def test_frontier_sweep_decodes_its_settings_as_one_batch_like_job_by_job(tmp_path, env, tiny_ckpt):
    """hydra.sweeper.shared_rows (default 64): the jobs that differ only in their exit
    setting are decoded before they run as one batch of settings × windows; every job
    still writes its own directory, and its files equal those of the sweep run job by job
    (shared_rows=0): the same tokens and applications, NLL within float32 rounding."""
    import csv

    import numpy as np

    def sweep(out, *extra):
        q = subprocess.run(
            [sys.executable, "-m", "recdepth", "frontier", f"ckpt={tiny_ckpt}", f"hydra.sweep.dir={out}",
             "eval.tokens=40", "eval.latency_tokens=4", "eval.repeats=1", "eval.warmup_tokens=1",
             "hydra.sweeper.fixed=[1,2,4]", "hydra.sweeper.rules.accel=[0.5]", "hydra.sweeper.rules.stepnorm=[1.0]",
             "hydra.sweeper.rules.kl=[1e-3]", "hydra.sweeper.oracle=[0.01]", "hydra.sweeper.warm_start=false",
             "exit.max_steps=4", *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert q.returncode == 0, q.stderr[-3000:]
        return q

    shared, alone = tmp_path / "shared", tmp_path / "alone"
    q = sweep(shared)
    sweep(alone, "hydra.sweeper.shared_rows=0")
    assert "decoding 6 settings side by side" in q.stderr + q.stdout
    jobs = list(csv.DictReader(open(shared / "sweep_results.csv")))
    assert len(jobs) == 7 and all(r["status"] == "ok" for r in jobs)
    for r in jobs:
        a = json.loads((shared / r["job"] / "metrics.json").read_text())["eval"]
        b = json.loads((alone / r["job"] / "metrics.json").read_text())["eval"]
        assert a.get("shared_batch") == (None if a["exit"] == "oracle" else 6) and "shared_batch" not in b
        assert (a["exit"], a["tau"], a["max_steps"]) == (b["exit"], b["tau"], b["max_steps"])
        ta = list(csv.DictReader(open(shared / r["job"] / "eval_tokens.csv")))
        tb = list(csv.DictReader(open(alone / r["job"] / "eval_tokens.csv")))
        assert [{k: v for k, v in x.items() if k not in ("nll", "ms")} for x in ta] == \
               [{k: v for k, v in x.items() if k not in ("nll", "ms")} for x in tb]
        assert np.allclose([float(x["nll"]) for x in ta], [float(x["nll"]) for x in tb], rtol=0, atol=1e-4)
        assert len(a.get("ms_per_token_repeats") or []) == len(b.get("ms_per_token_repeats") or [])
    fa, fb = (list(csv.DictReader(open(d / "frontier.csv"))) for d in (shared, alone))
    assert [(x["exit"], x["verdict"]) for x in fa] == [(x["exit"], x["verdict"]) for x in fb]
