"""``trioserve bench slo`` (bench/slo.py, bench/figures/slo.py) against a
fake server that keeps or misses latency objectives on purpose.

The fake refuses (429) a request whose TTFT target is under 500 ms, answers
priority 0 after 0.2 s and anything else after 3 s; under ``autojump_clock``
those delays cost no real time and the client's timings are exact. Like
the slo policy, it reports a predicted TTFT in ``usage.slo`` (for priority
0 only: 250 ms, against the 200 it measures).
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from hypercorn.config import Config
from hypercorn.trio import serve

from trioserve.bench.client import Target
from trioserve.bench.figures.slo import (
    GOODPUT_PNG,
    REFUSED_PNG,
    TTFT_CDF_PNG,
    print_predictions,
    requests_for,
    write_plots,
)
from trioserve.bench.measurement import RequestMeasurement
from trioserve.bench.datasets import SampleRequest
from trioserve.bench.slo import (
    MixedRequest,
    MixRun,
    RequestClass,
    capacity_rps,
    goal,
    prediction_error,
    mixed_requests,
    run_mix,
    summarize,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@attrs.define
class ObjectivesFake:
    """An ASGI app standing for a server under latency objectives."""

    bodies: list = attrs.Factory(list)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.bodies.append(request)
        if request.get("ttft_ms", 0) < 500:
            error = {"error": {"message": "cannot meet ttft_ms", "type": "slo_unattainable", "param": "ttft_ms"}}
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": json.dumps(error).encode()})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await trio.sleep(0.2 if request.get("priority") == 0 else 3.0)
        for i in range(request["max_tokens"]):
            if i:
                await trio.sleep(0.05)
            chunk = {"choices": [{"index": 0, "text": f"t{i} "}]}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(), "more_body": True})
        if request.get("priority") == 0:
            slo = {"predicted": {"ttft_ms": 250.0}, "measured": {"ttft_ms": 200.0}}
            usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": request["max_tokens"], "slo": slo}}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


INTERACTIVE = RequestClass("interactive", priority=0, ttft_ms=1000, tpot_ms=200, share=1, input_len=4, output_len=3)
BATCH = RequestClass("batch", priority=1, ttft_ms=5000, tpot_ms=None, share=1, input_len=8, output_len=5)
IMPOSSIBLE = RequestClass("impossible", priority=0, ttft_ms=100, tpot_ms=100, share=1, input_len=4, output_len=2)


def mix() -> list[MixedRequest]:
    classes = [INTERACTIVE, BATCH, IMPOSSIBLE, INTERACTIVE, BATCH, INTERACTIVE]
    return [MixedRequest(SampleRequest(f"p{i}", c.input_len, c.output_len), c) for i, c in enumerate(classes)]


@pytest.fixture
async def fake(nursery):
    app = ObjectivesFake()
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.errorlog = None
    binds = await nursery.start(serve, app, config)
    return app, Target(base_url=binds[0], model="fake", ignore_eos=True)


async def test_goodput_counts_the_requests_within_both_targets(fake, autojump_clock):
    app, target = fake
    run = await run_mix(target, mix(), request_rate=2.0, seed=1)
    assert {json.dumps(b.get("priority")) for b in app.bodies} == {"0", "1"}
    assert all(b["ttft_ms"] and b["max_tokens"] for b in app.bodies)
    summary = summarize(run)
    assert (summary["requests"], summary["refused"], summary["admitted"], summary["met"]) == (6, 1, 5, 5)
    assert summary["late"] == 0
    assert summary["goodput_rps"] == pytest.approx(5 / 3)  # 5 met over 6 requests at 2/s
    interactive = summary["classes"]["interactive"]
    assert interactive["met"] == 3 and interactive["ttft_ms"] == pytest.approx([200.0] * 3, abs=1)
    assert summary["classes"]["impossible"]["refused"] == 1
    # The server's predictions, read from usage.slo: priority 0's only.
    assert interactive["ttft_prediction"] == pytest.approx({"n": 3, "rel_err_p50": 0.25, "rel_err_p90": 0.25, "bias": 1.25})
    assert summary["classes"]["batch"]["ttft_prediction"] is None
    assert summary["ttft_prediction"] == interactive["ttft_prediction"]


async def test_without_priorities_the_interactive_class_misses_and_is_late(fake, autojump_clock):
    app, target = fake
    summary = summarize(await run_mix(target, mix(), request_rate=2.0, with_priority=False, burstiness=0.25))
    assert all("priority" not in b for b in app.bodies)
    interactive = summary["classes"]["interactive"]
    assert (interactive["met"], interactive["late"]) == (0, 3)  # 3 s against 1 s (+20%)
    assert summary["classes"]["batch"]["met"] == 2
    assert summary["attainment"] == pytest.approx(2 / 6)


def test_a_request_that_never_got_a_token_is_late_not_timed():
    failed = RequestMeasurement(False, 4, error="timed out after 10 s")
    run = MixRun((MixedRequest(SampleRequest("p", 4, 3), INTERACTIVE),), (failed,), 1.0, 1.0, 10.0)
    summary = summarize(run)
    assert (summary["admitted"], summary["met"], summary["late"]) == (1, 0, 1)
    assert summary["classes"]["interactive"]["ttft_ms"] == []


@given(st.lists(st.tuples(st.floats(0.001, 100), st.floats(0.001, 100)), min_size=1, max_size=40))
def test_the_prediction_error_is_relative_to_what_was_measured(pairs):
    error = prediction_error(pairs)
    assert error["n"] == len(pairs)
    assert 0 <= error["rel_err_p50"] <= error["rel_err_p90"] <= max(abs(p - m) / m for p, m in pairs) + 1e-9
    exact = prediction_error([(m, m) for _, m in pairs])
    assert (exact["rel_err_p90"], exact["bias"]) == (0, pytest.approx(1))
    doubled = prediction_error([(2 * m, m) for _, m in pairs])
    assert (doubled["rel_err_p50"], doubled["bias"]) == (pytest.approx(1), pytest.approx(2))
    assert prediction_error([]) is None


@attrs.frozen
class LetterTokenizer:
    """One token per lowercase letter: a prompt of n tokens is n letters."""

    vocab_size: int = 26
    all_special_ids: list = attrs.Factory(list)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text if c.isalpha()]

    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)


def test_the_mix_draws_classes_by_share_with_their_lengths():
    requests = mixed_requests(LetterTokenizer(), [INTERACTIVE, BATCH], 40, seed=3)
    assert requests == mixed_requests(LetterTokenizer(), [INTERACTIVE, BATCH], 40, seed=3)
    assert {r.request_class.name for r in requests} == {"interactive", "batch"}
    for r in requests:
        assert (r.sample.prompt_len, r.sample.output_len) == (r.request_class.input_len, r.request_class.output_len)


async def test_the_plots_are_written(fake, autojump_clock, tmp_path):
    _, target = fake
    runs = {
        name: [summarize(await run_mix(target, mix(), request_rate=rate, with_priority=sent)) for rate in (1.0, 2.0)]
        for name, sent in (("fcfs", False), ("slo", True))
    }
    summary = {"classes": [attrs.asdict(c) for c in (INTERACTIVE, BATCH, IMPOSSIBLE)], "setups": runs}
    paths = write_plots(summary, tmp_path)
    assert {p.name for p in paths} == {GOODPUT_PNG, REFUSED_PNG, TTFT_CDF_PNG}
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths)


async def test_the_prediction_table_has_a_row_per_predicted_run(fake, autojump_clock, capsys):
    _, target = fake
    runs = {
        "fcfs": [summarize(await run_mix(target, mix(), request_rate=2.0, with_priority=False))],
        "slo": [summarize(await run_mix(target, mix(), request_rate=2.0))],
    }
    print_predictions({"classes": [attrs.asdict(c) for c in (INTERACTIVE, BATCH)], "setups": runs})
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| slo") or line.startswith("| fcfs")]
    # fcfs sent no priority, so the fake predicted none of its requests.
    assert rows == ["| slo | Poisson | 2 | 0.25 / 0.25 / 1.25 (3) | 0.25 / 0.25 / 1.25 (3) | - |"]


def _run(rate: float, attainment: float, goodput: float | None = None, late: int = 0) -> dict:
    return {"offered_rps": rate, "attainment": attainment, "goodput_rps": rate * attainment if goodput is None else goodput,
            "late": late}  # fmt: skip


@given(st.lists(st.tuples(st.integers(1, 60), st.floats(0, 1)), min_size=1, max_size=8, unique_by=lambda t: t[0]))
def test_fcfs_capacity_is_the_highest_rate_below_which_every_run_met_enough(points):
    runs = [_run(rate, share) for rate, share in points]
    capacity = capacity_rps(runs, 0.9)
    below = sorted(runs, key=lambda r: r["offered_rps"])
    if capacity is None:
        assert below[0]["attainment"] < 0.9
    else:
        assert all(r["attainment"] >= 0.9 for r in below if r["offered_rps"] <= capacity)
        higher = [r for r in below if r["offered_rps"] > capacity]
        assert not higher or higher[0]["attainment"] < 0.9


def test_the_goal_compares_goodputs_at_one_and_a_half_times_fcfs_capacity():
    fcfs = [_run(10, 1.0), _run(15, 0.8), _run(20, 0.5), _run(30, 0.3)]
    slo = [_run(10, 1.0), _run(15, 1.0), _run(20, 0.9), _run(30, 0.6, late=1)]
    g = goal(fcfs, slo)
    # Capacity 10 (15 met only 80%): the goal is read at 15, the lowest rate >= 15.
    assert (g["fcfs_capacity_rps"], g["at_rps"]) == (10, 15)
    assert g["ratio"] == pytest.approx(15 / 12) and not g["met"]
    g = goal(fcfs, [_run(10, 1.0), _run(15, 1.0, goodput=18.0), _run(20, 1.0), _run(30, 1.0)])
    assert g["met"] and g["ratio"] == pytest.approx(1.5)
    g = goal(fcfs, [_run(10, 1.0), _run(15, 1.0, goodput=18.0, late=1)])
    assert not g["met"]  # a late admitted request fails the goal whatever the ratio
    assert goal(fcfs[:1], slo[:1])["at_rps"] is None  # no rate that high was run


def test_a_duration_sends_each_rate_for_as_long():
    requests = list(range(100))
    assert requests_for(2.0, requests, 10.0) == requests[:20]
    assert requests_for(4.5, requests, 10.0) == requests[:45]
    assert requests_for(4.5, requests, None) == requests
