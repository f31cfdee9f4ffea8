"""The options of latency objectives (issue #44; docs/reliability.md,
"Latency objectives"): the scheduling policy, and the targets a request
that gives none gets, per server, per priority class and per model.

Each default is ``TTFT_MS:TPOT_MS``, a ``-`` for a target left unset:
``--slo-class-defaults '0:500:100,1:20000:-'`` gives priority 0 a 500 ms
TTFT and a 100 ms TPOT target and priority 1 a 20 s TTFT target only.
"""

from __future__ import annotations

import argparse

from trioserve.engine.config import SCHEDULING_POLICIES, EngineConfig
from trioserve.engine.latency_objectives import LatencyObjectives, ObjectiveDefaults
from trioserve.engine.errors import InvalidRequestError

from .option_types import recording
from .slo_profile import check_profiles


def milliseconds(text: str) -> float:
    """A target in ms: a finite number > 0, at most a day; its value in seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds > 0, got {text!r}") from None
    try:
        return LatencyObjectives(ttft=value / 1000).ttft
    except InvalidRequestError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds > 0 and at most a day, got {text!r}") from None


def _targets(text: str) -> LatencyObjectives:
    ttft, sep, tpot = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TTFT_MS:TPOT_MS (- for none), got {text!r}")
    return LatencyObjectives(
        ttft=None if ttft.strip() == "-" else milliseconds(ttft), tpot=None if tpot.strip() == "-" else milliseconds(tpot)
    )


def class_defaults(text: str) -> dict[int, LatencyObjectives]:
    """``PRIORITY:TTFT_MS:TPOT_MS,...`` -> {priority: objectives}."""
    defaults = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        priority, sep, rest = item.partition(":")
        try:
            key = int(priority)
        except ValueError:
            key = None
        if not sep or key is None:
            raise argparse.ArgumentTypeError(f"expected PRIORITY:TTFT_MS:TPOT_MS, got {item!r}")
        defaults[key] = _targets(rest)
    return defaults


def model_defaults(text: str) -> dict[str, LatencyObjectives]:
    """``MODEL=TTFT_MS:TPOT_MS,...`` -> {model name: objectives}."""
    defaults = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, rest = item.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected MODEL=TTFT_MS:TPOT_MS, got {item!r}")
        defaults[name.strip()] = _targets(rest)
    return defaults


def add_slo_options(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> list[argparse.Action]:
    """The scheduling policy and the default objectives, in ``group``;
    returns the options added, in order."""
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=EngineConfig().scheduling_policy,
        help="priority: lower priority values first, first come first served within a class; slo: order a class "
        "by deadline slack and refuse at once (429) what cannot meet its ttft_ms / tpot_ms (default: priority)",
    )
    add("--slo-ttft-ms", type=milliseconds, default=None, help="the server's default TTFT target, in ms (default: none)")
    add("--slo-tpot-ms", type=milliseconds, default=None, help="the server's default TPOT target, in ms (default: none)")
    add(
        "--slo-class-defaults",
        type=class_defaults,
        default={},
        metavar="PRIORITY:TTFT_MS:TPOT_MS,...",
        help="default targets per priority class, - for none, e.g. '0:500:100,1:20000:-' (default: none)",
    )
    add(
        "--slo-model-defaults",
        type=model_defaults,
        default={},
        metavar="MODEL=TTFT_MS:TPOT_MS,...",
        help="default targets per served model or adapter name, - for none (default: none)",
    )
    add(
        "--slo-profile",
        default=None,
        metavar="PATH",
        help="keep the slo policy's latency model across restarts: seed it from PATH at start if there, write it "
        "there at stop (PATH.i per replica with --data-parallel-size); needs --scheduling-policy slo (default: none)",
    )
    return actions


def slo_profile_from_args(args: argparse.Namespace) -> str | None:
    """``--slo-profile``, its file checked now: one that is there and is
    not a valid profile stops the server before the model loads
    (``ValueError`` naming the field)."""
    if args.slo_profile is not None and args.scheduling_policy == "slo":
        check_profiles(args.slo_profile, args.data_parallel_size)
    return args.slo_profile


def slo_config_from_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_slo_options`` set."""
    return dict(
        scheduling_policy=args.scheduling_policy,
        slo_defaults=ObjectiveDefaults(
            LatencyObjectives(args.slo_ttft_ms, args.slo_tpot_ms), args.slo_class_defaults, args.slo_model_defaults
        ),
    )
