"""Decoding: how held-out tokens go through the looped model under an exit rule
(`settings.DecodeSettings`, the one object the engine and scoring read)."""
