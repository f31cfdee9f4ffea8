"""The engine's latency model, learned online from its own steps (issue #44).

A step's duration is modelled as linear in what it computes:

    seconds = c0 + c1 * prefill_tokens + c2 * prefill_pairs
                 + c3 * decodes + c4 * decode_context

``prefill_tokens`` are the prompt (or recomputed) tokens of the step,
``prefill_pairs`` the attention pairs they form with what precedes them
(the quadratic part of a long prompt), ``decodes`` the sequences decoding
one token and ``decode_context`` the tokens those attend over. The
coefficients are fitted by recursive least squares on relative errors
(each step weighed by its length: what admission needs is a prediction
within a share of each step, short or long), with forgetting
(``forgetting`` < 1 weighs recent steps more, so the fit follows a machine
whose speed drifts: a busy neighbour, a warm cache), from a prior that
holds until the first steps arrive (``LatencyModel.from_profile``
restores a saved fit instead, covariance and all).

From the step law it predicts what admission needs: a new request's time
to first token given the prefill queued ahead of it and the running batch
(``predict_ttft``), and its time per output token in the batch it will
join (``predict_tpot``). Synchronous and without trio: the scheduler actor
feeds it at each step boundary (``observe``), one model per engine, so per
replica and per worker process.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from trioserve.engine.core.kv_batch import KVAllocation
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
# The prior's variance per coefficient, times ``prior_variance``: the
# second-order terms (attention pairs, decode context) start held near
# zero. In most steps they move with the first-order ones (a batch's
# context grows with its size), and a fit free in both splits one effect
# between them at random, extrapolating to a longer context with a
# negative slope; held, they take only what the first-order terms cannot
# explain.
PRIOR_SHAPE = np.array([1.0, 1.0, 0.01, 1.0, 0.01])
# The share of recent steps' spread (measured over predicted) that
# ``seconds_left`` takes as it is; the slower rest count as this quantile.
TAIL_QUANTILE = 0.95
# Steps simulated at most for one TTFT prediction (a bound on its cost).
MAX_SIMULATED_STEPS = 10_000
# Requests yet to arrive simulated at most for one TTFT prediction: the
# bound on its cost when the classes ahead alone fill the engine.
MAX_SIMULATED_ARRIVALS = 256


# A saved fit's format (``LatencyModel.to_profile``); a version this
# engine does not read is refused rather than guessed at.
PROFILE_FORMAT = "trioserve-latency-profile"
PROFILE_VERSION = 1


class LatencyProfileError(ValueError):
    """A saved latency profile that cannot seed a model: ``field`` names
    what is wrong with it (e.g. ``covariance[2][4]``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"latency profile field {field!r}: {message}")
        self.field = field


@attrs.frozen
class _ProfileReader:
    """Reads a profile's fields, naming the one that fails."""

    data: object

    def get(self, name: str, kind: type) -> Any:
        if not isinstance(self.data, dict):
            raise LatencyProfileError("(top level)", f"expected a JSON object, got {type(self.data).__name__}")
        if name not in self.data:
            raise LatencyProfileError(name, "missing")
        value = self.data[name]
        # bool is an int to Python, not to JSON.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise LatencyProfileError(name, f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    def number(self, name: str) -> float:
        return _finite(name, self.get(name, object))

    def vector(self, name: str, row: int | None = None) -> list[float]:
        value = self.get(name, list)
        field = name
        if row is not None:
            if len(value) != NUM_FEATURES:
                raise LatencyProfileError(name, f"expected {NUM_FEATURES} rows, got {len(value)}")
            value, field = value[row], f"{name}[{row}]"
            if not isinstance(value, list):
                raise LatencyProfileError(field, f"expected list, got {type(value).__name__}")
        if len(value) != NUM_FEATURES:
            raise LatencyProfileError(field, f"expected {NUM_FEATURES} numbers, got {len(value)}")
        return [_finite(f"{field}[{i}]", v) for i, v in enumerate(value)]


def _finite(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LatencyProfileError(field, f"expected a number, got {type(value).__name__}")
    if not np.isfinite(value):
        raise LatencyProfileError(field, f"expected a finite number, got {value!r}")
    return float(value)


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

    @classmethod
    def of_allocations(cls, allocations: Iterable[KVAllocation]) -> StepShape:
        """The shape of a step known only by its pool requests (the
        scheduler's proposal, before the pool answers and the plan exists):
        a request holding blocks that needs room for one token decodes, the
        rest prefill (drafts and prefix-cache hits are not told apart)."""
        prefill = pairs = decodes = context = 0
        for allocation in allocations:
            start, count = allocation.num_computed_tokens, allocation.num_new_tokens
            if count == 1 and not allocation.token_ids:
                decodes += 1
                context += start + 1
            else:
                prefill += count
                pairs += count * (start + (count + 1) // 2)
        return cls(prefill, pairs, decodes, context)

    def features(self) -> np.ndarray:
        raw = np.array([1.0, self.prefill_tokens, self.prefill_pairs, self.decodes, self.decode_context])
        return raw * _SCALE


@attrs.define
class _Simulated:
    """A request in ``predict_ttft``'s simulation."""

    prefill: int  # tokens still to prefill
    output: int  # tokens still to generate
    context: int  # tokens computed
    own: bool = False


@attrs.frozen
class TtftParts:
    """A simulated time to first token, in seconds, in its parts:
    ``before`` the first step that computes the request's own prompt (the
    steps of the load ahead of it), and ``own`` from that step to its first
    token (its prompt's steps, shared with the others' tokens)."""

    before: float
    own: float

    @property
    def total(self) -> float:
        return self.before + self.own


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
    forgetting: float = attrs.field(default=0.97)
    prior_variance: float = 1.0
    window: int = 256
    _theta: np.ndarray = attrs.field(init=False)
    _covariance: np.ndarray = attrs.field(init=False)
    _num_steps: int = attrs.field(init=False, default=0)
    # Measured over predicted, the recent steps: their relative errors
    # (``statistics``) and spread (``seconds_left``).
    _ratios: deque[float] = attrs.field(init=False)

    @forgetting.validator
    def _check_forgetting(self, _attribute: object, value: float) -> None:
        if not 0.5 < value <= 1.0:
            raise ValueError(f"forgetting must be in (0.5, 1], got {value!r}")

    def __attrs_post_init__(self) -> None:
        if len(self.prior) != NUM_FEATURES:
            raise ValueError(f"prior must have {NUM_FEATURES} coefficients, got {len(self.prior)}")
        self._theta = np.array(self.prior, dtype=float)
        self._covariance = np.diag(PRIOR_SHAPE) * self.prior_variance
        self._ratios = deque(maxlen=self.window)

    # -- a saved fit ------------------------------------------------------------

    def to_profile(self, identity: Mapping[str, object] | None = None) -> dict[str, object]:
        """The whole fit as a JSON-able value (``from_profile`` makes it a
        model again, predicting and learning as this one): settings,
        coefficients, covariance and steps seen, with ``identity``, what it
        was learned for (model, batch size, threads, kernels), for the
        caller to compare before seeding."""
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "identity": dict(identity or {}),
            "forgetting": float(self.forgetting),
            "prior_variance": float(self.prior_variance),
            "window": self.window,
            "prior": [float(c) for c in self.prior],
            "coefficients": [float(c) for c in self._theta],
            "covariance": [[float(v) for v in row] for row in self._covariance],
            "num_steps": self._num_steps,
        }

    @classmethod
    def from_profile(cls, data: object) -> LatencyModel:
        """The model ``to_profile`` saved; ``LatencyProfileError`` names the
        field that is missing, of the wrong type, not finite or out of range,
        or a version this engine does not read."""
        profile = _ProfileReader(data)
        if profile.get("format", str) != PROFILE_FORMAT:
            raise LatencyProfileError("format", f"expected {PROFILE_FORMAT!r}")
        version = profile.get("version", int)
        if version != PROFILE_VERSION:
            raise LatencyProfileError("version", f"version {version} is not read here (expected {PROFILE_VERSION})")
        profile.get("identity", dict)
        forgetting = profile.number("forgetting")
        if not 0.5 < forgetting <= 1.0:
            raise LatencyProfileError("forgetting", f"must be in (0.5, 1], got {forgetting!r}")
        prior_variance = profile.number("prior_variance")
        if not prior_variance > 0:
            raise LatencyProfileError("prior_variance", f"must be > 0, got {prior_variance!r}")
        window = profile.get("window", int)
        if window < 1:
            raise LatencyProfileError("window", f"must be >= 1, got {window!r}")
        num_steps = profile.get("num_steps", int)
        if num_steps < 0:
            raise LatencyProfileError("num_steps", f"must be >= 0, got {num_steps!r}")
        model = cls(
            prior=tuple(profile.vector("prior")), forgetting=forgetting, prior_variance=prior_variance, window=window
        )
        model._theta = np.array(profile.vector("coefficients"))
        model._covariance = np.array([profile.vector("covariance", i) for i in range(NUM_FEATURES)])
        model._num_steps = num_steps
        return model

    def adopt(self, other: LatencyModel) -> None:
        """Take ``other``'s settings and fit in place: a running engine's
        scheduler and policy share this object, so a saved profile seeds
        it here rather than by replacing it."""
        self.prior, self.forgetting, self.prior_variance = other.prior, other.forgetting, other.prior_variance
        self.window = other.window
        self._theta = other._theta.copy()
        self._covariance = other._covariance.copy()
        self._num_steps = other._num_steps
        self._ratios = deque(maxlen=self.window)

    # -- learning ---------------------------------------------------------------

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One step of ``shape`` took ``seconds``: record how far the
        prediction was, then update the fit (one recursive least squares
        step with forgetting)."""
        if not seconds > 0:
            return
        predicted = self.step_seconds(shape)
        self._ratios.append(seconds / predicted)
        # Least squares on relative errors: each step weighed by its length
        # (the longer of measured and predicted, so that neither a tiny
        # measurement nor a stale prediction weighs it without bound).
        # Unweighed, a 5% wobble of 0.4 s prompt steps swamped 3 ms decode
        # steps, whose prediction went 20-70% off on some laws.
        weight = 1.0 / max(seconds, predicted)
        x = shape.features() * weight
        px = self._covariance @ x
        gain = px / (self.forgetting + x @ px)
        self._theta = self._theta + gain * (seconds * weight - x @ self._theta)
        self._covariance = (self._covariance - np.outer(gain, px)) / self.forgetting
        # Keep it symmetric and bounded: forgetting inflates directions no
        # step excites (a feature always zero), without limit otherwise.
        self._covariance = (self._covariance + self._covariance.T) / 2
        np.clip(self._covariance, -1e6, 1e6, out=self._covariance)
        self._num_steps += 1

    def observe_plan(self, plan: StepPlan, seconds: float) -> None:
        """``observe`` a step given as the plan the runner ran."""
        self.observe(StepShape.of_plan(plan), seconds)

    @property
    def num_steps(self) -> int:
        """The steps it has learned from."""
        return self._num_steps

    # -- predictions --------------------------------------------------------------

    def step_seconds(self, shape: StepShape) -> float:
        """A step of ``shape``'s predicted duration."""
        return max(MIN_STEP_SECONDS, float(shape.features() @ self._theta))

    def seconds_left(self, shape: StepShape, elapsed: float) -> float:
        """What a step of ``shape`` that has run ``elapsed`` seconds is
        expected to run still: the mean over the recent steps' spread
        (measured over predicted) of the ends still ahead, less
        ``elapsed``. Not the prediction less ``elapsed``: a request is
        likelier to arrive during a long step than a short one, and a step
        past its prediction is not about to end (it was predicted to have
        nothing left, while it ran on). The spread is cut at its
        ``TAIL_QUANTILE``: one step stalled by a page fault storm or a
        neighbour must not make every later overrun look as long (an
        interactive request refused for it). Before any step, or past every
        recent end, the prediction's rest, at least nothing."""
        predicted = self.step_seconds(shape)
        ratios = sorted(self._ratios)
        cut = ratios[int(TAIL_QUANTILE * (len(ratios) - 1))] if ratios else 0.0
        ends = [min(ratio, cut) * predicted for ratio in ratios]
        ends = [end for end in ends if end > elapsed]
        if not ends:
            return max(0.0, predicted - elapsed)
        return sum(ends) / len(ends) - elapsed

    def predict_ttft(
        self,
        prompt_tokens: int,
        *,
        cached_tokens: int = 0,
        ahead: Iterable[tuple[int, int]] = (),
        behind: Iterable[tuple[int, int]] = (),
        running: Iterable[tuple[int, int, int]] = (),
        arrivals: Iterable[tuple[float, int, int]] = (),
        arrivals_for: float = math.inf,
        token_budget: int = 2048,
        max_num_seqs: int = 256,
    ) -> float:
        """Seconds until a new request's first token (``predict_ttft_parts``'s total)."""
        return self.predict_ttft_parts(
            prompt_tokens,
            cached_tokens=cached_tokens,
            ahead=ahead,
            behind=behind,
            running=running,
            arrivals=arrivals,
            arrivals_for=arrivals_for,
            token_budget=token_budget,
            max_num_seqs=max_num_seqs,
        ).total

    def predict_ttft_parts(
        self,
        prompt_tokens: int,
        *,
        cached_tokens: int = 0,
        ahead: Iterable[tuple[int, int]] = (),
        behind: Iterable[tuple[int, int]] = (),
        running: Iterable[tuple[int, int, int]] = (),
        arrivals: Iterable[tuple[float, int, int]] = (),
        arrivals_for: float = math.inf,
        token_budget: int = 2048,
        max_num_seqs: int = 256,
    ) -> TtftParts:
        """Seconds until a new request's first token, simulated step by step
        as the scheduler would run the load it meets:

        - ``running``: the running requests, each ``(context, prefill,
          output)``: tokens computed, tokens still to prefill, tokens still
          to generate (at most);
        - ``ahead``: the waiting requests the policy runs before it, in
          that order, each ``(prefill, output)``;
        - then its own ``prompt_tokens - cached_tokens``;
        - ``behind``: the waiting requests the policy runs after it, each
          ``(prefill, output)``: they take what is left of a step's token
          budget, so the step that computes its prompt may carry theirs
          too (an interactive prompt's step was three times its own cost
          with a batch prompt filling it);
        - ``arrivals``: requests yet to come that the policy will run
          before it (a higher class), each stream ``(rate, prefill,
          output)``: per second, and each request's tokens. While it waits
          for a slot, each simulated second of the first ``arrivals_for``
          brings ``rate`` of them into the queue just ahead of it (at most
          ``MAX_SIMULATED_ARRIVALS``).

        A waiting request starts when fewer than ``max_num_seqs`` run; each
        step gives every decoding request one token and the rest of
        ``token_budget`` to prefill, in order; a request leaves when its
        output is done. Stretches of decode-only steps are summed in one go
        (the law is linear in the context). TTFT counts from its arrival:
        the step in flight then is not counted."""
        own = _Simulated(max(1, prompt_tokens - cached_tokens), 1, 0, own=True)
        active = [_Simulated(max(0, prefill), max(1, output), max(0, context)) for context, prefill, output in running]
        queue = deque(_Simulated(max(1, prefill), max(1, output), 0) for prefill, output in ahead)
        queue.append(own)
        after = [_Simulated(max(1, prefill), max(1, output), 0) for prefill, output in behind]
        queue.extend(after)  # all still queued while it is: it leaves the queue before them
        streams = [(rate, max(1, prefill), max(1, output)) for rate, prefill, output in arrivals if rate > 0]
        credit = [0.0] * len(streams)  # each stream's arrivals due, in requests
        num_arrived = 0
        total = 0.0
        before: float | None = None  # the time when its own prompt's first step starts

        def arrive(seconds: float) -> None:
            # The requests arriving in the ``seconds`` up to ``total``, while
            # it is still queued, go just ahead of it.
            nonlocal num_arrived
            at = len(queue) - len(after) - 1  # its place, while it waits
            if at < 0 or queue[at] is not own:
                return
            seconds = max(0.0, min(total, arrivals_for) - (total - seconds))
            for k, (rate, prefill, output) in enumerate(streams):
                credit[k] += rate * seconds
                while credit[k] >= 1.0 and num_arrived < MAX_SIMULATED_ARRIVALS:
                    credit[k] -= 1.0
                    num_arrived += 1
                    queue.insert(at, _Simulated(prefill, output, 0))
                    at += 1

        for _ in range(MAX_SIMULATED_STEPS):
            while queue and len(active) < max_num_seqs:
                active.append(queue.popleft())
            decoding = [a for a in active if a.prefill == 0]
            prefilling = [a for a in active if a.prefill > 0]
            context = sum(a.context for a in decoding)
            if not prefilling:
                if not decoding:
                    return TtftParts(total, 0.0)
                # Decode only until the first of them finishes and frees a slot.
                steps = min(a.output for a in decoding)
                mid = context + len(decoding) * (steps - 1) / 2
                stretch = steps * self.step_seconds(StepShape(decodes=len(decoding), decode_context=int(mid)))
                total += stretch
                arrive(stretch)
                for a in decoding:
                    a.output -= steps
                    a.context += steps
                active = [a for a in active if a.output > 0]
                continue
            room = max(1, token_budget - len(decoding))
            prefill = pairs = 0
            for a in prefilling:
                take = min(room, a.prefill)
                if a is own and before is None:
                    before = total
                prefill += take
                pairs += take * (a.context + (take + 1) // 2)
                a.prefill -= take
                a.context += take
                room -= take
                if room == 0:
                    break
            step = self.step_seconds(StepShape(prefill, pairs, len(decoding), context))
            total += step
            arrive(step)
            if own.prefill == 0:
                start = total if before is None else before
                return TtftParts(start, total - start)
            # This step sampled a token for the decodes and the finished prefills.
            for a in active:
                if a.prefill == 0:
                    a.output -= 1
                    a.context += 1
            active = [a for a in active if a.output > 0]
        return TtftParts(total, 0.0)

    def predict_tpot(self, batch_size: int, context_tokens: int) -> float:
        """Seconds per output token of a sequence decoding in a batch of
        ``batch_size`` sequences attending over ``context_tokens`` tokens
        in all."""
        return self.step_seconds(StepShape(decodes=max(1, batch_size), decode_context=max(0, context_tokens)))

    def statistics(self) -> LatencyModelStatistics:
        # |predicted - measured| / measured, from measured / predicted.
        errors = sorted(abs(1.0 - 1.0 / ratio) for ratio in self._ratios)
        p50 = p90 = None
        if errors:
            p50 = errors[len(errors) // 2]
            p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
        return LatencyModelStatistics(tuple(float(c) for c in self._theta), self._num_steps, p50, p90)
