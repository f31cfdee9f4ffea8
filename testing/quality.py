"""Logits and perplexity of a model over a text, for the quality checks of
compressed weights (tests/test_quant_quality.py, ``trioserve bench quality``)."""

from __future__ import annotations

import math

import torch

from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.models.llama import LlamaForCausalLM

BLOCK_SIZE = 16


def prompt_logits(model: LlamaForCausalLM, token_ids: list[int], *, chunk: int = 512) -> torch.Tensor:
    """Float32 logits ``[len(token_ids), vocab]``: row ``i`` predicts token
    ``i + 1``. One sequence, prefilled ``chunk`` tokens a forward over a
    paged cache, as the engine runs a long prompt."""
    blocks = -(-len(token_ids) // BLOCK_SIZE)
    cache = KVCache.allocate(model.config, num_blocks=blocks + 1, block_size=BLOCK_SIZE, dtype=model.dtype, device="cpu")
    table = list(range(1, blocks + 1))  # block 0 is left unused, as the pool reserves it
    rows = []
    with torch.inference_mode():
        for start in range(0, len(token_ids), chunk):
            piece = token_ids[start : start + chunk]
            batch = ForwardBatch.build(
                [SeqChunk(piece, start, table, num_logits=len(piece))], block_size=BLOCK_SIZE, device="cpu"
            )
            rows.append(model(batch, cache))
    return torch.cat(rows)


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ``token_ids[1:]`` under ``logits[:-1]``."""
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), targets)
    return math.exp(nll.item())


def greedy_tokens(model: LlamaForCausalLM, prompt: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``prompt``: one prefill, then one-row decode steps."""
    total = len(prompt) + count
    blocks = -(-total // BLOCK_SIZE)
    cache = KVCache.allocate(model.config, num_blocks=blocks + 1, block_size=BLOCK_SIZE, dtype=model.dtype, device="cpu")
    table = list(range(1, blocks + 1))
    out: list[int] = []
    piece, start = list(prompt), 0
    with torch.inference_mode():
        while len(out) < count:
            batch = ForwardBatch.build([SeqChunk(piece, start, table)], block_size=BLOCK_SIZE, device="cpu")
            token = int(model(batch, cache)[-1].argmax())
            out.append(token)
            start += len(piece)
            piece = [token]
    return out
