"""The scheduler's policy: which waiting request runs first, which running
one is preempted. The built-in ones, chosen by ``--scheduling-policy``:
``priority`` (``PriorityPolicy``, engine/plugins.py) and ``slo``
(``SloPolicy``, engine/core/slo_policy.py); a plugin of
``trioserve.scheduling_policies`` may replace either.

Every policy of an engine predicts from the engine's one latency model
(engine/core/latency_model.py), which the caller passes in: the model that
SLO admission predicts with, that the scheduler actor feeds each step's
time and that ``--slo-profile`` seeds. A plugin's factory that takes a
``latency`` keyword gets it (``factory(config, latency=model)``), so its
predictions learn from the same steps; the built-in fallback has it too.

A plugin's policy runs inside the scheduler, on every step, so it is
guarded (``GuardedPolicy``): if it raises, or returns a key that is not a
tuple of numbers, the error is logged once and the scheduler goes on with
the built-in policy for the rest of the engine's life. A policy cannot fail
a request (there is none to blame), and a broken one must not stop the
engine.
"""

from __future__ import annotations

import inspect
import logging
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.latency_model import LatencyModel
from trioserve.engine.core.slo_policy import SloPolicy
from trioserve.engine.plugins import PluginLoadError, Plugins, PriorityPolicy, SchedulingPolicy

log = logging.getLogger(__name__)


def scheduling_policy(plugins: Plugins, config: EngineConfig, latency: LatencyModel) -> SchedulingPolicy:
    """The policy ``plugins`` give (guarded), or the built-in one
    ``config.scheduling_policy`` names; either predicts with ``latency``,
    the engine's latency model."""
    builtin: PriorityPolicy | SloPolicy
    if config.scheduling_policy == "slo":
        builtin = SloPolicy(config.priority_aging_steps, latency=latency)
    else:
        builtin = PriorityPolicy(config.priority_aging_steps)
    if plugins.scheduling_policy is None:
        return builtin
    name, factory = plugins.scheduling_policy
    try:
        policy = factory(config, latency=latency) if _takes_latency(factory) else factory(config)
    except Exception as exc:
        raise PluginLoadError(f"scheduling policy {name!r} failed to start: {type(exc).__name__}: {exc}") from exc
    if not (callable(getattr(policy, "key", None)) and callable(getattr(policy, "outranks", None))):
        raise PluginLoadError(f"scheduling policy {name!r} has no key and outranks methods")
    return GuardedPolicy(name, policy, builtin)


def _takes_latency(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` takes a ``latency`` keyword (or any keyword):
    a factory of ``factory(config)`` alone, as before, still loads."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension callable without a signature
        return False
    return any(
        (p.name == "latency" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)) or p.kind is p.VAR_KEYWORD
        for p in parameters
    )


@attrs.define(eq=False)
class GuardedPolicy:
    """A plugin's policy, replaced by ``fallback`` from its first failure on.

    The optional hooks (``token_budget``, ``observe_step``, ``slot_victim``,
    ``victims``: engine/plugins.py's ``SchedulingPolicy``) are the plugin's
    where it has them, guarded the same way; where it has none, nothing is
    cut, learned or preempted for a slot, as the plugin asked; after a
    failure, the fallback's."""

    name: str
    policy: Any
    fallback: PriorityPolicy | SloPolicy
    failed: bool = False

    def key(self, request: Any, age: int) -> tuple[float, ...]:
        if not self.failed:
            try:
                key = self.policy.key(request, age)
                if isinstance(key, tuple) and key and all(isinstance(k, numbers.Real) for k in key):
                    return key
                raise TypeError(f"key must be a non-empty tuple of numbers, got {key!r}")
            except Exception as exc:
                self._fail(exc)
        return self.fallback.key(request, age)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        if not self.failed:
            try:
                return bool(self.policy.outranks(key_a, key_b))
            except Exception as exc:
                self._fail(exc)
        return self.fallback.outranks(key_a, key_b)

    def token_budget(self, running: Sequence[Any], tokens: int, now: float) -> int:
        hook = self._hook("token_budget")
        if hook is None:
            return tokens
        try:
            budget = hook(running, tokens, now)
            if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
                return int(budget)
            raise TypeError(f"token_budget must return an int, got {budget!r}")
        except Exception as exc:
            self._fail(exc)
        return self.token_budget(running, tokens, now)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        hook = self._hook("observe_step")
        if hook is None:
            return
        try:
            hook(num_tokens, seconds)
        except Exception as exc:
            self._fail(exc)

    def slot_victim(self, request: Any, candidates: Sequence[Any], **context: Any) -> Any | None:
        hook = self._hook("slot_victim")
        if hook is None:
            return None
        try:
            victim = hook(request, candidates, **context)
            if victim is None or any(victim is c for c in candidates):
                return victim
            raise TypeError(f"slot_victim must return one of the candidates or None, got {victim!r}")
        except Exception as exc:
            self._fail(exc)
        return self.slot_victim(request, candidates, **context)

    def victims(self, request: Any, candidates: Sequence[Any], **context: Any) -> list[Any]:
        hook = self._hook("victims")
        if hook is None:
            return []
        try:
            chosen = list(hook(request, candidates, **context))
            if all(any(v is c for c in candidates) for v in chosen):
                return chosen
            raise TypeError("victims must return some of the candidates")
        except Exception as exc:
            self._fail(exc)
        return self.victims(request, candidates, **context)

    def _hook(self, name: str) -> Callable[..., Any] | None:
        """The plugin's optional hook ``name`` (the fallback's once it has failed), or None."""
        return getattr(self.fallback if self.failed else self.policy, name, None)

    def _fail(self, exc: Exception) -> None:
        self.failed = True
        log.error(
            "scheduling policy %r failed (%s: %s); the built-in policy schedules from now on",
            self.name,
            type(exc).__name__,
            exc,
        )
