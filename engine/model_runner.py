"""Runs one scheduled step: builds the model inputs, runs the forward, samples."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import attrs
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .forward_batch import ForwardBatch, SeqChunk
from .kv_cache import KVCache
from .sampler import Sampler, SamplingState, TokenLogprobs
from .scheduler import ScheduledChunk, SchedulerOutput

# cuDNN's attention (torch's first choice for bf16 on Hopper) builds a plan
# for each new shape, and a decode step's context lengths change every step:
# measured on an H200, batch-64 decode steps took 55-92 ms with it, 13-24 ms without.
CUDA_ATTENTION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def _chunk_tokens(prompt: list[int], output: list[int], chunk: ScheduledChunk) -> list[int]:
    """``chunk``'s tokens, sliced from the prompt or the output without
    joining them (a decode step would copy the whole sequence)."""
    start, end = chunk.start, chunk.start + chunk.num_tokens
    if start >= len(prompt):
        return output[start - len(prompt) : end - len(prompt)]
    if end <= len(prompt):
        return prompt[start:end]
    return prompt[start:] + output[: end - len(prompt)]


@attrs.frozen
class RunnerOutput:
    """What one step produced: a sampled token for each chunk that samples."""

    sampled: Mapping[str, int]
    logprobs: Mapping[str, TokenLogprobs]


@attrs.define
class ModelRunner:
    """Executes plans against a model and its KV cache.

    ``execute`` is the one call the executor actor runs in a worker thread:
    it only reads the plan and the sampling states, so the event loop may go
    on with other work while it runs. Grad mode is per thread, so inference
    mode is entered inside it.
    """

    model: torch.nn.Module
    kv_cache: KVCache
    sampler: Sampler
    device: torch.device

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def _attention_backends(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(list(CUDA_ATTENTION_BACKENDS))

    def execute(self, plan: SchedulerOutput, states: Mapping[str, SamplingState]) -> RunnerOutput:
        """Run the forward for every chunk of ``plan`` and sample for those that end their known tokens."""
        if not plan.chunks:
            return RunnerOutput(sampled={}, logprobs={})
        chunks = []
        sampling_ids = []
        for chunk in plan.chunks:
            tokens = _chunk_tokens(chunk.request.prompt_token_ids, chunk.request.output_token_ids, chunk)
            chunks.append(
                SeqChunk(
                    token_ids=tokens,
                    start_position=chunk.start,
                    block_table=chunk.block_ids,
                    num_logits=1 if chunk.samples else 0,
                )
            )
            if chunk.samples:
                sampling_ids.append(chunk.request.request_id)
        with torch.inference_mode(), self._attention_backends():
            batch = ForwardBatch.build(chunks, block_size=self.block_size, device=self.device)
            logits = self.model(batch, self.kv_cache)
            if not sampling_ids:
                return RunnerOutput(sampled={}, logprobs={})
            result = self.sampler.sample(logits, [states[rid] for rid in sampling_ids])
        logprobs = {rid: lp for rid, lp in zip(sampling_ids, result.logprobs) if lp is not None}
        return RunnerOutput(sampled=dict(zip(sampling_ids, result.token_ids)), logprobs=logprobs)
