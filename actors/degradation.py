"""The degradation policy at work: what the engine gives up as its
admission queue fills (``DegradationPolicy`` in engine/config.py defines the
steps and "pressure").

``Degradation`` is consulted by ``Engine`` for every new request, in this
order, each step counted for ``statistics()`` and /metrics:

1. ``cap``: low priority under pressure gets a smaller ``max_tokens``;
2. ``check_expensive`` (``generate_nowait`` only): ``n > 1`` or many top
   logprobs are refused under pressure, before plain requests are;
3. ``shed`` (``generate_nowait`` only, when the queue is full): the new
   request takes the place of a queued one of strictly lower priority, which
   ends with ``RequestShed``.

``generate()`` waits for room instead of being refused or shedding others;
only the cap applies to it.
"""

from __future__ import annotations

import attrs
import trio

from trioserve.engine.config import DegradationPolicy
from trioserve.engine.sampling.sampling_params import SamplingParams

from .admission import AdmissionQueue
from .errors import ExpensiveRequestRefused, RequestShed
from .messages import AddRequest, Failed


@attrs.define
class Degradation:
    """Applies ``policy`` and counts what it did."""

    policy: DegradationPolicy
    num_capped: int = attrs.field(init=False, default=0)
    num_refused: int = attrs.field(init=False, default=0)
    num_shed: int = attrs.field(init=False, default=0)

    def cap(self, params: SamplingParams, priority: int, pressure: float) -> SamplingParams:
        """``params`` with ``max_tokens`` capped if the request is of low
        priority and pressure has reached ``cap_at``; else ``params``."""
        policy = self.policy
        if policy.cap_at is None or pressure < policy.cap_at or priority < policy.low_priority:
            return params
        cap = policy.low_priority_max_tokens
        if params.max_tokens is not None and params.max_tokens <= cap:
            return params
        self.num_capped += 1
        return attrs.evolve(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))

    def check_expensive(self, params: SamplingParams, pressure: float, retry_after: float) -> None:
        """Raise ``ExpensiveRequestRefused`` for ``n > 1`` or more than
        ``expensive_logprobs`` top logprobs once pressure has reached
        ``refuse_expensive_at``."""
        policy = self.policy
        if policy.refuse_expensive_at is None or pressure < policy.refuse_expensive_at:
            return
        if params.n > 1:
            field, asked = "n", f"n={params.n}"
        elif params.logprobs is not None and params.logprobs > policy.expensive_logprobs:
            field, asked = "logprobs", f"{params.logprobs} top logprobs (more than {policy.expensive_logprobs})"
        else:
            return
        self.num_refused += 1
        raise ExpensiveRequestRefused(
            f"the engine is under load (admission queue {pressure:.0%} full) and refuses requests for {asked} "
            f"for now; ask for less, or retry in about {retry_after:.1f} s",
            field=field,
            retry_after=retry_after,
        )

    def shed(self, admission: AdmissionQueue, message: AddRequest, retry_after: float) -> AddRequest:
        """Queue ``message`` in the full ``admission`` queue in place of its
        lowest-priority request, if that is strictly lower; end the displaced
        one with ``RequestShed`` and return it. Raise ``trio.WouldBlock`` if
        shedding is off or nothing queued is of lower priority."""
        if not self.policy.shed_lower_priority:
            raise trio.WouldBlock
        victim = admission.displace_nowait(message)
        error = RequestShed(
            f"request {victim.request_id!r} (priority {victim.priority}) gave its place in the full admission "
            f"queue to one of higher priority ({message.priority}); nothing was computed for it; "
            f"retry in about {retry_after:.1f} s",
            request_id=victim.request_id,
            retry_after=retry_after,
            num_prompt_tokens=victim.num_tokens,
        )
        try:
            victim.outputs.send_nowait(Failed(victim.request_id, error))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # its reader is gone already
        victim.outputs.close()
        self.num_shed += 1
        return victim
