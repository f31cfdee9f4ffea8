"""The model step in a worker process (``worker_mode="process"``): same
tokens as the step thread, requests that survive the worker's death, the
supervisor's restarts and its giving up, and no process left behind.

The worker runs the tiny random model (``testing.tiny_worker_model``); the
engine itself has the tiny model's tokenizer and config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import trio
import trio.testing

from actor_fixtures import assert_clean, prompts, tiny_loaded
from factories import FakeRunner, make_request, make_scheduler, step
from test_loader import make_checkpoint

from trioserve import testing
from trioserve.actors import open_engine
from trioserve.actors.errors import RequestFailed
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.sampler import Sampler
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.rows import SamplingRow
from trioserve.web.cli import build_parser
from trioserve.web.engine_options import engine_config_from_args
from trioserve.web.health import model_health
from trioserve.web.routes import cpu_report

WORKER_MODEL = testing.tiny_model.tiny_worker_model
# Wall seconds a worker may take to exit once it should (a safety bound on
# an event-driven wait, never a sleep).
EXIT_TIMEOUT = 60.0


def process_engine(**config):
    return open_engine(
        testing.engine_config(worker_mode="process", **config), loaded=tiny_loaded(), worker_model=WORKER_MODEL
    )


def requests(count: int, max_tokens: int) -> list[tuple[str, str, SamplingParams]]:
    """Greedy and seeded requests, alternating."""
    items = []
    for i, text in enumerate(prompts(count, seed=5)):
        if i % 2:
            params = SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=max_tokens, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        items.append((f"r{i}", text, params))
    return items


async def run_all(engine, items, on_token=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}

    async def one(request_id: str, text: str, params: SamplingParams) -> None:
        got = tokens.setdefault(request_id, [])
        async for output in engine.generate(text, params, request_id=request_id):
            got.extend(output.new_token_ids)
            if on_token is not None:
                on_token(len(output.new_token_ids))

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, *item)
    return tokens


async def wait_gone(pid: int) -> None:
    """Return once process ``pid`` has exited (a pidfd turns readable)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with trio.fail_after(EXIT_TIMEOUT):
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


def alive(pid: int) -> bool:
    """Running (a zombie has exited: /proc says so)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- configuration ----------------------------------------------------------------


def test_an_unknown_worker_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"worker_mode must be one of 'thread', 'process', got 'fork'"):
        EngineConfig(worker_mode="fork")
    with pytest.raises(ValueError, match="max_worker_restarts"):
        EngineConfig(max_worker_restarts=-1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--worker-mode", "fork", "hi"])
    args = build_parser().parse_args(["generate", "--worker-mode", "process", "hi"])
    assert engine_config_from_args(args).worker_mode == "process"
    assert EngineConfig().worker_mode == "thread"


# -- the pieces recovery rests on ----------------------------------------------------


def test_a_fresh_sampler_continues_a_seeded_sequence_exactly():
    # What a restarted worker does: it meets the sequence with k tokens
    # drawn by the dead worker's sampler and must draw the (k+1)-th as it would have.
    vocab = 500
    logits = torch_rows(12, vocab)
    params = SamplingParams(seed=9, temperature=1.0, top_p=0.9, presence_penalty=0.2)

    def row(output):
        return SamplingRow.for_sequence("s", params, (1, 2, 3), tuple(output), ())

    sampler, drawn = Sampler(vocab), []
    for i in range(12):
        drawn.append(sampler.sample(logits[i : i + 1], [row(drawn)]).token_ids[0])
    assert len(set(drawn)) > 3  # the draws are random, not one token
    for k in range(12):
        assert Sampler(vocab).sample(logits[k : k + 1], [row(drawn[:k])]).token_ids[0] == drawn[k]


def torch_rows(count: int, vocab: int):
    import torch

    return torch.randn(count, vocab, generator=torch.Generator().manual_seed(3))


def test_recompute_all_preempts_the_running_and_the_pool_forgets_its_cache():
    scheduler, pool = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(block_size=4)
    shared = list(range(1, 13))
    requests = [make_request(f"r{i}", shared + [50 + i], max_tokens=6) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    reference_scheduler, reference_pool = make_scheduler(num_blocks=32, block_size=4)
    expected = [make_request(f"r{i}", shared + [50 + i], max_tokens=6) for i in range(3)]
    for request in expected:
        reference_scheduler.add_request(request)
    reference = FakeRunner(block_size=4)
    for _ in range(3):
        step(scheduler, pool, runner)
        step(reference_scheduler, reference_pool, reference)
    assert pool.statistics().num_cached_blocks > 0
    preempted = scheduler.recompute_all()
    assert sorted(preempted) == ["r0", "r1", "r2"] and scheduler.num_running == 0
    scheduler.check_invariants()
    # The lost cache: a runner whose slots are empty, as a new worker's are.
    runner = FakeRunner(block_size=4)
    output = scheduler.schedule(pool)
    assert pool.statistics().num_cached_blocks == 0
    assert all(chunk.start == 0 for chunk in output.chunks)  # nothing found in the forgotten cache
    scheduler.update_from_output(output, runner.execute(output, scheduler))
    while scheduler.has_unfinished():
        step(scheduler, pool, runner)
    while reference_scheduler.has_unfinished():
        step(reference_scheduler, reference_pool, reference)
    scheduler.free_finished(pool)
    scheduler.check_invariants()
    assert pool.statistics().num_free_blocks == 32
    # The recomputed requests went on exactly as the uninterrupted ones.
    assert [r.output_token_ids for r in requests] == [r.output_token_ids for r in expected]
    assert all(len(r.output_token_ids) == 6 and r.num_preemptions == 1 for r in requests)


# -- the engine with a worker process ------------------------------------------------


async def test_process_mode_matches_thread_mode_and_survives_sigkill_of_the_worker():
    items = requests(16, max_tokens=24)
    config = testing.engine_config()
    async with open_engine(config, loaded=tiny_loaded()) as engine:
        reference = await run_all(engine, items)
    assert all(len(tokens) == 24 for tokens in reference.values())

    async with process_engine() as engine:
        executor = engine._executor
        first_pid = executor.worker_pid
        assert first_pid is not None and first_pid != os.getpid() and alive(first_pid)

        # Same greedy and seeded tokens as the step thread.
        assert await run_all(engine, items) == reference

        # SIGKILL under load, once every stream has had a few tokens.
        received = 0
        enough = trio.Event()

        def on_token(count: int) -> None:
            nonlocal received
            received += count
            if received >= 16 * 4:
                enough.set()

        async def kill_when_busy() -> None:
            await enough.wait()
            os.kill(first_pid, signal.SIGKILL)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_when_busy)
            survived = await run_all(engine, [(f"k{rid}", text, p) for rid, text, p in items], on_token)
        assert {rid[1:]: tokens for rid, tokens in survived.items()} == reference
        stats = engine.statistics()
        assert stats.executor.num_worker_restarts == 1
        assert stats.executor.worker_state == "ready" and stats.executor.worker_pid not in (None, first_pid)
        assert stats.scheduler.num_failed == 0 and stats.scheduler.num_preemptions >= 1
        await wait_gone(first_pid)
        await trio.testing.wait_all_tasks_blocked()  # the last frees reach the pool
        assert_clean(engine)

        # A worker killed between steps: the next request runs on its replacement.
        second_pid = executor.worker_pid
        os.kill(second_pid, signal.SIGKILL)
        again = await run_all(engine, items[:2])
        assert again == {rid: reference[rid] for rid, _, _ in items[:2]}
        health = model_health(engine.statistics())
        assert health["worker"]["restarts"] == 2 and health["worker"]["state"] == "ready"
        assert health["last_error"]["kind"] == "worker_died"
        await trio.testing.wait_all_tasks_blocked()  # the last frees reach the pool
        assert_clean(engine)
        last_pid = executor.worker_pid
    assert not alive(last_pid) and executor.statistics().worker_state == "stopped"


async def test_the_engine_reports_the_kernels_its_worker_chose(tmp_path, monkeypatch):
    # The server reads only the checkpoint's config and tokenizer (its choice
    # is the float path's); the worker quantizes the weights, times the
    # kernels, and says what it chose when it is ready.
    monkeypatch.setenv("TRIOSERVE_CACHE", str(tmp_path / "cache"))  # the worker's int8 copy
    folder = tmp_path / "ckpt"
    make_checkpoint(folder)
    config = EngineConfig(
        model=str(folder), worker_mode="process", quantization="int8", num_threads=1, max_num_seqs=2,
        max_model_len=64, kv_cache_dtype="float32", warm_up=False,
    )  # fmt: skip
    async with open_engine(config) as engine:
        assert engine.core.loaded.projection_choice.quantization is None
        worker_choice = engine.projection_choice
        assert worker_choice.quantization == "int8"
        assert worker_choice == engine._executor.worker_projection_choice
        async for _ in engine.generate("hello world", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)):
            pass
    # And in what /version reports (its CPU part, from the host's served models).
    host = types.SimpleNamespace(models={"ckpt": types.SimpleNamespace(engine=engine)})
    assert cpu_report(host)["models"]["ckpt"] == worker_choice.as_json()


async def test_a_worker_past_its_restarts_fails_its_requests_with_a_clear_error():
    async with process_engine(max_worker_restarts=0) as engine:
        pid = engine._executor.worker_pid
        started = trio.Event()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

        async def doomed() -> None:
            with pytest.raises(RequestFailed) as raised:
                async for _ in engine.generate("a long story", params, request_id="doomed"):
                    started.set()
            assert raised.value.code == "worker_unavailable"
            assert "not restarted" in str(raised.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(doomed)
            await started.wait()
            os.kill(pid, signal.SIGKILL)
        stats = engine.statistics()
        assert stats.executor.worker_state == "failed" and stats.executor.num_worker_restarts == 0
        health = model_health(stats)
        assert health["degraded"] and health["worker"]["state"] == "failed"
        # Later requests fail the same way, at once; nothing hangs.
        with pytest.raises(RequestFailed, match="not restarted"):
            async for _ in engine.generate("another", params):
                pass
        await trio.testing.wait_all_tasks_blocked()  # the failed requests' frees reach the pool
        assert_clean(engine)
    await wait_gone(pid)


SERVER_SCRIPT = textwrap.dedent(
    """
    import sys, trio
    from trioserve import testing
    from trioserve.actors import open_engine

    async def main():
        config = testing.engine_config(worker_mode="process")
        async with open_engine(config, loaded=testing.tiny_loaded(), worker_model=testing.tiny_model.tiny_worker_model) as engine:
            print(engine.statistics().executor.worker_pid, flush=True)
            await trio.sleep_forever()

    if __name__ == "__main__":
        trio.run(main)
    """
)


async def test_a_killed_server_leaves_no_worker_behind():
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", SERVER_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        line = b""
        with trio.fail_after(300):
            while not line.endswith(b"\n"):
                data = await process.stdout.receive_some()
                assert data, "the server exited before its worker was ready"
                line += data
        worker = int(line)
        assert alive(worker)
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await wait_gone(worker)  # PR_SET_PDEATHSIG, or the end of its socket
        assert not alive(worker)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
