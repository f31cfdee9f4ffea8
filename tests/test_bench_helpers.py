"""The helpers every benchmark, the soak and the tests share: one
percentile, resident memory from /proc, and waiting for an idle server."""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio

from trioserve.bench.memory import parse_proc_status, process_tree, rss_bytes, tree_memory
from trioserve.bench.scrape import metric_values, scrape, wait_idle
from trioserve.bench.stats import percentile

# --- percentiles ------------------------------------------------------------


def test_percentile_interpolates_linearly():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([5], 99) == 5
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_percentile_is_numpys_default_and_its_p50_the_median():
    rng = random.Random(0)
    for size in (1, 2, 7, 40, 101):
        values = [rng.expovariate(1.0) for _ in range(size)]
        for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
        assert percentile(values, 50) == pytest.approx(statistics.median(values))


# --- resident memory ----------------------------------------------------------


def _fake_proc(root: Path, pid: int, ppid: int, name: str, rss_kb: int, hwm_kb: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (root / str(pid) / "status").write_text(
        f"Name:\t{name}\nPid:\t{pid}\nPPid:\t{ppid}\nVmHWM:\t{hwm_kb} kB\nVmRSS:\t{rss_kb} kB\n"
        f"RssAnon:\t{rss_kb - 100} kB\nRssFile:\t100 kB\nThreads:\t3\n"
    )


def test_memory_of_a_process_tree(tmp_path):
    _fake_proc(tmp_path, 10, 1, "trioserve", 1000, 1500)
    _fake_proc(tmp_path, 11, 10, "a (b) c", 200, 300)  # a name with spaces and parentheses
    _fake_proc(tmp_path, 12, 11, "grandchild", 150, 160)
    _fake_proc(tmp_path, 13, 1, "someone else", 7000, 7000)
    (tmp_path / "self").mkdir()
    assert sorted(process_tree(10, tmp_path)) == [10, 11, 12]
    memory = tree_memory(10, tmp_path)
    assert (memory.rss, memory.hwm, memory.processes) == (1350 * 1024, 1960 * 1024, 3)
    assert (memory.rss_anon, memory.rss_file) == (1050 * 1024, 300 * 1024)
    assert tree_memory(11, tmp_path).rss == 350 * 1024
    with pytest.raises(ProcessLookupError):
        tree_memory(99, tmp_path)


def test_memory_of_this_process():
    memory = tree_memory(os.getpid())
    assert memory.processes >= 1 and 0 < memory.rss <= memory.hwm
    status = parse_proc_status(Path(f"/proc/{os.getpid()}/status").read_text())
    assert status["VmRSS"] > 0 and "Pid" not in status  # only the kB fields
    # The same reading, one process: what is resident grows with what is touched.
    before = rss_bytes()
    block = bytearray(64 << 20)
    block[:: 4096] = b"x" * len(block[:: 4096])
    assert rss_bytes(os.getpid()) - before >= 48 << 20
    del block


# --- a server's /metrics, and waiting until it is idle ------------------------

EXPOSITION = """\
# TYPE trioserve:num_requests_running gauge
trioserve:num_requests_running{{model_name="a"}} {running_a}
trioserve:num_requests_running{{model_name="b"}} {running_b}
# TYPE trioserve:num_requests_waiting gauge
trioserve:num_requests_waiting{{model_name="a"}} 0.0
trioserve:num_requests_waiting{{model_name="b"}} 0.0
# TYPE trioserve:kv_cache_usage_perc gauge
trioserve:kv_cache_usage_perc{{model_name="a"}} {kv}
trioserve:kv_cache_usage_perc{{model_name="b"}} 0.0
# TYPE trioserve:request_success counter
trioserve:request_success_total{{finished_reason="stop",model_name="a"}} 3.0
"""


def exposition(running_a=0, running_b=0, kv=0.0) -> str:
    return EXPOSITION.format(running_a=running_a, running_b=running_b, kv=kv)


def test_metric_values_per_model_and_for_the_whole_server():
    text = exposition(running_a=2, running_b=1)
    a = metric_values(text, "a")
    assert a["trioserve:num_requests_running"] == 2
    assert a["trioserve:request_success_total{finished_reason=stop}"] == 3
    assert metric_values(text, "b")["trioserve:num_requests_running"] == 1
    assert metric_values(text)["trioserve:num_requests_running"] == 3  # every model's, summed


class FakeServer:
    """``/metrics`` of a server whose requests end after ``busy`` scrapes,
    and whose KV blocks are freed ``held`` scrapes after that."""

    def __init__(self, busy: int, held: int = 0) -> None:
        self.busy, self.held, self.scrapes = busy, held, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        self.scrapes += 1
        running = int(self.scrapes <= self.busy)
        kv = 0.5 if self.scrapes <= self.busy + self.held else 0.0
        return httpx.Response(200, text=exposition(running_a=running, kv=kv))


def client(server: FakeServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(server), base_url="http://server")


async def test_wait_idle_returns_the_first_idle_scrape(autojump_clock):
    server = FakeServer(busy=5, held=3)
    async with client(server) as http:
        values = await wait_idle(http, "a")
    assert server.scrapes == 6
    assert values["trioserve:num_requests_running"] == 0 and values["trioserve:kv_cache_usage_perc"] == 0.5


async def test_wait_idle_can_wait_for_the_blocks_too(autojump_clock):
    server = FakeServer(busy=5, held=3)
    async with client(server) as http:
        values = await wait_idle(http, "a", blocks_free=True)
    assert server.scrapes == 9 and values["trioserve:kv_cache_usage_perc"] == 0


async def test_wait_idle_gives_up_after_its_timeout(autojump_clock):
    async with client(FakeServer(busy=10**9)) as http:
        with pytest.raises(trio.TooSlowError):
            await wait_idle(http, timeout=5)
        assert (await scrape(http))["trioserve:num_requests_running"] == 1
