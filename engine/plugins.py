"""Plugins: hooks found through ``importlib.metadata`` entry points.

A plugin is an entry point in one of ``GROUPS``' groups; ``--plugins a,b``
(``EngineConfig.plugins``) loads, by name, every entry point so named in
any of them (a package may offer one name in several groups). A name found
in none stops startup with ``UnknownPluginError``, which lists the names on
offer. What each group's entry point must be (docs/api.md, "Plugins"):

- ``trioserve.request_preprocessors``: ``fn(body, context) -> body``. Sees
  a completion request's JSON body (a dict) before it is parsed and may
  return a rewritten one, or raise ``PluginRejection`` to refuse it with an
  API error.
- ``trioserve.output_postprocessors``: ``factory(context) -> process``,
  called once per request; ``process(output) -> output`` sees each
  ``RequestOutput`` delta and returns it, changed (``attrs.evolve``: redact
  ``text_delta``) or ended (a ``finish_reason`` set: that completion stops
  there; the request is aborted once all its completions have ended).
- ``trioserve.logits_processors``: ``factory(args) -> processor``, chosen
  per request by name (``logits_processors`` in the request).
  ``processor(output_token_ids, logits) -> logits`` runs in the sampler,
  where the step runs, on one sequence's float32 logits ``[vocab]``. The
  factory runs once when the request is validated (to check ``args``;
  raise ``ValueError`` to refuse them) and once per sequence in the step
  thread. The step plan carries only names and arguments.
- ``trioserve.scheduling_policies``: ``factory(config) ->
  SchedulingPolicy``; at most one may be loaded. The built-in policy is
  ``PriorityPolicy``. A factory that takes a ``latency`` keyword is called
  ``factory(config, latency=model)`` with the engine's one latency model
  (engine/core/latency_model.py), the one its steps teach and
  ``--slo-profile`` seeds.
- ``trioserve.metrics``: ``fn(registry)`` registers Prometheus collectors
  on the server's registry (a collector whose ``collect`` raises is left
  out of that scrape, with a log line).

A hook that raises is isolated: the request it was working on fails with an
error naming the plugin (``PluginError``), and the engine serves on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any, Protocol

import attrs

from trioserve.engine.errors import TrioserveError

log = logging.getLogger(__name__)

# The hook kinds, by the name used here, and their entry-point groups.
GROUPS = {
    "request_preprocessors": "trioserve.request_preprocessors",
    "output_postprocessors": "trioserve.output_postprocessors",
    "logits_processors": "trioserve.logits_processors",
    "scheduling_policies": "trioserve.scheduling_policies",
    "metrics": "trioserve.metrics",
}


class UnknownPluginError(TrioserveError, ValueError):
    """``--plugins`` names a plugin that no installed package offers."""

    def __init__(self, name: str, available: Sequence[str]) -> None:
        offered = ", ".join(available) or "none installed"
        super().__init__(f"unknown plugin {name!r}; available: {offered}")
        self.name = name
        self.available = tuple(available)


class PluginLoadError(TrioserveError):
    """A plugin's entry point could not be loaded, or is not what its group needs."""


class PluginError(TrioserveError):
    """A plugin raised while working on a request: the request fails with
    this (its message names the plugin and the exception's class), and the
    engine serves on. Picklable: it carries text only."""

    def __init__(self, plugin: str, hook: str, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.hook = hook
        self.detail = detail  # the plugin's own message: for the log, not the client

    def __reduce__(self) -> tuple[Any, ...]:
        return (PluginError, (self.plugin, self.hook, str(self), self.detail))

    @classmethod
    def from_exception(cls, plugin: str, hook: str, exc: BaseException) -> PluginError:
        """The error for ``exc`` raised by ``plugin``'s ``hook``: the message
        names the plugin and the exception's class; ``detail`` keeps its text."""
        return cls(plugin, hook, f"plugin {plugin!r} failed in its {hook} ({type(exc).__name__})", f"{type(exc).__name__}: {exc}")


class PluginRejection(Exception):
    """Raised by a request pre-processor to refuse a request: the client
    gets an API error with this ``status``, message, ``param`` and ``code``."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        if not 400 <= status <= 499:
            raise ValueError(f"status must be a 4xx client error, got {status}")
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


@attrs.frozen
class RequestContext:
    """What pre- and post-processors are told of a request."""

    endpoint: str  # "completions" or "chat.completions" (HTTP), "grpc.generate"
    model: str | None  # the model the request names (the served name once chosen)
    request_id: str | None = None  # known once the request is queued
    # The request's JSON body as the pre-processors left it (None over gRPC);
    # extra fields a plugin reads may ride in it. Read it, do not change it.
    body: Mapping[str, Any] | None = None


class SchedulingPolicy(Protocol):
    """The order of the waiting requests and the choice of preemption victims.

    ``key(request, age)`` sorts requests (``engine/sequence.Request``; read
    it, never change it): a lower key runs first and is preempted last; a
    tuple of numbers. ``age`` is the steps since the request was admitted.
    ``outranks(key_a, key_b)``: whether a waiting request of key ``a`` that
    does not fit may preempt a running one of key ``b``. Both run on every
    step for every request, so they must be cheap.

    Optional: ``token_budget(running, tokens, now) -> int`` cuts a step's
    token budget (at most ``tokens``, given the running requests);
    ``observe_step(num_tokens, seconds)`` is told each step's tokens and
    time; with every sequence slot taken, ``slot_victim(request,
    candidates, *, running, now, limits)`` names the running request (of
    ``candidates``, those that do not outrank ``request``) to preempt for the
    head waiting request's slot, or None; and ``victims(...)``, with the same
    arguments, lists the candidates it would accept, which SLO admission
    asks at the door. The built-in ``slo`` policy
    (engine/core/slo_policy.py) has ``token_budget``, ``slot_victim`` and
    ``victims``, predicting from its latency model.
    """

    def key(self, request: Any, age: int) -> tuple[float, ...]: ...

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool: ...


@attrs.frozen
class PriorityPolicy:
    """The built-in policy: effective priority, then arrival. A request's
    ``priority`` improves by one level every ``aging_interval`` steps since
    admission (None: no aging); only a strictly better level preempts."""

    aging_interval: int | None = None

    def key(self, request: Any, age: int) -> tuple[int, int]:
        if not self.aging_interval:
            return (request.priority, request.arrival_index)
        return (request.priority - age // self.aging_interval, request.arrival_index)

    def outranks(self, key_a: tuple[float, ...], key_b: tuple[float, ...]) -> bool:
        return key_a[0] < key_b[0]


@attrs.frozen
class Plugins:
    """The loaded plugins, by hook; ``load(names)`` makes one."""

    names: tuple[str, ...] = ()
    request_preprocessors: tuple[tuple[str, Callable[..., Any]], ...] = ()
    output_postprocessors: tuple[tuple[str, Callable[..., Any]], ...] = ()
    logits_processors: Mapping[str, Callable[..., Any]] = attrs.field(factory=dict)
    scheduling_policy: tuple[str, Callable[..., Any]] | None = None
    metrics: tuple[tuple[str, Callable[..., Any]], ...] = ()

    @classmethod
    def load(cls, names: Iterable[str]) -> Plugins:
        """Load every entry point named in ``names``, from every group;
        ``UnknownPluginError`` for a name none offers."""
        names = tuple(dict.fromkeys(names))
        if not names:
            return cls()
        offered = available()
        found: dict[str, list[tuple[str, Any]]] = {kind: [] for kind in GROUPS}
        for name in names:
            kinds = [kind for kind, group in GROUPS.items() if name in offered[group]]
            if not kinds:
                everything = sorted({n for group in offered.values() for n in group})
                raise UnknownPluginError(name, everything)
            for kind in kinds:
                found[kind].append((name, _load(offered[GROUPS[kind]][name], kind)))
        if len(found["scheduling_policies"]) > 1:
            both = ", ".join(name for name, _ in found["scheduling_policies"])
            raise PluginLoadError(f"at most one scheduling policy may be loaded, got {both}")
        return cls(
            names=names,
            request_preprocessors=tuple(found["request_preprocessors"]),
            output_postprocessors=tuple(found["output_postprocessors"]),
            logits_processors=dict(found["logits_processors"]),
            scheduling_policy=found["scheduling_policies"][0] if found["scheduling_policies"] else None,
            metrics=tuple(found["metrics"]),
        )

    def check_logits_processors(self, specs: Sequence[Any]) -> None:
        """Refuse a request's logits processors unless each is loaded and
        takes its arguments (its factory may raise ``ValueError``)."""
        from trioserve.engine.errors import InvalidRequestError

        for spec in specs:
            factory = self.logits_processors.get(spec.name)
            if factory is None:
                loaded = ", ".join(sorted(self.logits_processors)) or "none loaded"
                raise InvalidRequestError(
                    f"logits_processors names {spec.name!r}, which is not loaded (loaded: {loaded})",
                    field="logits_processors",
                )
            try:
                factory(dict(spec.args))
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(
                    f"logits_processors: {spec.name!r} refused its args: {exc}", field="logits_processors"
                ) from None
            except Exception as exc:
                raise PluginError.from_exception(spec.name, "logits processor factory", exc) from exc


def available() -> dict[str, dict[str, metadata.EntryPoint]]:
    """The installed entry points of each group, by name."""
    return {group: {ep.name: ep for ep in metadata.entry_points(group=group)} for group in GROUPS.values()}


def _load(entry_point: metadata.EntryPoint, kind: str) -> Any:
    try:
        value = entry_point.load()
    except Exception as exc:
        raise PluginLoadError(
            f"plugin {entry_point.name!r} ({entry_point.value}, {GROUPS[kind]}) failed to load: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(value):
        raise PluginLoadError(f"plugin {entry_point.name!r} in {GROUPS[kind]} is not callable: {entry_point.value}")
    log.info("plugin %s: %s from %s", entry_point.name, kind.replace("_", " ").rstrip("s"), entry_point.value)
    return value
