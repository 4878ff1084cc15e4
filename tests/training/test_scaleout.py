"""Scale-out on existing engines: Lightning DDP (2 CPU processes, gloo), Hydra's submitit
launcher (run locally here; its SLURM configuration composed and checked against
submitit's own SLURM executor)."""

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.helpers import TINY, run
from tests.training.helpers import steps_of


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_ddp_on_two_cpu_processes_trains_as_one_process_with_the_whole_batch(tmp_path, env):
    """trainer=ddp, 2 ranks (gloo) at batch 2 == 1 process at batch 4: the same windows,
    averaged gradients; noise-free initial state so the two runs draw nothing different."""
    common = ["debug=tiny", "trainer.max_steps=6", "model.state_init=zero"]
    ddp_cwd = tmp_path / "ddp"
    ddp_cwd.mkdir()
    p = run(["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "batch_size=2", *common],
            cwd=ddp_cwd, env=env)
    assert "Starting with 2 processes" in p.stdout + p.stderr
    run(["batch_size=4", *common, f"run_dir={tmp_path / 'one'}"], cwd=tmp_path, env=env)
    # One set of outputs: one Hydra run dir, no per-rank directory or Hydra files.
    runs = [d for d in ddp_cwd.glob("outputs/*/*") if d.parent.name != "runs"]
    assert len(runs) == 1, runs
    rd = runs[0]
    assert not [f for f in rd.rglob("*") if "rank" in f.name]
    assert sorted(f.name for f in (rd / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert sorted(f.name for f in rd.glob("*.log")) == ["train.log"]
    a = json.loads((rd / "metrics.json").read_text())
    b = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert a["tokens_seen"] == b["tokens_seen"] == 6 * 4 * 128
    assert a["val_ce"] == pytest.approx(b["val_ce"], abs=1e-5)
    assert steps_of(rd / "train") == [0, 3, 6] and len(list(rd.glob("train/checkpoints/*.ckpt"))) == 1



@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_ddp_jobs_of_a_sequential_sweep_each_launch_their_ranks(tmp_path, env):
    """Job 1 of a basic-launcher multirun must not find job 0's process group or env."""
    run(["--multirun", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", *TINY, "callbacks=none",
         "seed=1,2"], cwd=tmp_path, env=env)
    (sweep,) = tmp_path.glob("multirun/*/*")
    rows = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["reused"] for r in rows] == ["False", "False"]
    a, b = (json.loads((sweep / j / "metrics.json").read_text()) for j in ("0", "1"))
    assert a["tokens_seen"] == b["tokens_seen"] == 3 * 2 * 2 * 128 and a["val_ce"] != b["val_ce"]


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_parallel_sweep_jobs_of_one_identity_train_once(tmp_path, env):
    """submitit's local launcher runs both jobs at once; the identity lock makes the
    second wait for the first and reuse its checkpoint instead of training it again."""
    run(["--multirun", "hydra/launcher=submitit_local", *TINY, "exit=accel", "exit.tau=1e-3,1e-2"],
        cwd=tmp_path, env=env)
    (sweep,) = tmp_path.glob("multirun/*/*")
    rows = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert sorted(r["reused"] for r in rows) == ["False", "True"]
    waited = [j for j in ("0", "1") if "identity lock" in (sweep / j / "train.log").read_text()]
    assert waited and all(json.loads((sweep / j / "metrics.json").read_text())["reused"] for j in waited)
    assert len(list(tmp_path.glob("outputs/runs/*/trained.json"))) == 1


@pytest.mark.parametrize("launcher", ["slurm", pytest.param("submitit_slurm", marks=pytest.mark.slow)])
def test_slurm_launcher_config_composes_and_submitit_accepts_it(tmp_path, env, launcher, monkeypatch, cli_here):
    import submitit
    import yaml

    # submitit's SLURM executor insists on finding `srun`; nothing here runs it.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    p = subprocess.run([sys.executable, "-m", "recdepth.train", f"hydra/launcher={launcher}",
                        "hydra.launcher.partition=gpu", "hydra.launcher.account=lab", "trainer=gpu",
                        "--cfg", "hydra", "--resolve"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    params = yaml.safe_load(p.stdout)["hydra"]["launcher"]
    assert params.pop("_target_") == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    # What the launcher does with them before it submits: build submitit's SLURM executor.
    folder = params.pop("submitit_folder")
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / "submitit",
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = {"timeout_min", "nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "mem_gb", "name",
            "stderr_to_stdout"}
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -m recdepth.train", "0")
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=lab" in script
    if launcher == "slurm":  # recdepth's defaults on top of the plugin's
        assert "#SBATCH --time=240" in script and "#SBATCH --gpus-per-node=1" in script
        assert "#SBATCH --ntasks-per-node=1" in script and folder.endswith("/.submitit/%j")
    # A field the plugin does not have is refused by Hydra, in one line naming it (recdepth/cli/runner.py).
    code, err, _ = cli_here("recdepth.train", [f"hydra/launcher={launcher}", "hydra.launcher.partiton=gpu", "--cfg",
                                            "hydra"], tmp_path)
    assert code != 0
    assert err == "error: hydra.launcher.partiton: no such key in hydra.launcher (did you mean partition?)\n"


@pytest.mark.slow
def test_compiled_blocks_train_like_eager_ones(tmp_path, env):
    """trainer.compile=true (here on CPU, inductor): same val_ce as eager, checkpoints keep
    their parameter names, the exit evaluation runs."""
    import torch

    args = [*TINY, "callbacks=none"]  # compile is not part of the identity: two runs_dirs train twice
    run([*args, f"run_dir={tmp_path / 'eager'}", f"runs_dir={tmp_path / 'runs_eager'}"], cwd=tmp_path, env=env)
    run([*args, "trainer.compile=true", f"run_dir={tmp_path / 'compiled'}", f"runs_dir={tmp_path / 'runs_compiled'}"],
        cwd=tmp_path, env=env)
    a = json.loads((tmp_path / "eager" / "metrics.json").read_text())
    b = json.loads((tmp_path / "compiled" / "metrics.json").read_text())
    assert b["val_ce"] == pytest.approx(a["val_ce"], abs=1e-4)
    assert b["eval"]["ce"] == pytest.approx(a["eval"]["ce"], abs=1e-4)
    keys = lambda d: set(torch.load(tmp_path / d / "train" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"])  # noqa: E731
    assert keys("compiled") == keys("eager")
