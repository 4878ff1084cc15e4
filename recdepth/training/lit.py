"""The LightningModule: a LoopedGPT trained with sampled loop counts.

- training: cross-entropy with loop counts drawn per group per step by the loop sampler
  (lognormal-Poisson by default), truncated backprop through the last k applications;
- validation: the fixed sampler (n = round(r) per group), cross-entropy aggregated
  token-weighted over the whole val set with torchmetrics, perplexity = exp(CE);
- optimiser: nanoGPT's AdamW (weight decay on >=2-D tensors only), linear warmup then
  cosine decay to min_lr; gradient clipping is the Trainer's (`trainer.gradient_clip_val`);
- throughput: tokens/s and MFU per step, with FLOPs that count the layer applications
  the step actually ran (its drawn loop counts), not a nominal depth;
- exact resume: every random draw comes from a generator the module owns (loop counts:
  the sampler's; initial-state noise: `noise`, on the training device; validation: a
  generator reseeded at every validation, so val_ce depends on the weights alone), and
  their states travel in the checkpoint with the elapsed training time.
"""

from __future__ import annotations

import logging
import math
import time

import lightning as L
import torch
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from recdepth.core.runtime import peak_flops
from recdepth.model.looped import GPTConfig, LoopedGPT
from recdepth.training import halting
from recdepth.training.objective import Objective
from recdepth.training.sampler import LoopSampler

log = logging.getLogger("recdepth.training.lit")


class TrainingDiverged(RuntimeError):
    """The loss or the weights stopped being finite; training stops (and saves nothing more)."""


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over `warmup` steps, then cosine to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + 0.5 * (1 - min_ratio) * (1 + math.cos(math.pi * progress))


class LoopedLM(L.LightningModule):
    def __init__(self, model: dict, sampler: dict, optim: dict, max_steps: int,
                 seed: int = 0, peak_flops: float | None = None, loss: dict | None = None,
                 halt: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(**model)
        self.model = LoopedGPT(self.config)
        self.sampler = LoopSampler(n_groups=self.model.n_groups, seed=seed, **sampler)
        self.objective = Objective(**(loss or {}))  # where the loss is taken along the loop (loss.*)
        # the halting loss (halt.*; recdepth/training/halting.py): None, or (loss, its numbers)
        h = halt or {}
        self.halting = None if h.get("loss", "none") == "none" else (
            halting.lookup(h["loss"]), halting.HaltSettings(**{k: h[k] for k in ("beta", "prior", "epsilon", "label",
                                                                                 "margin") if k in h}))
        if self.halting is not None and self.model.halt is None:
            raise ValueError(f"halt.loss={h['loss']}: the model has no halting head (model config halt_head is null)")
        if self.halting is not None:
            halting.check_groups(h["loss"], self.halting[1].label, self.model.n_groups)
        self.halt_through_state = h.get("through_state", True)  # halt.through_state: the head's input detached?
        if h.get("freeze"):  # the second stage: the halting head alone learns
            for n, p in self.model.named_parameters():
                p.requires_grad_(n.startswith("halt."))
        self.val_ce = MeanMetric()
        self._peak: float | None = None
        self._t_last: float | None = None
        self._loops: list[int] = []
        # compact id -> GPT-2 id when the data uses a compact vocabulary (set by train.py);
        # travels in the checkpoint so a saved model can always be mapped back to GPT-2.
        self.vocab_to_gpt2: torch.Tensor | None = None
        # the data config it was trained on (set by train.py), so `recdepth.evaluate` can
        # rebuild exactly the held-out split from the checkpoint alone
        self.data_config: dict | None = None
        # the training config it was trained under (set by train.py): a resume refuses a
        # checkpoint whose config differs from the run's
        self.training_config: dict | None = None
        # a task run's evaluation settings (set by train.py): the defaults of the evaluation
        # commands on this checkpoint (recdepth.config.groups.EVAL_FROM_CHECKPOINT)
        self.eval_config: dict | None = None
        # and the frontier grid its experiment chose (recdepth.config.frontier_grid.FrontierChoice)
        self.frontier_config: dict | None = None
        # Initial-state noise of training passes: its own generator (created on the
        # training device in on_train_start), so the stream a resumed run continues is
        # exactly the one it saved, whatever else used the global RNG in between.
        self.noise: torch.Generator | None = None
        self._noise_state: tuple[str, torch.Tensor] | None = None  # from a checkpoint, until on_train_start
        self._val_noise: torch.Generator | None = None
        # Training wall time: seconds before this fit (from the checkpoint) + this fit's.
        self.train_seconds_before = 0.0
        self._fit_t0: float | None = None

    # ------------------------------------------------------------ training
    def training_step(self, batch, batch_idx):
        x, y, z = batch if len(batch) == 3 else (*batch, None)  # z: a task's per-step targets
        self._loops = self.sampler.sample() if self.model.n_groups else []
        mix = self.objective.mix(self.global_step, self.hparams.max_steps)
        if z is None and mix.get("trajectory"):
            raise ValueError("loss.steps: trajectory needs per-step targets, and this data has none (a task that "
                             "states them, e.g. data=roots; else loss.steps=all or last)")
        terms: dict[str, Tensor] = {}
        _, loss = self.model(x, y, loops=self._loops, backprop_depth=self.sampler.backprop_depth,
                             generator=self.noise, objective=self.objective, step_targets=z, mix=mix,
                             halting=None if self.halting is None else lambda **kw: self._halting_term(terms, **kw),
                             halt_through_state=self.halt_through_state)
        if "halt" in terms:  # the pass's one halting term (several groups: the drawn group's)
            self.log("train/halt_loss", terms["halt"])
            if "expected_n" in terms:  # one group: every application
                self.log("train/halt_expected_n", terms["expected_n"])
        if self.objective.anneal_to is not None:
            self.log("train/anneal", mix[self.objective.anneal_to])
        bad = (~torch.isfinite(loss.detach())).float()
        if self.trainer.world_size > 1:  # every rank stops together, with this message (not a killed peer)
            bad = self.trainer.strategy.reduce(bad, reduce_op="sum")
        if bad.item():  # one sync per step: cheap next to the step itself
            raise TrainingDiverged(f"train/loss is {loss.item()} at step {self.global_step} "
                                   f"{'' if self.trainer.world_size == 1 else '(on some rank) '}"
                                   f"(optim.lr={self.hparams.optim['lr']}): training diverged and was stopped")
        self.log("train/loss", loss, prog_bar=True)
        for g, n in enumerate(self._loops):
            self.log(f"train/loops_g{g}", float(n))
        return loss

    def _halting_term(self, terms: dict, **inputs) -> Tensor:
        """The halting loss of this pass (`LoopedGPT.forward`'s `halting`), kept in `terms`
        with, on one group (every application), the mean halting depth under PonderNet's p
        (Σ_n n·p_n, for the logs)."""
        loss_fn, settings = self.halting
        h = halting.HaltInputs(**inputs)
        term = loss_fn.loss(h, settings)
        if not h.sampled:
            with torch.no_grad():
                p = halting.halting_distribution(h.z).exp()
                n = torch.arange(1, p.shape[0] + 1, device=p.device, dtype=p.dtype).view(-1, 1, 1)
                terms["expected_n"] = ((p * n).sum(0) * h.scored).sum() / h.scored.sum().clamp(min=1)
        terms["halt"] = term.detach()
        return term

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Wall time between consecutive step ends: forward, backward, optimiser and data.
        now = time.perf_counter()
        if self._t_last is not None:
            dt = now - self._t_last
            x = batch[0]
            tokens = x.numel() * self.trainer.world_size
            flops = self.model.flops_per_token(self._loops, x.shape[1], self.sampler.backprop_depth, True)
            self.log("perf/tokens_per_sec", tokens / dt, prog_bar=True)
            self.log("perf/mfu", flops * tokens / dt / (self._peak * self.trainer.world_size))
            self.log("perf/step_ms", dt * 1000)
        self._t_last = now

    def on_train_start(self):
        # Measured here, not inside a timed step (on a CPU it runs a short GEMM probe).
        self._peak = peak_flops(self.device, self.hparams.peak_flops)
        self.noise = torch.Generator(device=self.device).manual_seed(self.hparams.seed + 1)
        if self._noise_state is not None:
            kind, state = self._noise_state
            if kind == self.device.type:
                self.noise.set_state(state)
            else:  # a generator's state is device-specific: the run goes on, not bit-exactly
                log.warning("resume: the checkpoint's noise generator is a %s one, this run trains on %s; "
                            "the initial-state noise is reseeded (the resumed run is not bit-identical)",
                            kind, self.device.type)
            self._noise_state = None
        self._fit_t0 = time.perf_counter()

    @property
    def train_seconds(self) -> float:
        """Training wall time so far, over every fit that led to these weights."""
        now = 0.0 if self._fit_t0 is None else time.perf_counter() - self._fit_t0
        return self.train_seconds_before + now

    def on_train_epoch_start(self):
        self._t_last = None

    def restart_step_timer(self):
        """Leave the time until the next step end out of the throughput figures (a callback
        calls this after doing work of its own inside a step, e.g. diagnostics)."""
        self._t_last = None

    def on_validation_start(self):
        self._t_last = None  # validation time is not a training step's time
        # Every validation sees the same initial-state noise: val_ce is a function of the
        # weights alone (and a resumed run, which skips the validation its checkpoint
        # preceded, draws nothing a straight run would not).
        self._val_noise = torch.Generator(device=self.device).manual_seed(self.hparams.seed + 2)

    # ---------------------------------------------------------- validation
    def validation_step(self, batch, batch_idx):
        x, y = batch[0], batch[1]  # (x, y) or, with per-step targets, (x, y, z)
        _, loss = self.model(x, y, generator=self._val_noise)  # the fixed n = round(r) of every group (SPEC §1)
        self.val_ce.update(loss, weight=(y >= 0).sum())  # a task's answers only: the others are -1

    def on_validation_epoch_end(self):
        ce = self.val_ce.compute()
        self.val_ce.reset()
        self.log("val/ce", ce, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(ce))

    # ----------------------------------------------------------- optimiser
    def configure_optimizers(self):
        o = self.hparams.optim
        # no decay on 1-D tensors (norms, logit bias) nor on q/k biases (model.qk_bias, 4-D)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if p.dim() >= 2 and not n.endswith("qk_bias")]
        no_decay = [p for n, p in named if p.dim() < 2 or n.endswith("qk_bias")]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o["lr"], betas=tuple(o["betas"]), eps=o.get("eps", 1e-8),
        )  # not fused: Lightning refuses to clip gradients of a fused optimiser under AMP
        total, warmup, ratio = self.hparams.max_steps, o["warmup_steps"], o["min_lr_ratio"]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, warmup, total, ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint):
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(p).all()]
        if bad:  # never replace a good checkpoint with a diverged one
            raise TrainingDiverged(f"non-finite weights at step {self.global_step} ({bad[0]}, {len(bad)} tensors): "
                                   "training diverged and was stopped; the checkpoint was not written")
        checkpoint["loop_sampler"] = self.sampler.state_dict()
        for lg in self.trainer.loggers:  # the curves on disk reach the checkpoint: a resume carries them over
            lg.save()
        if self.noise is not None:
            checkpoint["noise_generator"] = {"device": self.noise.device.type, "state": self.noise.get_state()}
        checkpoint["train_seconds"] = self.train_seconds
        if self.vocab_to_gpt2 is not None:
            checkpoint["vocab_to_gpt2"] = self.vocab_to_gpt2
        if self.data_config is not None:
            checkpoint["data_config"] = self.data_config
        if self.training_config is not None:
            checkpoint["training_config"] = self.training_config
        if self.eval_config is not None:
            checkpoint["eval_config"] = self.eval_config
        if self.frontier_config:
            checkpoint["frontier_config"] = self.frontier_config

    def on_load_checkpoint(self, checkpoint):
        if "loop_sampler" in checkpoint:
            self.sampler.load_state_dict(checkpoint["loop_sampler"])
        if "noise_generator" in checkpoint:
            g = checkpoint["noise_generator"]
            self._noise_state = (g["device"], g["state"].cpu())  # set_state takes a CPU byte tensor
        self.train_seconds_before = float(checkpoint.get("train_seconds", 0.0))
        self.vocab_to_gpt2 = checkpoint.get("vocab_to_gpt2")
        self.data_config = checkpoint.get("data_config")
