"""Runs one scheduled step: builds the model inputs, runs the forward, samples."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import attrs
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trioserve.engine.runtime.cuda_graphs import DecodeGraphs
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.lora.batch import LoraBatch
from trioserve.engine.lora.registry import LoraRegistry
from trioserve.engine.plugins import PluginError
from trioserve.engine.sampling.pooling import ChunkPooled, pool_rows
from trioserve.engine.sampling.prompt_logprobs import ChunkPromptLogprobs, prompt_logprobs
from trioserve.engine.sampling.sampler import Sampler, TokenLogprobs
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.sampling.rows import TokenMask

# cuDNN's attention (torch's first choice for bf16 on Hopper) builds a plan
# for each new shape, and a decode step's context lengths change every step:
# measured on an H200, batch-64 decode steps took 55-92 ms with it, 13-24 ms without.
CUDA_ATTENTION_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@attrs.frozen
class RunnerOutput:
    """What one step produced: a sampled token for each chunk that samples."""

    sampled: Mapping[str, int]
    logprobs: Mapping[str, TokenLogprobs]
    # A speculating chunk's tokens after its sampled one: the accepted
    # proposals after the first, then the corrected or bonus token.
    extra_tokens: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict)
    # Sequences whose logits processor (a plugin) raised: their requests fail.
    failed: Mapping[str, PluginError] = attrs.field(factory=dict)
    # The prompt logprobs of the chunks that asked for them
    # (``ScheduledChunk.prompt_targets``).
    prompt_logprobs: Mapping[str, ChunkPromptLogprobs] = attrs.field(factory=dict)
    # Embedding chunks' shares of their vectors (engine/sampling/pooling.py).
    pooled: Mapping[str, ChunkPooled] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class StepLogits:
    """A step whose forward has run: its plan and the logits of its sampling
    chunks (None when it had no chunks). Lives on the step's thread (or in
    the worker process) between ``forward_step`` and ``sample_step``.
    A plan with embedding chunks has them pooled already (``pooled``) and
    left out of ``plan``."""

    plan: StepPlan
    logits: torch.Tensor | None
    pooled: Mapping[str, ChunkPooled] = attrs.field(factory=dict)


@attrs.define
class ModelRunner:
    """Executes step plans against a model and its KV cache.

    ``execute`` is the one call the executor actor runs in a worker thread.
    The plan is a value (``trioserve.engine.runtime.step_plan``), so the event loop
    may go on changing the scheduler's requests while it runs; what persists
    between steps is the KV cache and the sampler's per-sequence state. Grad
    mode is per thread, so inference mode is entered inside it.
    """

    model: torch.nn.Module
    kv_cache: KVCache
    sampler: Sampler
    device: torch.device
    # Decode-only steps replayed from CUDA graphs (engine/runtime/cuda_graphs.py);
    # None runs every step op by op (CPU, or ``enforce_eager``).
    decode_graphs: DecodeGraphs | None = None
    # The engine's LoRA adapters (engine/lora), the core's registry, read
    # here during a step and changed only between steps; None: no LoRA.
    lora: LoraRegistry | None = None

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def _attention_backends(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(list(CUDA_ATTENTION_BACKENDS))

    def execute(self, plan: StepPlan) -> RunnerOutput:
        """Run the forward for every chunk of ``plan`` and sample for those that end their known tokens."""
        assert not plan.awaits_mask, "a plan awaiting its mask runs as forward_step, then sample_step"
        return self.sample_step(self.forward_step(plan), plan.token_mask)

    def forward_step(self, plan: StepPlan) -> StepLogits:
        """The first half of ``execute``: drop the released sequences' state
        and run the forward (writing the chunks' keys and values). A plan
        that ``awaits_mask`` runs this while its mask is filled, then
        ``sample_step`` with the mask."""
        self.sampler.forget(plan.released)
        if not plan.chunks:
            return StepLogits(plan, None)
        with torch.inference_mode(), self._attention_backends():
            if any(chunk.pooling is not None for chunk in plan.chunks):
                return self._forward_pooling(plan)
            return StepLogits(plan, self.forward(plan))

    def _forward_pooling(self, plan: StepPlan) -> StepLogits:
        # The forward hands out final hidden states, not logits: the
        # embedding chunks pool theirs, the others' go through the LM head.
        # The step then goes on as the plan without the embedding chunks.
        chunks = [
            SeqChunk(chunk.token_ids, chunk.start, chunk.block_ids, chunk.num_logits, chunk.window_block_ids)
            for chunk in plan.chunks
        ]
        batch = ForwardBatch.build(chunks, block_size=self.block_size, device=self.device)
        hidden = self.model(batch, self.kv_cache, normed_hidden=True)
        pooled, keep, rest, offset = {}, [], [], 0
        for chunk in plan.chunks:
            n = chunk.num_logits
            if chunk.pooling is None:
                keep.extend(range(offset, offset + n))
                rest.append(chunk)
            elif (share := pool_rows(chunk.pooling, chunk.start, hidden[offset : offset + n].float())) is not None:
                pooled[chunk.request_id] = share
            offset += n
        logits = None
        if keep:
            logits = self.model.head_logits(hidden[torch.tensor(keep, dtype=torch.int64, device=hidden.device)])
        return StepLogits(attrs.evolve(plan, chunks=tuple(rest)), logits if rest else None, pooled)

    def sample_step(self, step: StepLogits, token_mask: TokenMask | None) -> RunnerOutput:
        """The second half of ``execute``: sample the step's tokens, the rows
        ``token_mask`` lists limited to their allowed tokens."""
        plan = step.plan
        rows = [chunk.sampling for chunk in plan.chunks if chunk.sampling is not None]
        logits, prompt = step.logits, {}
        if logits is not None and any(chunk.prompt_targets for chunk in plan.chunks):
            with torch.inference_mode():
                logits, prompt = _split_prompt_logits(plan, logits)
        if logits is None or not rows:
            return RunnerOutput(sampled={}, logprobs={}, prompt_logprobs=prompt, pooled=step.pooled)
        with torch.inference_mode():
            if any(chunk.num_draft_tokens for chunk in plan.chunks):
                return attrs.evolve(
                    self._sample_speculating(plan, logits, token_mask), prompt_logprobs=prompt, pooled=step.pooled
                )
            result = self.sampler.sample(logits, rows, token_mask)
        ids = [row.request_id for row in rows]
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(
            sampled=dict(zip(ids, result.token_ids)),
            logprobs=logprobs,
            failed=result.failed,
            prompt_logprobs=prompt,
            pooled=step.pooled,
        )

    def _sample_speculating(self, plan: StepPlan, logits: torch.Tensor, token_mask: TokenMask | None) -> RunnerOutput:
        # Plain rows are sampled together as usual; each speculating chunk
        # verifies its proposal on its own rows of logits.
        plain_rows, plain_index = [], []
        sampled: dict[str, int] = {}
        extra: dict[str, tuple[int, ...]] = {}
        offset = 0
        for chunk in plan.chunks:
            if chunk.sampling is None:
                continue
            n = chunk.num_logits
            if chunk.num_draft_tokens:
                tokens = self.sampler.verify(logits[offset : offset + n], chunk.sampling, chunk.draft_token_ids)
                sampled[chunk.request_id] = tokens[0]
                extra[chunk.request_id] = tuple(tokens[1:])
            else:
                plain_rows.append(chunk.sampling)
                plain_index.append(offset)
            offset += n
        logprobs = {}
        failed: dict[str, PluginError] = {}
        if plain_rows:
            result = self.sampler.sample(logits[plain_index], plain_rows, token_mask)
            ids = [row.request_id for row in plain_rows]
            sampled.update(zip(ids, result.token_ids))
            logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
            failed = dict(result.failed)
        return RunnerOutput(sampled=sampled, logprobs=logprobs, extra_tokens=extra, failed=failed)

    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run the model over ``plan``'s chunks (not empty), writing their
        keys and values; return the logits of the sampling chunks, in order.
        The caller enters inference mode (a tensor-parallel rank other than
        the first calls only this, and gets no logits: tp_runner.py)."""
        chunks = [
            SeqChunk(
                token_ids=chunk.token_ids,
                start_position=chunk.start,
                block_table=chunk.block_ids,
                num_logits=chunk.num_logits,
                window_table=chunk.window_block_ids,
            )
            for chunk in plan.chunks
        ]
        if self.decode_graphs is not None and self.lora is None:
            logits = self.decode_graphs.run(chunks)
            if logits is not None:
                return logits
        batch = ForwardBatch.build(chunks, block_size=self.block_size, device=self.device)
        if self.lora is not None:
            batch = attrs.evolve(batch, lora=self._lora_batch(plan))
        return self.model(batch, self.kv_cache)

    def _lora_batch(self, plan: StepPlan) -> LoraBatch:
        """Which of ``plan``'s token rows run which adapter. Set on every
        batch of a LoRA engine, adapters or not, so every batch takes the
        same path through the model (engine/lora/projections.py)."""
        assert self.lora is not None
        adapters = []
        for chunk in plan.chunks:
            adapter = None if chunk.lora is None else self.lora.resolve(chunk.lora)
            if chunk.lora is not None and adapter is None:
                # An adapter is unloaded only when no request uses it (EngineCore.unload_lora).
                raise RuntimeError(f"chunk of {chunk.request_id!r} runs adapter {chunk.lora.name!r}, which is not loaded")
            adapters.append(adapter)
        return LoraBatch.build(adapters, [chunk.num_tokens for chunk in plan.chunks], self.device)


def _split_prompt_logits(plan: StepPlan, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, ChunkPromptLogprobs]]:
    """Score the prompt targets of ``plan``'s chunks from their rows of
    ``logits``; return the rows the sampler wants (each chunk's trailing
    ``1 + num_draft_tokens`` rows when it samples, as without prompt
    logprobs) and the chunks' prompt logprobs."""
    keep: list[int] = []
    prompt: dict[str, ChunkPromptLogprobs] = {}
    offset = 0
    for chunk in plan.chunks:
        n = chunk.num_logits
        if chunk.prompt_targets:
            rows = logits[offset : offset + len(chunk.prompt_targets)]
            entries = prompt_logprobs(rows, chunk.prompt_targets, chunk.prompt_logprobs)
            prompt[chunk.request_id] = ChunkPromptLogprobs(chunk.start + 1, entries)
        wanted = 1 + chunk.num_draft_tokens if chunk.sampling is not None else 0
        keep.extend(range(offset + n - wanted, offset + n))
        offset += n
    index = torch.tensor(keep, dtype=torch.int64, device=logits.device)
    return logits.index_select(0, index), prompt
