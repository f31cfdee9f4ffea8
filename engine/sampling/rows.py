"""What the sampler reads of a step, per row: a sequence's sampling state
(``SamplingRow``) and the grammar masks of constrained rows (``TokenMask``).
Both are frozen values inside a ``runtime.step_plan.StepPlan``."""

from __future__ import annotations

import attrs
import torch

from trioserve.engine.sampling.sampling_params import SamplingParams


@attrs.frozen
class SamplingRow:
    """What the sampler needs to choose one sequence's next token.

    ``output_token_ids`` is the output so far when a penalty reads it (else
    empty); ``prompt_token_ids`` is the prompt when ``repetition_penalty``
    reads it (else empty). ``num_output_tokens`` counts the output either
    way (for ``min_tokens``).
    """

    request_id: str
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    num_output_tokens: int
    output_token_ids: tuple[int, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()

    @classmethod
    def for_sequence(
        cls,
        request_id: str,
        params: SamplingParams,
        prompt_token_ids: tuple[int, ...] | list[int],
        output_token_ids: tuple[int, ...] | list[int],
        eos_token_ids: tuple[int, ...] = (),
    ) -> SamplingRow:
        """The row of a sequence, carrying its token history only where its
        parameters read it (a copy of the output per step costs nothing then)."""
        return cls(
            request_id=request_id,
            params=params,
            eos_token_ids=tuple(eos_token_ids),
            num_output_tokens=len(output_token_ids),
            output_token_ids=tuple(output_token_ids) if params.has_penalties or params.logits_processors else (),
            prompt_token_ids=tuple(prompt_token_ids) if params.repetition_penalty != 1.0 else (),
        )


@attrs.frozen
class TokenMask:
    """The tokens each constrained row may take this step: ``bitmask`` is
    int32 [len(request_ids), ceil(vocab / 32)], row i for ``request_ids[i]``
    (bit j of word w allows token 32 * w + j). Rows not listed are free."""

    request_ids: tuple[str, ...]
    bitmask: torch.Tensor = attrs.field(eq=False)
