"""Lightning callbacks: `LoopDynamics` logs loop geometry at every checkpoint.

At step 0 (before the first update), every `every_n_steps` training steps (by default the
checkpoint cadence, so each checkpoint has its diagnostics) and at the end of training,
on a fixed held-out batch at a fixed number of loops, `LoopDynamics`:

1. computes `recdepth.analysis.diagnostics.loop_dynamics` (per group and per k: mean/std over
   tokens of step norms, cosines, accelerations; DLR at every group boundary; the PCA of
   one sequence) and writes it to `<run_dir>/diagnostics/step_<global_step>.json`;
2. logs scalar summaries (`diagnostics.summary_scalars`) to every logger of the trainer;
3. on Weights & Biases, also logs per-k curves with one series per checkpoint so far,
   DLR over checkpoints, and the PCA trajectory (Fig. 1) as an image;
4. at the end of training draws the paper's figures into `<run_dir>/figures/`
   (`recdepth.figures`, the same code as `python -m recdepth.figures <run_dir>`).

It changes nothing about training: its initial-state noise comes from its own seeded
generator, it runs under no_grad in eval mode and restores the mode, and the step it
runs on is left out of the throughput figures (`LoopedLM.restart_step_timer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from recdepth.analysis import diagnostics

log = logging.getLogger("recdepth.training.callbacks")


class LoopDynamics(L.Callback):
    """Loop-geometry diagnostics at step 0, every `every_n_steps` steps and at the end.

    Args:
        batch: the fixed held-out token ids [B, T] (model ids).
        run_dir: where `diagnostics/` and `figures/` go.
        every_n_steps: cadence in optimiser steps (>= 1); the default config ties it to
            `trainer.checkpoint_every`.
        loops: applications of every group during the diagnostics (paper: 30; >= 3).
        pca_sequence: which row of `batch` Fig. 1 shows.
        pca_tokens: how many of its first tokens Fig. 1 shows (one polyline each).
        max_state_bytes: memory bound for captured trajectories (rows go through in chunks).
        seed: seed of the initial-state noise (the same noise at every checkpoint).
        figures: draw the figures at the end of training.
        decode: optional ids -> text, to caption Fig. 1 with the sequence it shows.
    """

    def __init__(self, batch: Tensor, run_dir: str | Path, every_n_steps: int = 200, loops: int = 30,
                 pca_sequence: int = 0, pca_tokens: int = 32,
                 max_state_bytes: int = diagnostics.DEFAULT_MAX_STATE_BYTES, seed: int = 0,
                 figures: bool = True, decode: Callable[[list[int]], str] | None = None):
        batch = torch.as_tensor(batch)
        if not (batch.dim() == 2 and batch.numel() > 0 and not batch.is_floating_point()):
            raise ValueError(f"callbacks.loop_dynamics.batch: expected token ids shaped [B, T], "
                             f"got {tuple(batch.shape)} {batch.dtype}")
        diagnostics.check_loop_dynamics(every_n_steps, loops, pca_sequence, batch.shape[0], pca_tokens, max_state_bytes)
        self.batch = batch.long()
        self.run_dir = Path(run_dir)
        self.every_n_steps = int(every_n_steps)
        self.loops = int(loops)
        self.pca_sequence = int(pca_sequence)
        self.pca_tokens = int(pca_tokens)
        self.max_state_bytes = int(max_state_bytes)
        self.seed = int(seed)
        self.figures = figures
        self.decode = decode
        self.history: list[dict] = []  # every diagnostics dict of this fit, oldest first
        self.seconds = 0.0  # wall time spent in this callback (diagnostics, logging, figures)
        self._last_step: int | None = None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module):
        existing = diagnostics.diagnostics_files(self.run_dir)
        # A fresh run must not mix with an old one (recdepth.train clears what a restarted
        # run wrote itself: runs.TrainingRun.rewind).
        if existing and trainer.global_step == 0:
            raise FileExistsError(f"run_dir: {self.run_dir} already holds diagnostics/step_*.json "
                                  "from another run; choose a new run_dir")
        self.history = diagnostics.load_diagnostics(self.run_dir) if existing else []
        self._measure(trainer, pl_module)  # step 0 (or the step a resumed run starts at)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every_n_steps == 0:
            self._measure(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._measure(trainer, pl_module)  # the final state, if the cadence missed it
        if self.figures and trainer.is_global_zero:
            from recdepth.analysis import plots

            t0 = time.perf_counter()
            paths = plots.draw_all(self.run_dir)
            self.seconds += time.perf_counter() - t0
            log.info("loop dynamics: %d figures in %s", len(paths), self.run_dir / "figures")

    def state_dict(self) -> dict:
        return {"seconds": self.seconds}  # so a resumed run reports the whole run's cost

    def load_state_dict(self, state: dict) -> None:
        self.seconds = float(state.get("seconds", 0.0))

    # --------------------------------------------------------------- measure
    def _measure(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if step == self._last_step or not trainer.is_global_zero:
            return
        self._last_step = step
        path = diagnostics.diagnostics_path(self.run_dir, step)
        if path.exists():  # a resumed run: this checkpoint was measured before; keep it
            log.info("loop dynamics: %s exists, kept", path)
            return
        d = diagnostics.measure(pl_module.model, self.batch, self.run_dir, step, self.decode, loops=self.loops,
                                seed=self.seed, pca_sequence=self.pca_sequence, pca_tokens=self.pca_tokens,
                                max_state_bytes=self.max_state_bytes)
        self.history.append(d)
        self._log(trainer, d)
        self.seconds += d["seconds"]
        if hasattr(pl_module, "restart_step_timer"):
            pl_module.restart_step_timer()  # keep this step's time out of tokens/s and MFU
        log.info("loop dynamics at step %d: %.2f s, DLR %s", step, d["seconds"],
                 [round(b["mean"], 2) for b in d["dlr"]])

    def _log(self, trainer, d: dict) -> None:
        step = d["global_step"]
        scalars = diagnostics.summary_scalars(d)
        scalars["perf/diagnostics_seconds"] = d["seconds"]
        for lg in trainer.loggers:
            lg.log_metrics(scalars, step=step)
            if type(lg).__name__ == "WandbLogger":
                self._log_wandb(lg, step)

    def _log_wandb(self, logger, step: int) -> None:
        """Per-k curves (one series per checkpoint so far), DLR over checkpoints, Fig. 1."""
        import matplotlib.pyplot as plt
        import wandb

        from recdepth.analysis import plots

        hist = self.history
        keys = [f"step {h['global_step']}" for h in hist]
        charts = {}
        for gi, grp in enumerate(hist[-1]["groups"]):
            for q, x0 in (("step_norm", 0), ("step_cosine", 1)):
                ys = [h["groups"][gi][q]["mean"] for h in hist]
                xs = list(range(x0, x0 + len(ys[0])))
                charts[f"loop_dynamics/{q}_g{grp['name']}"] = wandb.plot.line_series(
                    xs=xs, ys=ys, keys=keys, title=f"{q.replace('_', ' ')}, group {grp['name']}", xname="k")
        if hist[-1]["dlr"]:
            xs = [h["global_step"] for h in hist]
            ys = [[h["dlr"][b]["mean"] for h in hist] for b in range(len(hist[-1]["dlr"]))]
            charts["loop_dynamics/dlr"] = wandb.plot.line_series(
                xs=xs, ys=ys, keys=[b["name"] for b in hist[-1]["dlr"]], title="DLR across checkpoints",
                xname="global step")
        logger.experiment.log({**charts, "trainer/global_step": step})
        if hist[-1]["pca"] is not None:
            fig = plots.fig1_pca(hist[-1])
            png = self.run_dir / "diagnostics" / f"pca_step_{step}.png"
            fig.savefig(png, dpi=100)
            plt.close(fig)
            logger.log_image(key="loop_dynamics/pca", images=[str(png)], step=step,
                             caption=[f"PCA trajectory at step {step}"])

