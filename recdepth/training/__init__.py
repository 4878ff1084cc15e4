"""Training: the LightningModule, callbacks, loop-count samplers, DDP, runs and checkpoints."""
