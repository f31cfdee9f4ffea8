"""A client that stops reading never slows the others.

On the fake executor and the autojump clock the claim is exact: every token
of every other request arrives at the same virtual time as in the same run
without the stalled readers, while each stalled reader is paused (its
sequence out of the batch, its output kept) and, once it reads again, gets
every token it would have got. The figure for the real model (the others'
inter-token latency with a reader stalled for a minute) is measured by
``trioserve bench slow-reader`` and recorded in docs/reliability.md.
"""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from fault_fixtures import STEP, fake_engine, greedy, tokens

MAX_BUFFERED = 4
STALL = 60.0  # virtual seconds the stalled readers read nothing
OTHERS = [(f"other{i}", f"an ordinary prompt, number {i}", 20 + 7 * i) for i in range(6)]
STALLED = [(f"stalled{i}", f"a reader that stops reading, {i}", 150) for i in range(3)]


async def run_others(engine: Any, stalled: list[tuple[str, str, int]]) -> tuple[dict[str, list[tuple[float, int]]], list[Any]]:
    """Queue the ``stalled`` requests and the others at the same instant
    (so they start in the same step), read the others as fast as they come
    and never the stalled ones. Return each other's (arrival, token) pairs,
    arrivals in steps from the start (rounded to a thousandth of a step: the
    clocks of two runs start at different floats), and the stalled streams."""
    start = trio.current_time()
    stalled_streams = [engine.generate_nowait(prompt, greedy(n), request_id=name) for name, prompt, n in stalled]
    streams = {name: engine.generate_nowait(prompt, greedy(n), request_id=name) for name, prompt, n in OTHERS}
    arrivals: dict[str, list[tuple[float, int]]] = {}

    async def read(name: str) -> None:
        got = arrivals.setdefault(name, [])
        async with streams[name] as stream:
            async for out in stream:
                at = round((trio.current_time() - start) / STEP, 3)
                got.extend((at, t) for t in out.new_token_ids)

    async with trio.open_nursery() as nursery:
        for name in streams:
            nursery.start_soon(read, name)
    return arrivals, stalled_streams


async def test_readers_that_stop_reading_do_not_move_anyone_elses_tokens(autojump_clock):
    engine_kw = {"max_buffered_outputs": MAX_BUFFERED}
    async with fake_engine(engine_kw=engine_kw) as engine:
        alone, _ = await run_others(engine, [])
        references = {name: tokens(await collect_all(engine, prompt, n)) for name, prompt, n in STALLED}

    async with fake_engine(engine_kw=engine_kw) as engine:
        with_stalled, stalled = await run_others(engine, STALLED)
        # Nobody reads the stalled streams for a minute.
        await trio.sleep(STALL)
        await trio.testing.wait_all_tasks_blocked()
        stats = engine.statistics().scheduler
        assert stats.num_paused == len(STALLED) and stats.num_running == 0
        # Each stalled sequence ran only until its reader was MAX_BUFFERED
        # behind (plus the step in flight and the one that paused it).
        for name, _, _ in STALLED:
            assert sum(any(c.request_id == name for c in p.chunks) for p in engine.fake.plans) <= MAX_BUFFERED + 2
        # Reading again resumes them; nothing was lost.
        for (name, _, _), stream in zip(STALLED, stalled):
            async with stream:
                assert tokens([out async for out in stream]) == references[name]

    # The others saw the same tokens at the same instants, stalled readers or not.
    assert with_stalled == alone
    assert all(len(got) == n for (name, _, n), got in zip(OTHERS, (alone[o[0]] for o in OTHERS)))
    last = max(t for got in alone.values() for t, _ in got)
    assert last == max(n for _, _, n in OTHERS)  # one token a step, none late


async def collect_all(engine: Any, prompt: str, max_tokens: int) -> list[Any]:
    return [out async for out in engine.generate(prompt, greedy(max_tokens))]
