"""One engine core's KV pool: how many blocks it gets on this model and
device (``kv_pool_plan``; the arithmetic is kv_budget.py's), and the
``BlockManager`` of that many blocks (``new_pool``)."""

from __future__ import annotations

import logging

import attrs
import torch

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.core.kv_budget import KVPoolPlan, available_memory, plan_pool, split_for_window
from trioserve.engine.kernels.kv_dtype_choice import KVDtypeChoice
from trioserve.engine.layers.kv_cache import kv_bytes_per_block
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.runtime.build import window_group

log = logging.getLogger(__name__)


def kv_pool_plan(config: EngineConfig, loaded: LoadedModel, kv_dtype: KVDtypeChoice) -> KVPoolPlan:
    """The KV pool's size from ``config.kv_cache_memory`` (engine/core/kv_budget.py)."""
    # The model's own config: under tensor parallelism, one rank's KV heads.
    per_block = kv_bytes_per_block(loaded.model.config, config.block_size, kv_dtype.dtype)
    budget = config.kv_cache_memory
    free = 0
    if not isinstance(budget, int):  # a fraction, or a default that depends on what is free
        if loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
        else:
            free = available_memory()
    per_sequence = config.blocks_per_sequence(loaded.model_config)
    plan = plan_pool(
        budget,
        device_type=loaded.device.type,
        free_memory=free,
        bytes_per_block=per_block,
        block_size=config.block_size,
        blocks_per_sequence=per_sequence,
        max_num_seqs=config.max_num_seqs,
        dtype=kv_dtype.name,
    )
    group = window_group(loaded, config, plan.num_blocks)
    if group is not None:
        model_config = loaded.model.config
        num_full = sum(model_config.layer_window(i) is None for i in range(model_config.num_hidden_layers))
        plan = split_for_window(
            plan,
            full_bytes_per_block=kv_bytes_per_block(
                attrs.evolve(model_config, num_hidden_layers=num_full), config.block_size, kv_dtype.dtype
            ),
            window_blocks=lambda n: _window_blocks(loaded, config, n),
            wanted=config.max_num_seqs * per_sequence,
        )
    if plan.num_blocks < per_sequence:
        # A pool smaller than one full context could refuse requests the
        # model accepts; say so instead of failing later.
        log.warning(
            "KV pool of %d blocks holds less than one max_model_len context (%d blocks)", plan.num_blocks, per_sequence
        )
    return plan


def _window_blocks(loaded: LoadedModel, config: EngineConfig, num_blocks: int) -> int:
    group = window_group(loaded, config, num_blocks)
    assert group is not None
    return group.num_blocks


def new_pool(num_blocks: int, config: EngineConfig, loaded: LoadedModel) -> BlockManager:
    """A pool of ``num_blocks`` blocks, with the prefix cache unless
    ``config`` turns it off, and the sliding-window layers' group where
    they have one (``runtime.build.window_group``: the runner's cache is
    split the same way). A CPU pool commits a block's memory when it is
    first written, so written blocks are reused first (block_manager.py)."""
    group = window_group(loaded, config, num_blocks)
    if group is not None:
        log.info(
            "sliding-window layers (window %d) keep their own pool of %d blocks beside the %d of the others",
            group.window, group.num_blocks, num_blocks,
        )  # fmt: skip
    return BlockManager(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        reuse_written_first=loaded.device.type == "cpu",
        window=None if group is None else group.window,
        num_window_blocks=0 if group is None else group.num_blocks,
    )
