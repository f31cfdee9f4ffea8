"""Data parallelism with a worker process per replica: a SIGKILLed worker's
streams all complete with the tokens they would have had, the other replica
keeps its worker and serves throughout, the killed one comes back, and
every KV block is free afterwards.

The workers run the tiny random model (``testing.tiny_worker_model``).
"""

from __future__ import annotations

import os
import signal

import trio
import trio.testing

from actor_fixtures import tiny_loaded
from test_worker_process import WORKER_MODEL, alive, requests, run_all, wait_gone

from trioserve import testing
from trioserve.actors import open_engine


def assert_every_block_free(engine) -> None:
    for replica in engine.replicas:
        kv = replica.allocator.statistics().kv
        assert kv.num_free_blocks == kv.num_blocks, f"replica {replica.index}: {kv.num_blocks - kv.num_free_blocks} blocks held"
        assert not replica.core.has_unfinished()
    engine.check_invariants()


async def test_sigkill_of_one_replicas_worker_under_32_streams_loses_no_token():
    items = requests(32, max_tokens=16)
    async with open_engine(testing.engine_config(), loaded=tiny_loaded()) as engine:
        reference = await run_all(engine, items)
    assert all(len(tokens) == 16 for tokens in reference.values())

    config = testing.engine_config(worker_mode="process", data_parallel_size=2, num_threads=1)
    async with open_engine(config, loaded=tiny_loaded(), worker_model=WORKER_MODEL) as engine:
        executors = [replica.executor for replica in engine.replicas]
        pids = [executor.worker_pid for executor in executors]
        assert len(set(pids)) == 2 and all(pid is not None and pid != os.getpid() and alive(pid) for pid in pids)
        # What the workers report having loaded is what the engine reports.
        assert engine.projection_choice == executors[0].worker_projection_choice is not None

        # Kill replica 0's worker once streams on both replicas have tokens.
        received = 0
        enough = trio.Event()

        def on_token(count: int) -> None:
            nonlocal received
            received += count
            if received >= 32 * 3:
                enough.set()

        async def kill_when_busy() -> None:
            await enough.wait()
            assert engine.replicas[0].core.has_unfinished() and engine.replicas[1].core.has_unfinished()
            os.kill(pids[0], signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_when_busy)
            survived = await run_all(engine, items, on_token)
        # Greedy and seeded streams alike: exactly the tokens of one uninterrupted engine.
        assert survived == reference
        killed, other = (executor.statistics() for executor in executors)
        assert killed.num_worker_restarts == 1 and killed.worker_pid not in (None, pids[0])
        assert killed.worker_state == "ready"
        assert other.num_worker_restarts == 0 and other.worker_pid == pids[1]
        stats = engine.statistics()
        assert stats.scheduler.num_failed == 0
        assert other.num_failed_steps == 0 and other.num_steps > 0 and killed.num_failed_steps >= 1
        assert all(replica.scheduler.num_failed == 0 for replica in stats.replicas)
        await wait_gone(pids[0])
        await trio.testing.wait_all_tasks_blocked()  # the last frees reach the pools
        assert_every_block_free(engine)

        # Both replicas serve again, the restarted one included.
        again = await run_all(engine, items[:4])
        assert again == {rid: reference[rid] for rid, _, _ in items[:4]}
        last = [executor.worker_pid for executor in executors]
    assert not any(alive(pid) for pid in last)
