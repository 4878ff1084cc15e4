"""Data-parallel training on Lightning's DDP, launched so Hydra stays out of the ranks.

`trainer=ddp` runs Lightning's `DDPStrategy` (gloo on CPU, NCCL on GPUs). Lightning's own
launcher re-runs the command line for every extra rank, and under Hydra that makes each
rank compose its config again and write Hydra files of its own (a multirun would even
start the whole sweep again per rank). recdepth launches rank r > 0 instead as

    python -m recdepth.distributed <run_dir>/config.yaml <checkpoint to resume | null>

on the resolved config rank 0 already wrote, with the resume decision rank 0 already took:
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

STRATEGIES = ("auto", "ddp")
WORKER_ENV = "RECDEPTH_DDP_WORKER"


def is_worker() -> bool:
    """True in a DDP rank > 0 that recdepth launched."""
    return os.environ.get(WORKER_ENV) == "1"


def _die_with_parent() -> None:
    """In a rank > 0, before exec: ask Linux to SIGKILL it when rank 0 dies (rank 0 killed
    with SIGKILL cannot stop its ranks; they would wait on a collective for the DDP
    timeout). A no-op elsewhere."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class _ConfigLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with recdepth's command for ranks > 0."""

    def __init__(self, cluster_environment, num_processes: int, num_nodes: int, command: list[str]):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.command = command

    def _call_children_scripts(self) -> None:
        self._check_can_spawn_children()
        self.procs = []
        env = self.cluster_environment
        os.environ["MASTER_ADDR"] = env.main_address
        os.environ["MASTER_PORT"] = str(env.main_port)
        os.environ["NODE_RANK"] = str(env.node_rank())
        os.environ["LOCAL_RANK"] = str(env.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        for local_rank in range(1, self.num_processes):
            child = {**os.environ, "LOCAL_RANK": str(local_rank), WORKER_ENV: "1"}
            self.procs.append(subprocess.Popen(self.command, env=child, preexec_fn=_die_with_parent))


class RecdepthDDP(DDPStrategy):
    """DDPStrategy whose ranks > 0 run `python -m recdepth.distributed` (see module doc)."""

    def __init__(self, command: list[str] | None = None, **kw):
        super().__init__(**kw)
        self.command = command

    def _configure_launcher(self) -> None:
        if self.command is None or self.cluster_environment.creates_processes_externally:
            super()._configure_launcher()  # torchrun / SLURM tasks: they started the ranks
        else:
            self._launcher = _ConfigLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                             self.command)


def strategy(trainer_cfg, run_dir: Path | None = None, resume=None):
    """The Lightning strategy of `trainer.strategy` (validated). With run_dir, the DDP
    strategy is ready to launch: ranks > 0 get rank 0's config and resume decision."""
    name = trainer_cfg.get("strategy", "auto")
    if name not in STRATEGIES:
        raise ValueError(f"trainer.strategy: expected one of {', '.join(STRATEGIES)}, got {name!r}")
    devices = trainer_cfg.devices
    if devices != "auto" and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise ValueError(f"trainer.devices: expected an integer >= 1 or auto, got {devices!r}")
    if name == "auto":
        return "auto"
    command = None
    if run_dir is not None and not is_worker():
        command = [sys.executable, "-m", "recdepth.distributed", str(Path(run_dir).resolve() / "config.yaml"),
                   "null" if resume is None else str(Path(resume).resolve())]
    env = None
    if os.environ.get("SLURM_NTASKS", "1") == "1":
        # One SLURM task (or none): recdepth starts the ranks itself. Lightning would
        # otherwise see SLURM and wait for srun to have started them.
        from lightning.fabric.plugins.environments import LightningEnvironment

        env = LightningEnvironment()
    return RecdepthDDP(command=command, cluster_environment=env)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a rank > 0: `python -m recdepth.distributed <config.yaml> <ckpt|null>`."""
    import logging

    from omegaconf import OmegaConf

    from recdepth.train import train

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not is_worker():
        raise SystemExit("recdepth.distributed: started by recdepth's DDP launcher only "
                         "(use `python -m recdepth.train trainer=ddp`)")
    logging.basicConfig(level=logging.WARNING)
    cfg = OmegaConf.load(argv[0])
    cfg.ckpt_path = None if argv[1] == "null" else argv[1]
    train(cfg)


if __name__ == "__main__":
    main()
