"""Giving freed heap memory back (engine/heap_trim.py): glibc returns the
free pages of a fragmented heap, and a thread's free arena top once the
thresholds are pinned; the engine trims once it goes idle after running
steps, in process and through the actors."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap

import trio
import trio.testing

from actor_fixtures import tiny_loaded
from trioserve.actors import open_engine
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing import engine_config

GLIBC = platform.libc_ver()[0] == "glibc"

# 200 MiB in blocks below glibc's mmap threshold (so they come from the heap),
# all freed but the last, which keeps the heap's top in use: the freed pages
# stay resident until a trim gives them back.
FRAGMENT = textwrap.dedent(
    """
    import json
    from trioserve.bench.memory import rss_bytes
    from trioserve.engine.heap_trim import trim_heap

    def rss():
        return rss_bytes() >> 20

    blocks = [bytearray(100_000) for _ in range(2_000)]
    last = blocks[-1]
    del blocks
    before = rss()
    trimmed = trim_heap()
    print(json.dumps({"before": before, "after": rss(), "trimmed": trimmed, "kept": len(last)}))
    """
)


def test_trimming_gives_a_fragmented_heaps_free_pages_back():
    import json

    out = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True, timeout=60, check=True)
    result = json.loads(out.stdout)
    assert result["trimmed"] is GLIBC
    if GLIBC:
        assert result["before"] - result["after"] >= 150, result  # of the 190 MiB freed
    else:
        assert result["before"] - result["after"] < 20, result  # nothing to call: nothing returned


# A thread's arena with 30 MB freed at its top, after a 20 MiB block (from a
# mapping of its own) raised glibc's moving trim threshold to 40 MiB: that
# top stays resident through malloc_trim unless the thresholds are pinned.
THREAD_TOP = textwrap.dedent(
    """
    import json, sys, threading
    from trioserve.bench.memory import rss_bytes
    from trioserve.engine.heap_trim import fix_heap_thresholds, trim_heap

    def rss():
        return rss_bytes() >> 20

    fixed = fix_heap_thresholds() if sys.argv[1] == "fixed" else None
    sizes = {}

    def work():
        big = bytearray(20 << 20)
        del big
        blocks = [bytearray(100_000) for _ in range(300)]
        sizes["before"] = rss()
        del blocks

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    trim_heap()
    print(json.dumps({"fixed": fixed, "returned": sizes["before"] - rss()}))
    """
)


def test_pinned_thresholds_give_a_threads_free_arena_top_back():
    import json

    def returned(mode: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", THREAD_TOP, mode], capture_output=True, text=True, timeout=60, check=True
        )
        return json.loads(out.stdout)

    fixed, moving = returned("fixed"), returned("moving")
    assert fixed["fixed"] is GLIBC
    if GLIBC:
        # Of the 30 MB freed (glibc's own thresholds returned: moving["returned"]).
        assert fixed["returned"] >= 20, (fixed, moving)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_the_core_trims_when_it_goes_idle_after_steps_and_only_then():
    core = EngineCore(tiny_loaded(), engine_config())
    assert not core.release_memory() and core.num_heap_trims == 0  # no step ran since the start
    core.add_request("a", "the quick brown fox", _greedy(3))
    core.add_request("b", "jumps over the lazy dog", _greedy(6))
    trims = []
    while core.has_unfinished():
        assert not core.release_memory()  # never while requests are in flight
        core.step()
        trims.append(core.num_heap_trims)
    # step() trimmed once, after the step that left the core idle.
    assert trims == [0] * (len(trims) - 1) + [int(GLIBC)]
    assert not core.release_memory()  # nothing ran since
    core.add_request("c", "seven wizards", _greedy(2))
    while core.has_unfinished():
        core.step()
    assert core.num_heap_trims == 2 * int(GLIBC)


async def test_the_scheduler_actor_trims_once_the_engine_is_idle():
    async with open_engine(engine_config(), loaded=tiny_loaded()) as engine:
        await trio.testing.wait_all_tasks_blocked()
        assert engine.core.num_heap_trims == 0
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(_drain, engine, f"prompt number {i}")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.core.num_heap_trims == int(GLIBC)
        assert not engine.core.release_memory()  # already trimmed; nothing ran since


async def _drain(engine, prompt: str) -> None:
    async for _ in engine.generate(prompt, _greedy(4)):
        pass
