"""A real Lightning fit of a tiny LoopedLM on random tokens (shared by tests; not a test module)."""

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from recdepth.training.lit import LoopedLM

CFG = dict(n_layer=6, n_head=2, n_embd=32, block_size=8, vocab_size=100, groups=[[1], [2, 3]], mean_recurrence=3)


def tiny_fit(tmp, callbacks=(), max_steps=5, checkpoint_every=None):
    """Fit for max_steps on fixed random batches; with checkpoint_every, a ModelCheckpoint
    writes <tmp>/checkpoints/last.ckpt every that many steps. Returns (module, trainer)."""
    L.seed_everything(0)
    lm = LoopedLM(model=CFG, sampler=dict(name="lognormal_poisson", mean=3, sigma=0.5, backprop_depth=2),
                  optim=dict(lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95], warmup_steps=2, min_lr_ratio=0.1),
                  max_steps=max_steps, seed=0, peak_flops=1e12)
    g = torch.Generator().manual_seed(0)
    data = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 100, (max_steps, 2, 9), generator=g)]
    cbs = list(callbacks)
    if checkpoint_every:
        cbs.append(ModelCheckpoint(dirpath=str(tmp / "checkpoints"), save_last=True, save_top_k=0,
                                   every_n_train_steps=checkpoint_every))
    tr = L.Trainer(max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp, name="csv", version=""),
                   callbacks=cbs, enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False,
                   enable_model_summary=False, log_every_n_steps=1)
    tr.fit(lm, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return lm, tr
