"""The commands' runner: job directories, refusal, the Hydra main, one-line errors, multirun jobs."""
