"""A model runner for a loaded model: its KV cache in the chosen dtype, its
sampler with the plugins' logits processors, CUDA graphs where they apply.
The in-process engine and a worker process build theirs here alike."""

from __future__ import annotations

import logging
import time

from trioserve.engine.config import EngineConfig
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice, choose_kv_dtype
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.plugins import Plugins
from trioserve.engine.runtime.cuda_graphs import DecodeGraphs
from trioserve.engine.runtime.model_runner import ModelRunner
from trioserve.engine.sampling.sampler import Sampler

log = logging.getLogger(__name__)


def kv_dtype_choice(config: EngineConfig, loaded: LoadedModel) -> KVDtypeChoice:
    """The dtype the KV cache stores for ``config.kv_cache_dtype`` (engine/kernels/kv_dtype_choice.py)."""
    return choose_kv_dtype(
        config.kv_cache_dtype,
        model_dtype=loaded.dtype,
        device=loaded.device,
        cpu_paths=loaded.cpu_paths,
        config=loaded.model.config,  # under tensor parallelism, one rank's KV heads
    )


def build_runner(
    loaded: LoadedModel,
    config: EngineConfig,
    num_blocks: int,
    plugins: Plugins | None = None,
    kv_dtype: KVDtypeChoice | None = None,
) -> ModelRunner:
    """The model runner of ``loaded``: a KV cache of ``num_blocks`` blocks
    in ``kv_dtype`` (else chosen from ``config.kv_cache_dtype``: a worker
    process is given the server's choice by name), a sampler with the
    logits processors of ``plugins`` (else of the plugins ``config`` names:
    a worker process loads them itself), and (with ``config.warm_up``) the
    CPU kernels built."""
    if plugins is None:
        plugins = Plugins.load(config.plugins)
    if kv_dtype is None:
        kv_dtype = kv_dtype_choice(config, loaded)
    kv_cache = KVCache.allocate(
        loaded.model.config,  # the model's own: under tensor parallelism, one rank's KV heads
        num_blocks=num_blocks,
        block_size=config.block_size,
        dtype=kv_dtype.dtype,
        device=loaded.device,
    )
    graphs = DecodeGraphs.choose(
        loaded.model,
        kv_cache,
        enforce_eager=config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.resolved_max_model_len(loaded.model_config),
    )
    if graphs is not None:
        log.info(
            "CUDA graphs for decode steps of up to %d sequences, recorded as each shape is first met",
            graphs.batch_sizes[-1],
        )
    runner = ModelRunner(
        model=loaded.model,
        kv_cache=kv_cache,
        sampler=Sampler(loaded.model_config.vocab_size, loaded.device, logits_processors=plugins.logits_processors),
        device=loaded.device,
        decode_graphs=graphs,
    )
    if config.warm_up:
        start = time.perf_counter()
        calls = loaded.model.warm_up(config.max_num_seqs)
        if calls:
            log.info("built the CPU kernels for every batch size in %.1f s (%d calls)", time.perf_counter() - start, calls)
    return runner
