"""The engine's latency model, learned online from its own steps (issue #44).

A step's duration is modelled as linear in what it computes:

    seconds = c0 + c1 * prefill_tokens + c2 * prefill_pairs
                 + c3 * decodes + c4 * decode_context

``prefill_tokens`` are the prompt (or recomputed) tokens of the step,
``prefill_pairs`` the attention pairs they form with what precedes them
(the quadratic part of a long prompt), ``decodes`` the sequences decoding
one token and ``decode_context`` the tokens those attend over. The
coefficients are fitted by recursive least squares with forgetting
(``forgetting`` < 1 weighs recent steps more, so the fit follows a machine
whose speed drifts: a busy neighbour, a warm cache), from a prior that
holds until the first steps arrive (``LatencyModel.from_profile`` seeds
it from a saved fit instead).

From the step law it predicts what admission needs: a new request's time
to first token given the prefill queued ahead of it and the running batch
(``predict_ttft``), and its time per output token in the batch it will
join (``predict_tpot``). Synchronous and without trio: the scheduler actor
feeds it at each step boundary (``observe``), one model per engine, so per
replica and per worker process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from trioserve.engine.runtime.step_plan import StepPlan

# Features are scaled so that a step's features are of order one: tokens
# per hundred, attention pairs per ten thousand.
_SCALE = np.array([1.0, 1e-2, 1e-4, 1.0, 1e-2])
NUM_FEATURES = len(_SCALE)
# Before any step: 5 ms a step, 50 us a prefill token, 1 ms a decoding
# sequence (a small model on a CPU); the wide prior variance lets the
# first few steps replace it.
DEFAULT_PRIOR = (0.005, 0.005, 0.0, 0.001, 0.0)
# The shortest step it predicts: a fit can go below zero where it has no data.
MIN_STEP_SECONDS = 1e-4
# Steps simulated at most for one TTFT prediction (a bound on its cost).
MAX_SIMULATED_STEPS = 10_000


@attrs.frozen
class StepShape:
    """What one step computed, as the model sees it."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decodes: int = 0
    decode_context: int = 0

    @classmethod
    def of_plan(cls, plan: StepPlan) -> StepShape:
        """The shape of ``plan``: decode chunks (one token sampled last
        step, plus any draft tokens) against the rest, which is prefill."""
        prefill = pairs = decodes = context = 0
        for chunk in plan.chunks:
            if chunk.is_decode:
                decodes += 1
                context += chunk.start + chunk.num_tokens
            else:
                prefill += chunk.num_tokens
                pairs += chunk.num_tokens * (chunk.start + (chunk.num_tokens + 1) // 2)
        return cls(prefill, pairs, decodes, context)

    def features(self) -> np.ndarray:
        raw = np.array([1.0, self.prefill_tokens, self.prefill_pairs, self.decodes, self.decode_context])
        return raw * _SCALE


@attrs.frozen
class LatencyModelStatistics:
    """The fit now: its coefficients (seconds per step, per hundred
    prefill tokens, per ten thousand prefill attention pairs, per decoding
    sequence, per hundred decode context tokens), the steps it has seen,
    and the relative error of its one-step-ahead predictions over the
    recent ``window`` steps (median and p90; None before any step)."""

    coefficients: tuple[float, ...]
    num_steps: int
    step_error_p50: float | None
    step_error_p90: float | None


@attrs.define(eq=False)
class LatencyModel:
    """A step-cost law fitted online; see the module's docstring.

    ``forgetting``: the weight of the past per step (1: never forget).
    ``window``: recent steps whose prediction error ``statistics`` reports.
    """

    prior: Sequence[float] = DEFAULT_PRIOR
    forgetting: float = attrs.field(default=0.995)
    prior_variance: float = 1.0
    window: int = 256
    _theta: np.ndarray = attrs.field(init=False)
    _covariance: np.ndarray = attrs.field(init=False)
    _num_steps: int = attrs.field(init=False, default=0)
    _errors: deque[float] = attrs.field(init=False)

    @forgetting.validator
    def _check_forgetting(self, _attribute: object, value: float) -> None:
        if not 0.5 < value <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {value!r}")

    def __attrs_post_init__(self) -> None:
        if len(self.prior) != NUM_FEATURES:
            raise ValueError(f"prior must have {NUM_FEATURES} coefficients, got {len(self.prior)}")
        self._theta = np.array(self.prior, dtype=float)
        self._covariance = np.eye(NUM_FEATURES) * self.prior_variance
        self._errors = deque(maxlen=self.window)

    # -- a saved fit ------------------------------------------------------------

    def profile(self) -> dict[str, object]:
        """The fit as a JSON-able value, to seed a later engine (``from_profile``)."""
        return {"coefficients": [float(c) for c in self._theta], "num_steps": self._num_steps}

    @classmethod
    def from_profile(cls, profile: Mapping[str, object], **kwargs) -> LatencyModel:
        """A model whose prior is a saved fit (``profile``), held with more
        confidence than the default prior: it still follows the steps."""
        coefficients = profile.get("coefficients")
        if not isinstance(coefficients, list | tuple) or len(coefficients) != NUM_FEATURES:
            raise ValueError(f"a latency profile has {NUM_FEATURES} coefficients, got {coefficients!r}")
        kwargs.setdefault("prior_variance", 0.01)
        return cls(prior=tuple(float(c) for c in coefficients), **kwargs)

    # -- learning ---------------------------------------------------------------

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step of ``shape`` took ``seconds``: record how far the
        prediction was, then update the fit (one recursive least squares
        step with forgetting)."""
        if not seconds > 0:
            return
        predicted = self.step_seconds(shape)
        self._errors.append(abs(predicted - seconds) / seconds)
        x = shape.features()
        px = self._covariance @ x
        gain = px / (self.forgetting + x @ px)
        self._theta = self._theta + gain * (seconds - x @ self._theta)
        self._covariance = (self._covariance - np.outer(gain, px)) / self.forgetting
        # Keep it symmetric and bounded: forgetting inflates directions no
        # step excites (a feature always zero), without limit otherwise.
        self._covariance = (self._covariance + self._covariance.T) / 2
        np.clip(self._covariance, -1e6, 1e6, out=self._covariance)
        self._num_steps += 1

    def observe_plan(self, plan: StepPlan, seconds: float) -> None:
        """``observe`` a step given as the plan the runner ran."""
        self.observe(StepShape.of_plan(plan), seconds)

    # -- predictions --------------------------------------------------------------

    def step_seconds(self, shape: StepShape) -> float:
        """A step of ``shape``'s predicted duration."""
        return max(MIN_STEP_SECONDS, float(shape.features() @ self._theta))

    def predict_ttft(
        self,
        prompt_tokens: int,
        *,
        cached_tokens: int = 0,
        ahead: Iterable[int] = (),
        num_running: int = 0,
        running_context: int = 0,
        token_budget: int = 2048,
        max_num_seqs: int = 256,
    ) -> float:
        """Seconds until a new request's first token: the steps that run
        the prefill queued ``ahead`` of it (each waiting request's tokens
        still to compute, in the order the policy runs them) and then its
        own ``prompt_tokens - cached_tokens``, chunked into steps of
        ``token_budget`` tokens beside the running decodes. A request ahead
        joins the decodes once its prefill is done (up to ``max_num_seqs``).
        The time already queued before it arrived is not counted: TTFT is
        from its arrival."""
        queue = [max(0, tokens) for tokens in ahead]
        queue.append(max(1, prompt_tokens - cached_tokens))
        decodes, context = num_running, running_context
        mean_context = running_context / num_running if num_running else 0.0
        total = 0.0
        index, left = 0, queue[0]
        for _ in range(MAX_SIMULATED_STEPS):
            room = max(1, token_budget - decodes)
            prefill = pairs = 0
            finished_own = False
            joined = joined_context = 0
            while room > 0 and index < len(queue):
                take = min(room, left)
                prefill += take
                start = queue[index] - left
                pairs += take * (start + (take + 1) // 2)
                left -= take
                room -= take
                if left == 0:
                    if index == len(queue) - 1:
                        finished_own = True
                    else:
                        joined += 1
                        joined_context += queue[index]
                    index += 1
                    left = queue[index] if index < len(queue) else 0
            total += self.step_seconds(StepShape(prefill, pairs, decodes, context))
            if finished_own:
                return total
            # Each decoding sequence's context grows by its token; the ones
            # whose prefill finished decode from the next step on.
            context += decodes
            room_to_join = max(0, max_num_seqs - decodes)
            decodes += min(joined, room_to_join)
            context += joined_context if joined <= room_to_join else int(mean_context * room_to_join)
        return total

    def predict_tpot(self, batch_size: int, context_tokens: int) -> float:
        """Seconds per output token of a sequence decoding in a batch of
        ``batch_size`` sequences attending over ``context_tokens`` tokens
        in all."""
        return self.step_seconds(StepShape(decodes=max(1, batch_size), decode_context=max(0, context_tokens)))

    def statistics(self) -> LatencyModelStatistics:
        errors = sorted(self._errors)
        p50 = p90 = None
        if errors:
            p50 = errors[len(errors) // 2]
            p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
        return LatencyModelStatistics(tuple(float(c) for c in self._theta), self._num_steps, p50, p90)
