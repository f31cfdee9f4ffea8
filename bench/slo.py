"""Goodput under latency objectives (issue #44): a mix of request classes,
each request sending its own TTFT and TPOT targets, and what share of them
a server meets.

A class (``RequestClass``) is a priority, targets and lengths, and its share
of the requests; the default mix is *interactive* (priority 0, TTFT 1 s,
TPOT 200 ms, short) and *batch* (priority 1, TTFT 20 s, TPOT 1 s, longer).
``run_mix`` sends a mix at a rate, Poisson (``burstiness`` 1) or burstier
(< 1), each request with its class's ``ttft_ms`` / ``tpot_ms`` body fields
(and ``priority``, unless the setup is first come, first served);
``summarize`` says per class and in all how many were refused at the door
(HTTP 429 or 503), admitted, and met both targets.

A request *meets* its targets when it completed, its first token came within
the TTFT target and its mean time per output token after the first within
the TPOT target, as the client measured them. *Goodput* is the requests that
met them per second of offered load (``num_requests / rate``): the offered
rate times the share met, so a server that refuses or misses nothing has a
goodput equal to its load.

Where the server predicts TTFTs (the slo policy), ``summarize`` also says
how good its predictions were for the requests it admitted
(``prediction_error``): the issue's goal is a p90 relative error under 20%
on these mixes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs
import trio

from .client import Target, arrival_offsets, open_client, send_request
from .datasets import SampleRequest, Tokenizer, random_dataset
from .measurement import RequestMeasurement
from .metrics import tpot_of
from .stats import percentile

# A refusal at the door: too loaded (429) or degraded (503).
REFUSED_STATUSES = ("HTTP 429", "HTTP 503")
# An admitted request's TTFT may exceed its target by this share before it
# counts as late (the goal: none does).
LATE_MARGIN = 0.2


@attrs.frozen
class RequestClass:
    """One class of the mix: its priority, targets (ms) and lengths, and
    its ``share`` of the requests (the shares are normalized)."""

    name: str
    priority: int
    ttft_ms: float
    tpot_ms: float | None
    share: float
    input_len: int
    output_len: int

    def body(self, *, with_priority: bool) -> dict:
        """The fields its requests add to their body."""
        fields: dict = {"ttft_ms": self.ttft_ms}
        if self.tpot_ms is not None:
            fields["tpot_ms"] = self.tpot_ms
        if with_priority:
            fields["priority"] = self.priority
        return fields

    def met_by(self, output: RequestMeasurement) -> bool:
        """Whether ``output`` completed within both targets."""
        if not output.success or output.ttft * 1000 > self.ttft_ms:
            return False
        tpot = tpot_of(output)
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


DEFAULT_CLASSES = (
    RequestClass("interactive", priority=0, ttft_ms=1000, tpot_ms=200, share=0.5, input_len=32, output_len=16),
    RequestClass("batch", priority=1, ttft_ms=20000, tpot_ms=1000, share=0.5, input_len=128, output_len=32),
)


@attrs.frozen
class MixedRequest:
    """One request of the mix and its class."""

    sample: SampleRequest
    request_class: RequestClass


def mixed_requests(
    tokenizer: Tokenizer, classes: Sequence[RequestClass], num_requests: int, *, seed: int = 0
) -> list[MixedRequest]:
    """``num_requests`` requests, each of a class drawn by share (seeded),
    with a random prompt of its class's length."""
    rng = random.Random(seed)
    drawn = rng.choices(classes, weights=[c.share for c in classes], k=num_requests)
    prompts = {
        c.name: iter(random_dataset(tokenizer, num_prompts=max(1, drawn.count(c)), input_len=c.input_len,
                                    output_len=c.output_len, seed=seed + i))
        for i, c in enumerate(classes)
    }  # fmt: skip
    return [MixedRequest(next(prompts[c.name]), c) for c in drawn]


@attrs.frozen
class MixRun:
    """The outputs of one run of a mix, in its order, and its load."""

    requests: tuple[MixedRequest, ...]
    outputs: tuple[RequestMeasurement, ...]
    offered_rps: float
    burstiness: float
    duration_s: float  # from the first request sent to the last answer


async def run_mix(
    target: Target,
    requests: Sequence[MixedRequest],
    *,
    request_rate: float,
    burstiness: float = 1.0,
    with_priority: bool = True,
    seed: int = 0,
) -> MixRun:
    """Send ``requests`` at ``request_rate`` per second (gamma gaps of
    shape ``burstiness``: 1 is Poisson), each with its class's targets (and
    priority when ``with_priority``), and wait for every answer."""
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed=seed)
    outputs: list[RequestMeasurement | None] = [None] * len(requests)

    async def one(client, i: int) -> None:
        body = requests[i].request_class.body(with_priority=with_priority)
        outputs[i] = await send_request(client, target, requests[i].sample, body)

    async with open_client(target, None) as client:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i, offset in enumerate(offsets):
                await trio.sleep_until(start + offset)
                nursery.start_soon(one, client, i)
        duration = trio.current_time() - start
    return MixRun(tuple(requests), tuple(outputs), request_rate, burstiness, duration)  # type: ignore[arg-type]


def refused(output: RequestMeasurement) -> bool:
    """Whether the server refused ``output``'s request at the door."""
    return not output.success and output.error.startswith(REFUSED_STATUSES)


def summarize(run: MixRun) -> dict:
    """Per class and in all: requests, refused, admitted, met, goodput,
    TTFTs of the admitted (ms, in order, for CDFs; a request that never got
    a token has none), and the admitted whose TTFT (or whose missing first
    token) overran the target by more than ``LATE_MARGIN``."""
    window_s = len(run.requests) / run.offered_rps
    classes: dict[str, dict] = {}
    for request, output in zip(run.requests, run.outputs):
        c = request.request_class
        entry = classes.setdefault(
            c.name,
            {"ttft_target_ms": c.ttft_ms, "tpot_target_ms": c.tpot_ms, "requests": 0, "refused": 0, "admitted": 0,
             "met": 0, "late": 0, "ttft_ms": [], "errors": {}, "predictions": []},
        )  # fmt: skip
        entry["requests"] += 1
        if refused(output):
            entry["refused"] += 1
            continue
        entry["admitted"] += 1
        entry["met"] += c.met_by(output)
        if output.success:
            entry["ttft_ms"].append(output.ttft * 1000)
            if output.predicted_ttft is not None and output.server_ttft:
                entry["predictions"].append((output.predicted_ttft, output.server_ttft))
        if not output.success or output.ttft * 1000 > (1 + LATE_MARGIN) * c.ttft_ms:
            entry["late"] += 1
        if not output.success:
            key = output.error.split(":", 1)[0][:60]
            entry["errors"][key] = entry["errors"].get(key, 0) + 1
    pairs = []
    for entry in classes.values():
        entry["ttft_ms"].sort()
        entry["ttft_p90_ms"] = percentile(entry["ttft_ms"], 90) if entry["ttft_ms"] else None
        pairs += entry["predictions"]
        entry["ttft_prediction"] = prediction_error(entry.pop("predictions"))
    total = {key: sum(e[key] for e in classes.values()) for key in ("requests", "refused", "admitted", "met", "late")}
    return {
        "offered_rps": run.offered_rps,
        "burstiness": run.burstiness,
        "duration_s": run.duration_s,
        **total,
        "goodput_rps": total["met"] / window_s,
        "attainment": total["met"] / total["requests"] if total["requests"] else 0.0,
        "refused_fraction": total["refused"] / total["requests"] if total["requests"] else 0.0,
        "ttft_prediction": prediction_error(pairs),
        "classes": classes,
    }


def prediction_error(pairs: Sequence[tuple[float, float]]) -> dict | None:
    """How close predicted TTFTs came to the measured ones, over ``pairs``
    of (predicted, measured) seconds: the relative error ``|p - m| / m``'s
    p50 and p90, and the bias (sum predicted / sum measured: above 1,
    predicted too slow). None without pairs."""
    if not pairs:
        return None
    errors = sorted(abs(p - m) / m for p, m in pairs)
    return {
        "n": len(errors),
        "rel_err_p50": percentile(errors, 50),
        "rel_err_p90": percentile(errors, 90),
        "bias": sum(p for p, _ in pairs) / sum(m for _, m in pairs),
    }


# The share of requests meeting their targets at which a setup still
# "serves the load within targets" (DistServe's attainment goal).
CAPACITY_ATTAINMENT = 0.9
# The goal: at this multiple of FCFS's capacity, the slo policy
# keeps at least this multiple of FCFS's goodput.
GOAL_LOAD = 1.5
GOAL_GOODPUT = 1.5


def capacity_rps(runs: Sequence[dict], attainment: float = CAPACITY_ATTAINMENT) -> float | None:
    """The highest offered rate up to which every run of ``runs`` (summaries
    of one setup and arrival shape) met at least ``attainment`` of its
    requests' targets; None when the lowest rate already fell short."""
    capacity = None
    for run in sorted(runs, key=lambda r: r["offered_rps"]):
        if run["attainment"] < attainment:
            break
        capacity = run["offered_rps"]
    return capacity


def goal(fcfs: Sequence[dict], slo: Sequence[dict], attainment: float = CAPACITY_ATTAINMENT) -> dict:
    """The issue's goodput goal for one arrival shape: FCFS's capacity
    (``capacity_rps``), the lowest measured rate at or above ``GOAL_LOAD``
    times it, and there each setup's goodput, their ratio and the slo
    policy's late admitted requests. ``at_rps`` is None when no rate that
    high was run (or FCFS met its targets at none)."""
    capacity = capacity_rps(fcfs, attainment)
    result: dict = {"attainment": attainment, "fcfs_capacity_rps": capacity, "at_rps": None}
    if capacity is None:
        return result
    by_rate = {r["offered_rps"]: r for r in slo}
    high = sorted(
        r["offered_rps"] for r in fcfs if r["offered_rps"] >= GOAL_LOAD * capacity and r["offered_rps"] in by_rate
    )
    if not high:
        return result
    at = high[0]
    f = next(r for r in fcfs if r["offered_rps"] == at)
    s = by_rate[at]
    ratio = s["goodput_rps"] / f["goodput_rps"] if f["goodput_rps"] else float("inf")
    result.update(
        at_rps=at,
        fcfs_goodput_rps=f["goodput_rps"],
        slo_goodput_rps=s["goodput_rps"],
        ratio=ratio,
        slo_late=s["late"],
        met=ratio >= GOAL_GOODPUT and s["late"] == 0,
    )
    return result
