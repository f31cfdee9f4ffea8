"""The parts of data parallelism: where replicas run (devices, CPU shares,
pinning), the router's bookkeeping, and refusing a layout the machine lacks
before anything starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from trioserve.actors.router import ReplicaRouter
from trioserve.engine.config import EngineConfig
from trioserve.engine.parallel.placement import ParallelConfigError, PinnedStepThread, cpu_shares, plan_replicas
from trioserve.engine.core.prefix_hash import prefix_block_hashes
from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.kv_batch import KVAllocation, KVBatch, KVCommit
from trioserve.engine.sampling.sampling_params import SamplingParams


def test_cpu_shares_are_contiguous_and_near_equal():
    assert cpu_shares([3, 0, 1, 2], 2) == [frozenset({0, 1}), frozenset({2, 3})]
    assert cpu_shares(range(5), 2) == [frozenset({0, 1, 2}), frozenset({3, 4})]
    assert cpu_shares([4, 6], 3) == [frozenset({4}), frozenset({6}), frozenset({4})]  # fewer cores: shared
    with pytest.raises(ValueError, match="count"):
        cpu_shares([0], 0)


def test_cpu_replicas_get_a_share_of_the_cores_and_as_many_threads_unless_told():
    config = EngineConfig(device="cpu", data_parallel_size=2)
    plan = plan_replicas(config, cpus={0, 1, 2, 3})
    assert [(p.cpus, p.num_threads, p.device) for p in plan] == [
        (frozenset({0, 1}), 2, "cpu"),
        (frozenset({2, 3}), 2, "cpu"),
    ]
    told = plan_replicas(EngineConfig(device="cpu", data_parallel_size=2, num_threads=1), cpus={0, 1, 2, 3})
    assert [p.num_threads for p in told] == [1, 1]
    assert told[1].engine_config(config).num_threads == 1
    # One replica: as before, unpinned and the thread count as given.
    (single,) = plan_replicas(EngineConfig(device="cpu"), cpus={0, 1})
    assert single.cpus is None and single.num_threads is None


def test_more_cuda_replicas_than_devices_is_refused_naming_the_field():
    with pytest.raises(ParallelConfigError, match=r"data_parallel_size=3 needs 3 CUDA device\(s\) .* has 2"):
        plan_replicas(EngineConfig(device="cuda", data_parallel_size=3), cuda_device_count=2)
    with pytest.raises(ParallelConfigError, match=r"cuda:1..cuda:2"):
        plan_replicas(EngineConfig(device="cuda:1", data_parallel_size=2), cuda_device_count=2)
    plan = plan_replicas(EngineConfig(device="cuda:1", data_parallel_size=2), cuda_device_count=3)
    assert [p.device for p in plan] == ["cuda:1", "cuda:2"]
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)


def test_serve_refuses_more_replicas_than_devices_before_starting():
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "serve", "--device", "cuda", "--data-parallel-size", "64",
         "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "data_parallel_size=64 needs 64 CUDA device(s)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_a_pinned_step_thread_and_its_replacement_run_on_their_share_only():
    before = os.sched_getaffinity(0)
    share = frozenset({min(before)})
    with PinnedStepThread(1, share, name="pinned") as thread:
        assert thread.call(os.sched_getaffinity, 0) == share
        with thread.fresh() as fresh:
            assert fresh.call(os.sched_getaffinity, 0) == share
    assert os.sched_getaffinity(0) == before  # the caller's thread is untouched


def test_prefix_hashes_are_the_block_managers_cache_keys():
    # A prompt whose hashes the router computes hits exactly the blocks a
    # pool committed for the same tokens.
    block = 4
    tokens = list(range(10, 23))  # 13 tokens: 3 full blocks before the last token
    pool = BlockManager(8, block)
    pool.apply(KVBatch(commits=(), frees=(), allocations=(KVAllocation("a", 0, len(tokens), tuple(tokens)),)))
    pool.apply(KVBatch(commits=(KVCommit("a", tuple(tokens[:12])),), frees=(), allocations=()))
    hashes = prefix_block_hashes(tokens, block, max_blocks=64)
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert pool.cached_prefix_len(tokens) == 12
    assert prefix_block_hashes(tokens, block, max_blocks=2) == hashes[:2]
    assert prefix_block_hashes(tokens[:4], block, max_blocks=64) == []  # its one block holds the last token


def test_the_router_counts_load_until_release_and_forgets_old_prefixes():
    router = ReplicaRouter(num_replicas=2, block_size=4, max_model_len=100, table_capacity=2)
    params = SamplingParams(max_tokens=10, n=2)
    prompt = list(range(1, 14))
    assert router.cost(prompt, params) == 13 + 2 * 10
    assert router.cost(prompt, SamplingParams(max_tokens=None)) == 100  # up to the context
    replica, hashes = router.choose(prompt, [0.0, 0.0])
    assert replica == 0 and len(hashes) == 3
    router.record("a", replica, hashes, router.cost(prompt, params))
    assert router.replica_of("a") == 0
    # Only the table's last two hashes are kept: the first block is forgotten,
    # so the chain no longer matches from its root.
    other = list(range(50, 63))
    assert router.choose(other, [0.0, 0.0])[0] == 1  # by load
    assert router.choose(prompt, [0.0, 0.0])[0] == 1  # no affinity left: by load
    router.release("a")
    router.release("a")  # twice: nothing
    assert router.statistics().outstanding_tokens == (0, 0) and router.replica_of("a") is None
    # Equal outstanding tokens: the lower KV usage wins.
    assert router.choose(other, [0.5, 0.25])[0] == 1


@pytest.mark.slow
def test_bench_offline_runs_the_replicated_engine_as_a_contender():
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "--log-level", "WARNING", "bench", "offline",
         "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--sequential-prompts", "1",
         "--prefill-batch", "2", "--max-num-seqs", "2", "--num-threads", "1", "--skip-transformers",
         "--data-parallel-size", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    row = re.search(r"^trioserve actors, DP=2 x 1 thread\(s\)\s+(\d+)\s+(\d+)\s", result.stdout, re.MULTILINE)
    assert row is not None, result.stdout
    assert (int(row[1]), int(row[2])) == (2, 8)  # 2 requests, 4 tokens each
