"""Data-parallel training on Lightning's DDP, launched so Hydra stays out of the ranks.

`trainer=ddp` runs Lightning's `DDPStrategy` (gloo on CPU, NCCL on GPUs). Lightning's own
launcher re-runs the command line for every extra rank, and under Hydra that makes each
rank compose its config again and write Hydra files of its own (a multirun would even
start the whole sweep again per rank). recdepth launches rank r > 0 instead as

    python -m recdepth.train --ddp-rank <run_dir>/config.yaml

on the resolved config rank 0 already wrote (so it trains, or resumes, the same training
directory; recdepth/training/runs.py):
every rank trains exactly the same run, no rank but 0 writes anything (Lightning writes
checkpoints and logs from rank 0; recdepth's metrics, diagnostics and figures are rank-0
only), and Hydra never sees the other ranks.

Each rank's data are its own slice of every global batch (`TokenDataModule.train_dataset`),
so W ranks at batch_size B train on the windows one process at batch_size W*B would.
All ranks draw the same loop counts and the same initial-state noise (same seeds), so the
ranks run the same depth every step and rank 0's checkpoint resumes all of them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

RANK_FLAG = "--ddp-rank"  # `python -m recdepth.train --ddp-rank ...`: a rank > 0 (recdepth.train.ddp_rank)
WORKER_ENV = "RECDEPTH_DDP_WORKER"


def is_worker() -> bool:
    """True in a DDP rank > 0 that recdepth launched."""
    return os.environ.get(WORKER_ENV) == "1"


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    with contextlib.suppress(OSError):
        return ctypes.CDLL(None, use_errno=True)  # loaded in the parent: nothing to load after fork
    return None


_LIBC = _libc()


def _die_with_parent(parent: int):
    """The preexec_fn of a rank > 0: ask Linux to SIGKILL it when rank 0 dies (a rank 0
    killed with SIGKILL cannot stop its ranks; they would wait on a collective for the DDP
    timeout), and exit at once if rank 0 is already gone. Only a prctl and a getppid run
    between fork and exec."""
    def preexec() -> None:
        if _LIBC is not None:
            _LIBC.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        if os.getppid() != parent:
            os._exit(1)
    return preexec


class _ConfigLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with recdepth's command for ranks > 0."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, command: list[str]):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.command = command

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        # What this sets in rank 0's own environment, undone by `teardown` (a sequential
        # sweep's next job must launch its ranks afresh).
        self.saved_env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK",
                                                           "WORLD_SIZE")}
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            child = {**os.environ, "LOCAL_RANK": str(local_rank), WORKER_ENV: "1"}
            self.procs.append(subprocess.Popen(self.command, env=child, preexec_fn=_die_with_parent(os.getpid())))


class RecdepthDDP(DDPStrategy):
    """DDPStrategy whose ranks > 0 run `python -m recdepth.train --ddp-rank` (see module doc)."""

    def __init__(self, command: list[str] | None = None, **kw):
        super().__init__(**kw)
        self.command = command

    def _configure_launcher(self) -> None:
        if self.command is None or self.cluster_environment.creates_processes_externally:
            super()._configure_launcher()  # a rank > 0: rank 0 started it
        else:
            self._launcher = _ConfigLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                             self.command)


def teardown(trainer, failed: bool = False) -> None:
    """After a DDP run's last trainer call (or its failure): let the ranks exit (kill them
    if rank 0 failed: they would wait on it), close the process group and give rank 0 its
    environment back, so the next job of a sequential sweep launches afresh. Idempotent."""
    import torch.distributed as dist

    launcher = getattr(trainer.strategy, "launcher", None) if trainer is not None else None
    if not isinstance(launcher, _ConfigLauncher) or is_worker():
        return
    for proc in launcher.procs:
        if failed:
            proc.kill()
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
    launcher.procs = []
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for k, v in getattr(launcher, "saved_env", {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    launcher.saved_env = {}


def check_launch(name: str) -> None:
    """Whether this process may start `trainer.strategy=<name>` (the run config's schema,
    recdepth/config/schema.py, checks the trainer's values; this checks how it was started)."""
    if name == "ddp" and (os.environ.get("SLURM_NTASKS", "1") != "1"
                          or os.environ.get("RANK", "0") != "0" and not is_worker()):
        raise ValueError("trainer.strategy: ddp starts its ranks itself; run one task per SLURM job "
                         "(hydra.launcher.tasks_per_node=1), not several, and not under torchrun")


def strategy(trainer_cfg, run_dir: Path | None = None):
    """The Lightning strategy of a validated `trainer` config (recdepth/config/schema.py). With
    run_dir (the job directory, where rank 0 wrote config.yaml), the DDP strategy is ready
    to launch."""
    name = trainer_cfg.strategy
    check_launch(name)
    if name == "auto":
        return "auto"
    command = None
    if run_dir is not None and not is_worker():
        command = [sys.executable, "-m", "recdepth.train", RANK_FLAG, str(Path(run_dir).resolve() / "config.yaml")]
    # recdepth starts the ranks itself, also inside a SLURM job (Lightning would otherwise
    # see SLURM and wait for srun to have started them).
    from lightning.fabric.plugins.environments import LightningEnvironment

    return RecdepthDDP(command=command, cluster_environment=LightningEnvironment())
