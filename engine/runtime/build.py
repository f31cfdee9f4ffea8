"""A model runner for a loaded model: its KV cache in the chosen dtype, its
sampler with the plugins' logits processors, CUDA graphs where they apply.
The in-process engine and a worker process build theirs here alike."""

from __future__ import annotations

import logging
import math
import time

import attrs

from trioserve.engine.config import EngineConfig
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice, choose_kv_dtype
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.models.hf_fallback import is_fallback
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


@attrs.frozen
class WindowGroup:
    """The sliding-window layers' KV group: their ``window`` and the blocks
    of their own pool, the null block included (engine/core/block_manager.py)."""

    window: int
    num_blocks: int


def window_pool_blocks(window: int, *, num_blocks: int, block_size: int, max_num_seqs: int, max_chunk: int) -> int:
    """The window group's blocks, its null block included, beside a first
    group of ``num_blocks``.

    Each running sequence holds the window blocks its chunk reads, at most
    ``ceil((window - 1 + chunk) / block_size) + 1`` for a chunk of up to
    ``max_chunk`` tokens; the group gets twice that for ``max_num_seqs``
    sequences (the second half keeps released windows in the prefix
    cache), and never more than ``num_blocks``, since a sequence's window
    blocks are a part of its blocks. So every sequence the first group
    admits fits its window, and the scheduler plans against the first
    group alone.
    """
    per_sequence = math.ceil((window - 1 + max_chunk) / block_size) + 1
    return 1 + min(num_blocks, 2 * max_num_seqs * per_sequence)


def window_group(loaded: LoadedModel, config: EngineConfig, num_blocks: int) -> WindowGroup | None:
    """The window group beside a pool of ``num_blocks`` (``window_pool_blocks``
    with chunks of up to ``max_num_batched_tokens``), or None where the
    sliding layers share the others' blocks and only mask: a model without
    sliding layers, a window no shorter than the context, a model on
    transformers' classes, or tensor parallelism."""
    model_config = loaded.model.config
    windows = {model_config.layer_window(i) for i in range(model_config.num_hidden_layers)} - {None}
    max_model_len = config.resolved_max_model_len(loaded.model_config)
    if not windows or config.tensor_parallel_size > 1 or is_fallback(loaded.model_config):
        return None
    (window,) = windows  # one sliding_window per model
    if window >= max_model_len:
        return None
    return WindowGroup(
        window,
        window_pool_blocks(
            window,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_chunk=min(config.max_num_batched_tokens, max_model_len),
        ),
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
    group = window_group(loaded, config, num_blocks)
    if group is None:
        kv_cache = KVCache.allocate(
            loaded.model.config,  # the model's own: under tensor parallelism, one rank's KV heads
            num_blocks=num_blocks,
            block_size=config.block_size,
            dtype=kv_dtype.dtype,
            device=loaded.device,
        )
    else:
        kv_cache = KVCache.allocate_split(
            loaded.model.config,
            num_blocks=num_blocks,
            num_window_blocks=group.num_blocks,
            block_size=config.block_size,
            dtype=kv_dtype.dtype,
            device=loaded.device,
        )
    # Decode graphs read one group's tables: a split cache runs eagerly.
    graphs = None
    if group is None:
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
