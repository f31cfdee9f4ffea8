"""Builders and fakes for engine-core tests.

``make_request`` and ``make_scheduler`` build small, valid objects with
overridable defaults. ``FakeRunner`` stands in for the model runner: it keeps
a paged "KV cache" of token ids, writes each chunk's tokens into the slots its
block table names, and samples the next token as a hash of the context it
reads back from those slots. A wrong block table, a prefix-cache hit on the
wrong content or an overwritten shared block therefore changes the output or
fails loudly.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from trioserve.engine.core.block_manager import BlockManager
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.scheduler import Scheduler, SchedulerOutput
from trioserve.engine.core.sequence import Request
from trioserve.engine.latency_objectives import LatencyObjectives


def make_request(
    request_id: str = "r0",
    prompt: Sequence[int] | None = None,
    *,
    prompt_len: int = 8,
    max_tokens: int | None = 4,
    priority: int = 0,
    eos_token_ids: tuple[int, ...] = (),
    **sampling: object,
) -> Request:
    """A greedy request; ``prompt`` defaults to ``prompt_len`` tokens derived
    from the id, so different ids get different prompts."""
    if prompt is None:
        seed = sum(map(ord, request_id))
        prompt = [(seed * 31 + i * 7) % 1000 + 1 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling)
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=params,
        eos_token_ids=eos_token_ids,
        priority=priority,
    )



def slo_request(rid: str, *, arrival: float = 0.0, ttft: float | None = None, tpot: float | None = None, **kw) -> Request:
    """``make_request`` arrived at ``arrival`` with TTFT and TPOT targets (seconds)."""
    request = make_request(rid, **kw)
    request.arrival_time = arrival
    request.objectives = LatencyObjectives(ttft=ttft, tpot=tpot)
    return request

def make_scheduler(
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 64,
    num_blocks: int = 32,
    block_size: int = 4,
    enable_prefix_caching: bool = True,
) -> tuple[Scheduler, BlockManager]:
    """A scheduler and the in-process pool it plans for."""
    scheduler = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
    )
    return scheduler, BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)


def next_token(context: Sequence[int], vocab_size: int) -> int:
    """The fake model: a deterministic function of the whole context."""
    return hash(tuple(context)) % vocab_size


@attrs.define
class FakeRunner:
    """Executes plans over a fake paged KV cache of token ids."""

    block_size: int
    vocab_size: int = 1000
    _slots: dict[int, int] = attrs.field(init=False, factory=dict)  # slot -> token id written there

    def _slot(self, block_ids: Sequence[int], position: int) -> int:
        index = position // self.block_size
        if index >= len(block_ids):
            raise AssertionError(f"position {position} is past the block table {list(block_ids)}")
        return block_ids[index] * self.block_size + position % self.block_size

    def execute(self, output: SchedulerOutput, scheduler: Scheduler | None = None) -> dict[str, int]:
        """Write every chunk's tokens, then sample for chunks that sample
        from the context read back from the slots. With ``scheduler``, check
        each chunk's tokens and each context read against the request's own
        tokens (so a wrong plan or a wrongly shared block fails)."""
        for chunk in output.plan.chunks:
            if scheduler is not None:
                tokens = scheduler.get_request(chunk.request_id).all_token_ids
                expected = tokens[chunk.start : chunk.start + chunk.num_tokens]
                assert list(chunk.token_ids) == expected, f"chunk of {chunk.request_id!r} carries the wrong tokens"
            for offset, token in enumerate(chunk.token_ids):
                self._slots[self._slot(chunk.block_ids, chunk.start + offset)] = token
        sampled = {}
        for chunk in output.plan.chunks:
            if not chunk.samples:
                continue
            length = chunk.start + chunk.num_tokens
            context = [self._slots.get(self._slot(chunk.block_ids, p)) for p in range(length)]
            if scheduler is not None:
                expected = scheduler.get_request(chunk.request_id).all_token_ids[:length]
                if context != expected:
                    raise AssertionError(
                        f"request {chunk.request_id!r} reads a context that differs from its tokens "
                        f"at position {next(i for i, (a, b) in enumerate(zip(context, expected)) if a != b)}"
                    )
            sampled[chunk.request_id] = next_token(context, self.vocab_size)
        return sampled


def step(scheduler: Scheduler, block_manager: BlockManager, runner: FakeRunner) -> SchedulerOutput:
    """One whole step: schedule, execute, update; return the plan."""
    output = scheduler.schedule(block_manager)
    scheduler.update_from_output(output, runner.execute(output, scheduler))
    return output


def run_to_completion(
    scheduler: Scheduler, block_manager: BlockManager, runner: FakeRunner, *, max_steps: int = 10_000
) -> list[SchedulerOutput]:
    """Step until no request is unfinished, then release the last blocks;
    check both sides' invariants after every step. Return the plans."""
    outputs = []
    while scheduler.has_unfinished():
        if len(outputs) >= max_steps:
            raise AssertionError(f"requests still unfinished after {max_steps} steps")
        output = step(scheduler, block_manager, runner)
        if output.is_empty:
            raise AssertionError("empty plan while requests are unfinished")
        scheduler.check_invariants()
        block_manager.check_invariants(scheduler.block_holders())
        outputs.append(output)
    scheduler.free_finished(block_manager)
    return outputs
