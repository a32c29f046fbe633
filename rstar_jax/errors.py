"""Errors a user can fix, and the helper that names the config field behind a settings dataclass.

A `UserError` is bad input (a config, a dataset, a checkpoint, a request) whose message names the
field, row or file. The commands print it as `error: <line>` per line and exit with status 2,
without a traceback (`rstar_jax.config.cli`). This module imports nothing from the project, so any
layer may raise these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class UserError(ValueError):
    """Bad input whose message names the field, row or file; commands exit 2 without a traceback."""


class ConfigError(UserError):
    """An invalid config: one line per problem, each `config.<dotted.field>: <message>`."""

    def __init__(self, problems: str | Iterable[str]):
        if isinstance(problems, str):
            problems = problems.splitlines() or [problems]
        self.problems: list[str] = list(problems)
        super().__init__("\n".join(self.problems))

    def __reduce__(self):  # pickles (multiprocessing) with the problem list intact
        return type(self), (self.problems,)


def _rest_after(message: str, prefix: str) -> str | None:
    """The message after `prefix` when it is followed by a space or a colon (not a longer name)."""
    if not message.startswith(prefix) or len(message) == len(prefix) or message[len(prefix)] not in " :":
        return None
    return message[len(prefix):].lstrip(":").lstrip()


def from_fields(cls: type[T], fields: Mapping[str, tuple[str, Any]]) -> T:
    """`cls(**values)` from `{dataclass field: (config path, value)}`, naming the config field on error.

    The dataclasses check their own values and raise `ValueError("<Class>.<field> <message>")`;
    that becomes `ConfigError("config.<config path>: <message>")`, so a user reads the name they
    set (`config.rl.roc_variant`), not the internal one (`RocConfig.variant`). Another ValueError
    is reported on the section of the first config path.
    """
    try:
        return cls(**{name: value for name, (_, value) in fields.items()})
    except ConfigError:
        raise
    except ValueError as e:
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())  # one line
        for name, (path, _) in fields.items():
            rest = _rest_after(message, f"{cls.__name__}.{name}")
            if rest is not None:
                raise ConfigError(f"config.{path}: {rest}") from None
        paths = [path for path, _ in fields.values()]
        section = paths[0].rpartition(".")[0] or paths[0] if paths else ""
        raise ConfigError(f"config.{section}: {message}" if section else f"config: {message}") from None
