"""Chaos: 200 concurrent streaming clients on the default model over HTTP,
with random arrival times, disconnects, deadlines, priorities and ``n`` > 1,
while bursts of ``generate_nowait`` on the same engine overflow its
admission queue. Seeded (the plan, not the interleaving, which is the
machine's).

At the end nothing is left behind: no request running, waiting or queued,
every KV block free (prefix-cache blocks count as free: they are
reclaimable), and the server's trio run has exactly the tasks it had before
the load. The figures are printed (``pytest -s``) and recorded in
docs/reliability.md.
"""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import attrs
import httpx
import pytest
import trio

from server_fixtures import MODEL, read_sse_lines, scrape, server_config, serving, wait_idle
from trioserve.actors import EngineOverloaded, RequestShed
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.web.app import create_app

SEED = 20240610
NUM_CLIENTS = 200
NUM_BURSTS = 3
BURST_SIZE = 100
ARRIVAL_SPREAD = 20.0  # seconds over which the clients arrive
MAX_TRIES = 5  # a client refused with 429 tries again after Retry-After (at most 2 s)
# A KV pool of 34 blocks (16 tokens each): less than 32 running sequences
# can hold, so priorities decide who is preempted. The cache's dtype is
# pinned: "auto" picks a 16-bit one where the machine runs it well, which
# would double the blocks in the same bytes and take the pressure away.
ENGINE = {
    "max_queued_requests": 64,
    "max_num_seqs": 32,
    "max_model_len": 256,
    "kv_cache_memory": 24 << 20,
    "kv_cache_dtype": "float32",
}
# Every LONG_EVERY-th client asks for LONG_TOKENS tokens (EOS ignored) within
# LONG_TIMEOUT seconds: more steps than any CPU runs in that time (it would
# take under 1.3 ms a step), so deadlines expire on every machine, however
# fast, and not only where the load happens to be slow enough.
LONG_EVERY = 20
LONG_TOKENS = 160
LONG_TIMEOUT = 0.2
WORDS = "river stone amber quiet lantern copper meadow falcon winter orchard signal harbor velvet ember".split()
# "shed": a lower-priority stream displaced from the full queue by a
# burst, after its status went out (docs/reliability.md, "Overload control").
FINAL_REASONS = {"stop", "length", "timeout", "shed"}


@attrs.frozen
class ClientPlan:
    """What one client does, drawn from the seeded generator."""

    start: float  # seconds after the load begins
    chat: bool
    prompt: str
    n: int
    max_tokens: int
    priority: int
    timeout: float | None  # the request's own deadline
    disconnect_after: int | None  # events read before hanging up (None: read to the end)
    give_up_after: float | None  # seconds before cancelling the whole request, response or not
    ignore_eos: bool = False

    @classmethod
    def draw(cls, rng: random.Random) -> ClientPlan:
        roll = rng.random()
        return cls(
            start=rng.uniform(0, ARRIVAL_SPREAD),
            chat=rng.random() < 0.3,
            prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))),
            n=rng.choice([1, 1, 2, 3]),
            max_tokens=rng.randint(1, 10),
            priority=rng.randint(-2, 2),
            timeout=rng.choice([None, None, rng.uniform(0.2, 6.0)]),
            disconnect_after=rng.randint(0, 4) if roll < 0.25 else None,
            give_up_after=rng.uniform(0.0, 1.5) if 0.25 <= roll < 0.35 else None,
        )

    def long_with_deadline(self) -> ClientPlan:
        """The same arrival and prompt, asking for more than its deadline allows."""
        return attrs.evolve(
            self,
            n=1,
            max_tokens=LONG_TOKENS,
            ignore_eos=True,
            timeout=LONG_TIMEOUT,
            disconnect_after=None,
            give_up_after=None,
        )

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "n": self.n,
            "priority": self.priority,
            "stream": True,
            "temperature": 0.8,
            "seed": 7,
            "ignore_eos": self.ignore_eos,
        }
        if self.timeout is not None:
            body["timeout"] = self.timeout
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@attrs.define
class Tally:
    """What the clients saw."""

    counts: collections.Counter[str] = attrs.field(factory=collections.Counter)

    def add(self, what: str, count: int = 1) -> None:
        self.counts[what] += count


async def run_client(http: httpx.AsyncClient, plan: ClientPlan, tally: Tally) -> None:
    await trio.sleep(plan.start)  # its arrival time
    for _ in range(MAX_TRIES):
        retry_after = await one_try(http, plan, tally)
        if retry_after is None:
            return
        await trio.sleep(min(retry_after, 2.0))  # as a polite client does


async def one_try(http: httpx.AsyncClient, plan: ClientPlan, tally: Tally) -> float | None:
    """One request; the ``Retry-After`` seconds if it was refused."""
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    started = False
    with trio.move_on_after(plan.give_up_after if plan.give_up_after is not None else float("inf")) as scope:
        async with http.stream("POST", path, json=plan.body()) as response:
            if response.status_code == 429:
                code = json.loads(await response.aread())["error"]["code"]
                # The queue is full, or pressure refuses n > 1 before plain requests.
                assert code in ("engine_overloaded", "expensive_request_refused"), code
                tally.add("http_refused")
                return float(response.headers["Retry-After"])
            assert response.status_code == 200, (response.status_code, await response.aread())
            started = True
            tally.add("http_started")
            events = []
            async for event in read_sse_lines(response):
                events.append(event)
                if plan.disconnect_after is not None and len(events) > plan.disconnect_after:
                    tally.add("http_disconnected")
                    return None  # leaving the block closes the connection mid-stream
            check_stream(events, plan, tally)
    if scope.cancelled_caught:
        tally.add("http_gave_up")
        if not started:
            # The server may have queued it already: the client cannot know.
            tally.add("http_gave_up_before_status")
    return None


def check_stream(events: list[Any], plan: ClientPlan, tally: Tally) -> None:
    """A stream read to its end: [DONE] last, no error, every completion
    ended with a finish reason."""
    assert events and events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events
    reasons: dict[int, str] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    assert sorted(reasons) == list(range(plan.n)), events
    assert set(reasons.values()) <= FINAL_REASONS, reasons
    for reason in reasons.values():
        tally.add(f"http_{reason}")


async def burst(engine: Any, rng: random.Random, at: float, tally: Tally, nursery: trio.Nursery) -> None:
    """``BURST_SIZE`` requests queued at once with ``generate_nowait``: more
    than the admission queue holds, so some are refused at once."""
    await trio.sleep(at)
    for _ in range(BURST_SIZE):
        params = SamplingParams(max_tokens=rng.randint(1, 6), n=rng.choice([1, 2]), temperature=0.8, seed=3)
        try:
            stream = engine.generate_nowait(" ".join(rng.sample(WORDS, 4)), params, priority=rng.randint(-2, 2))
        except EngineOverloaded as exc:
            assert exc.retry_after > 0
            tally.add("burst_refused")
            continue
        tally.add("burst_started")
        nursery.start_soon(read_burst_stream, stream, rng.choice([None, 0, 1, 2]), tally)


async def read_burst_stream(stream: Any, stop_after: int | None, tally: Tally) -> None:
    async with stream:
        count = 0
        try:
            async for output in stream:
                count += 1
                if output.finished:
                    tally.add(f"burst_{output.finish_reason.value}")
                if stop_after is not None and count > stop_after:
                    tally.add("burst_closed_early")
                    return
        except RequestShed:
            # A later burst's request of higher priority took its place in the queue.
            tally.add("burst_shed")


async def server_tasks(url: str) -> int:
    """The server's task count, asked on a connection of its own."""
    async with httpx.AsyncClient(base_url=url) as http:
        return (await http.get("/health")).json()["tasks"]


@pytest.mark.slow
async def test_chaos_of_200_streaming_clients_leaves_nothing_behind(default_loaded):
    rng = random.Random(SEED)
    plans = [ClientPlan.draw(rng) for _ in range(NUM_CLIENTS)]
    plans[::LONG_EVERY] = [plan.long_with_deadline() for plan in plans[::LONG_EVERY]]
    burst_times = sorted(rng.uniform(1.0, ARRIVAL_SPREAD) for _ in range(NUM_BURSTS))
    config = server_config(engine=ENGINE)
    app = create_app(config, loaded=default_loaded)
    tally = Tally()
    async with serving(app) as server:
        engine = server.host.models[MODEL].engine
        async with httpx.AsyncClient(base_url=server.url) as warmup:
            assert (await warmup.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 2})).status_code == 200
        baseline_tasks = await server_tasks(server.url)
        start = trio.current_time()
        limits = httpx.Limits(max_connections=NUM_CLIENTS, max_keepalive_connections=NUM_CLIENTS)
        with trio.fail_after(600):
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
                async with trio.open_nursery() as nursery:
                    for plan in plans:
                        nursery.start_soon(run_client, http, plan, tally)
                    for at in burst_times:
                        nursery.start_soon(burst, engine, rng, at, tally, nursery)
            elapsed = trio.current_time() - start
        async with httpx.AsyncClient(base_url=server.url) as http:
            metrics = await wait_idle(http, timeout=60)
        # Every connection of the load is closed: the server's tasks return
        # to what they were (it takes the server a moment to see the closes).
        with trio.move_on_after(30):
            while (tasks := await server_tasks(server.url)) != baseline_tasks:
                await trio.sleep(0.05)

        stats = engine.statistics()
        s, a = stats.scheduler, stats.allocator.kv
        figures = {
            "seconds": round(elapsed, 1),
            "http clients": NUM_CLIENTS,
            "burst requests": NUM_BURSTS * BURST_SIZE,
            **dict(sorted(tally.counts.items())),
            "engine finished": s.num_finished,
            "engine aborted": s.num_aborted,
            "engine timed out": stats.num_deadline_exceeded,
            "engine failed": s.num_failed,
            "engine refused": stats.num_refused,
            "engine accepted": stats.num_accepted,
            "engine shed": stats.overload.num_shed,
            "preemptions": s.num_preemptions,
            "paused": s.num_paused,
            "kv blocks free / total": f"{a.num_free_blocks}/{a.num_blocks} ({a.num_cached_blocks} cached)",
            "tasks before / after": f"{baseline_tasks}/{tasks}",
        }
        print("\nchaos figures:", *(f"  {k}: {v}" for k, v in figures.items()), sep="\n")

        assert tally.counts["burst_refused"] > 0, "the bursts never overflowed the admission queue"
        assert tally.counts["http_disconnected"] > 0 and tally.counts["http_timeout"] > 0
        assert tally.counts["http_started"] + tally.counts["http_gave_up"] > NUM_CLIENTS * 0.75
        # Nothing running, waiting, queued, paused or held.
        assert metrics["trioserve:num_requests_running"] == 0 and metrics["trioserve:num_requests_waiting"] == 0
        assert stats.num_queued == 0 and stats.num_waiting_to_queue == 0
        assert (s.num_live, s.num_running, s.num_waiting, s.num_paused) == (0, 0, 0, 0)
        assert a.num_free_blocks == a.num_blocks and s.num_quarantined_blocks == 0
        assert not stats.executor.step_in_flight and s.num_failed == 0
        # Every request the engine accepted ended exactly once. The clients
        # saw most of them accepted; a client that gave up before its status
        # arrived may have had its request queued (and then aborted) or not.
        seen = 1 + tally.counts["http_started"] + tally.counts["burst_started"]
        assert seen <= stats.num_accepted <= seen + tally.counts["http_gave_up_before_status"]
        ended = s.num_finished + s.num_aborted + s.num_deadline_exceeded + s.num_failed + s.num_queue_timeouts
        assert ended + stats.overload.num_shed == stats.num_accepted
        assert stats.num_deadline_unqueued + stats.num_cancelled_unqueued == 0  # only generate() waits for room
        assert stats.num_refused >= tally.counts["burst_refused"] + tally.counts["http_refused"]
        assert tasks == baseline_tasks
        assert (await scrape_free(server.url))["trioserve:kv_cache_usage_perc"] == 0


async def scrape_free(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url) as http:
        return await scrape(http)
