"""Helpers the training tests share (tests/training/test_resume.py, test_scaleout.py)."""

from pathlib import Path


def steps_of(train_dir: Path) -> list[int]:
    return sorted(int(f.stem.split("_")[1]) for f in train_dir.glob("diagnostics/step_*.json"))
