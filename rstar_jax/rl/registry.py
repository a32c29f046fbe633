"""Policy losses and advantage estimators by name, as tunix registers them.

A new objective is one function, registered here under a name, and that name in `LossConfig`
(`policy_loss`, `advantage_estimator`); the train step and the batch builder look it up, so neither
changes. The built-ins register themselves where they are defined: the GRPO-RoC loss as "grpo" in
`rstar_jax.rl.loss`, the group-normalised advantage as "grpo" in `rstar_jax.rl.advantages`. They are
also declared here by "module:function" path, so that their names are known (listed, and accepted by
`LossConfig`) without importing those modules: checking a config must not import jax. A declared
built-in's module is imported on its first `get`.

A policy loss is called inside the jitted step, once per micro-batch:

    loss(settings, logprobs, old_logprobs, advantages, loss_mask, **extras) -> (loss_sum, denominator, metrics)

with `settings` the `LossConfig` whole and [..., T] arrays. `extras` are further per-token arrays the
step provides by keyword: today `entropy` (gradient stopped), `sampler_logprobs` and `segment_ids`;
a loss takes the ones it uses and accepts the rest with `**extras`, so the step can offer more
without breaking it. It returns a *sum* and its denominator, not a mean (the step divides once by
the global total, which keeps the mean exact under micro-batching), and additive metrics (see
`grpo_loss`; the trainer's `finalize_metrics` reads grpo_loss's keys, so a variant returns at least
those that grpo_loss always returns).

An advantage estimator runs on the host over the rollouts RoC kept:

    estimator(rewards, group_ids) -> float32 advantages, one per rollout
"""

from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from rstar_jax.errors import UserError

F = TypeVar("F", bound=Callable)


class _Registry:
    """Functions by name; a name is bound once (re-registering the same function is allowed, so a
    reloaded module does not fail), and an unknown name's error lists the registered ones.

    `builtins` maps names to "module:function" paths, imported on first use, so that a name can be
    checked (`check`, `names`) without importing the module that defines it."""

    def __init__(self, kind: str, builtins: dict[str, str] | None = None):
        self.kind = kind
        self._functions: dict[str, Callable] = {}
        self._declared: dict[str, str] = dict(builtins or {})  # name -> "module:function", not yet imported

    def register(self, name: str) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty string, got {name!r}")

        def add(fn: F) -> F:
            declared = self._declared.get(name)
            if declared is not None:
                if declared == f"{fn.__module__}:{fn.__qualname__}":  # the built-in registering itself
                    self._functions[name] = fn
                    del self._declared[name]
                    return fn
                self._load(name)  # bound to the built-in now, so the check below names it
            bound = self._functions.get(name)
            if bound is not None and bound is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered (to {bound.__module__}."
                                 f"{bound.__qualname__}); pick another name")
            self._functions[name] = fn
            return fn

        return add

    def _load(self, name: str) -> None:
        """Imports a declared built-in (its module's decorator binds it; bound here if it did not)."""
        module, _, function = self._declared[name].partition(":")
        loaded = getattr(importlib.import_module(module), function)
        self._declared.pop(name, None)
        self._functions.setdefault(name, loaded)

    def is_registered(self, name) -> bool:
        """Whether `name` is bound or declared, without importing anything."""
        try:
            return name in self._functions or name in self._declared
        except TypeError:  # an unhashable name
            return False

    def check(self, name) -> None:
        """A UserError naming `name` and the registered ones unless it is registered (imports nothing)."""
        if not self.is_registered(name):
            known = ", ".join(repr(n) for n in self.names()) or "none"
            raise UserError(f"unknown {self.kind} {name!r}; registered: {known}")

    def get(self, name: str) -> Callable:
        self.check(name)
        if name in self._declared:
            self._load(name)
        return self._functions[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted({*self._functions, *self._declared}))


# The built-ins, by path: known by name before (and without) importing their modules.
_POLICY_LOSSES = _Registry("policy loss", {"grpo": "rstar_jax.rl.loss:grpo_policy_loss"})
_ADVANTAGE_ESTIMATORS = _Registry("advantage estimator", {"grpo": "rstar_jax.rl.advantages:group_advantages"})


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: `@register_policy_loss("name")` makes the function `LossConfig(policy_loss="name")`."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> Callable:
    """The policy loss registered as `name`; a UserError names it and the registered ones otherwise."""
    return _POLICY_LOSSES.get(name)


def policy_loss_names() -> tuple[str, ...]:
    return _POLICY_LOSSES.names()


def check_policy_loss(name: str) -> None:
    """`get_policy_loss`'s UserError for an unknown name, without importing the loss (no jax)."""
    _POLICY_LOSSES.check(name)


def register_advantage_estimator(name: str) -> Callable[[F], F]:
    """Decorator: `@register_advantage_estimator("name")` makes the function
    `LossConfig(advantage_estimator="name")`."""
    return _ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> Callable:
    """The advantage estimator registered as `name`; a UserError names it and the registered ones otherwise."""
    return _ADVANTAGE_ESTIMATORS.get(name)


def advantage_estimator_names() -> tuple[str, ...]:
    return _ADVANTAGE_ESTIMATORS.names()


def check_advantage_estimator(name: str) -> None:
    """`get_advantage_estimator`'s UserError for an unknown name, without importing the estimator."""
    _ADVANTAGE_ESTIMATORS.check(name)
