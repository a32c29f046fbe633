"""A run's checkpoint directory read as files: its committed steps and the config a step stores.

Apart from `train.checkpoint` (orbax, jax) so that checking a config (`python -m rstar_jax.config
--check_files`) can look into the run `train.init_from` names without importing jax.
"""

from __future__ import annotations

import json
import pathlib

from rstar_jax.errors import UserError


class CheckpointError(UserError):
    """A checkpoint that is missing or does not match its restore target."""


def checkpoints_directory(path: str | pathlib.Path) -> pathlib.Path:
    """A run directory or its checkpoints/ directory -> the directory holding the step directories."""
    path = pathlib.Path(path)
    nested = path / "checkpoints"
    return nested if nested.is_dir() else path


def checkpoint_steps(path: str | pathlib.Path) -> list[int]:
    """The checkpoint steps under a run directory (or its checkpoints/ directory), ascending. Orbax
    writes a step under a temporary name and renames it when committed, so a step directory is a
    committed checkpoint."""
    directory = checkpoints_directory(path)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def stored_config(path: str | pathlib.Path, step: int | None = None) -> dict | None:
    """The run config a checkpoint step holds (default: the latest step that has one); None without."""
    directory = checkpoints_directory(path)
    steps = [step] if step is not None else list(reversed(checkpoint_steps(directory)))
    for s in steps:
        # The JSON item as orbax writes it, read directly: inspecting a run needs no checkpoint manager.
        item = directory / str(s) / "config" / "metadata"
        if item.is_file():
            try:
                return json.loads(item.read_text()) or None
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{item}: the stored config is not valid JSON ({e.msg})") from None
    return None
