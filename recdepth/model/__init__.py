"""The looped GPT-2: its configuration, the model, and the fast one-token step."""
