"""Integrations: Hugging Face (Huginn) checkpoints and the lm-evaluation-harness model."""
