"""The batched sampler: turns one step's logits into one token per request.

Stages run in a fixed order, and a stage no row of the batch uses is skipped
entirely, so a batch of greedy requests costs one ``argmax``:

1. ``logit_bias``;
2. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are
   masked while the request has fewer than ``min_tokens`` output tokens;
3. penalties: repetition over prompt and output tokens (as in HF and vLLM),
   then frequency and presence over output tokens (as OpenAI defines them);
   then structured output: tokens a constrained row's grammar rules out
   (the plan's ``TokenMask``) get -inf, in one masked fill for the batch;
4. greedy rows take the ``argmax`` here;
5. the other rows: temperature, ``top_k``, ``top_p``, ``min_p``, then a draw.

Logprobs are those of the model's raw distribution (before any of the stages
above), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from trioserve.engine.sampling.argmax import argmax
from trioserve.engine.sampling.grammar import unpack_bitmask
from trioserve.engine.plugins import PluginError
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.speculative import verify_greedy, verify_sampled
from trioserve.engine.sampling.rows import SamplingRow, TokenMask

# Temperatures below this are treated as greedy: dividing by them overflows.
_GREEDY_EPS = 1e-5
# torch.Generator.manual_seed takes any value that fits in 64 bits.
_SEED_MASK = (1 << 64) - 1


@attrs.frozen
class TokenLogprobs:
    """The logprob of a sampled token and the ``params.logprobs`` most likely
    tokens of the same distribution, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class SamplerOutput:
    """One token per row of the batch, and its logprobs where asked for.
    ``failed``: the sequences whose logits processor raised (their token was
    drawn without it; the engine fails their requests)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[str, PluginError] = attrs.field(factory=dict)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``logits`` [B, V] with the tokens each row drops set to -inf.

    Per row, in this order:

    - ``top_k`` [B] (int): keep the tokens whose logit is >= the k-th largest
      (ties with it are kept); ``k <= 0`` or ``k >= V`` keeps all;
    - ``top_p`` [B]: of what is left, keep the most likely tokens until their
      mass reaches ``p``: a token is kept when the renormalised mass of the
      tokens ranked strictly above it is < ``p``; ``p >= 1`` keeps all;
    - ``min_p`` [B]: of what is left, keep the tokens whose probability is
      >= ``min_p`` times the most likely one's.

    The most likely token is always kept. Pass None for a stage no row uses.
    """
    vocab = logits.shape[-1]
    out = logits
    if top_k is not None:
        # A partial topk is much cheaper than sorting the whole vocabulary.
        enabled = (top_k > 0) & (top_k < vocab)
        if bool(enabled.any()):
            k = torch.where(enabled, top_k, 1).to(torch.long)
            largest = logits.topk(int(k.max()), dim=-1).values
            kth = largest.gather(-1, (k - 1).unsqueeze(-1))
            out = logits.masked_fill((logits < kth) & enabled.unsqueeze(-1), float("-inf"))
    if top_p is not None:
        out = _apply_top_p(out, top_p)
    if min_p is not None:
        probs = out.softmax(dim=-1)
        threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
        out = out.masked_fill(probs < threshold, float("-inf"))
    return out


# Top-p looks for its nucleus among each row's most likely tokens first: a
# partial topk of these costs a fraction of sorting a 50k-token vocabulary.
TOP_P_CANDIDATES = 1024


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The top-p stage of ``apply_top_k_top_p_min_p`` (``-inf`` logits are
    tokens an earlier stage dropped).

    Exact: a token outside a row's candidates has at least the candidates'
    whole mass ranked above it, so once that mass reaches ``p`` every such
    token is dropped. Rows whose candidates hold less than ``p`` (flat
    distributions) are sorted in full instead.
    """
    active = top_p < 1.0
    if not bool(active.any()):
        return logits
    _, indices = logits.topk(min(TOP_P_CANDIDATES, logits.shape[-1]), dim=-1)  # descending
    probs = logits.softmax(dim=-1).gather(-1, indices)  # as the full sort computes them
    cumulative = probs.cumsum(dim=-1)
    drop_candidate = (cumulative - probs) >= top_p.unsqueeze(-1)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, indices, ~drop_candidate)
    out = logits.masked_fill(~keep & active.unsqueeze(-1), float("-inf"))
    uncovered = (active & (cumulative[:, -1] < top_p)).nonzero().flatten()
    if uncovered.numel():
        out[uncovered] = _top_p_by_sort(logits[uncovered], top_p[uncovered])
    return out


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop_sorted = (mass_above >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Return ``logits`` [B, V] penalised for tokens already seen.

    ``prompt_mask`` [B, V] (bool) marks tokens of the prompt and
    ``output_counts`` [B, V] counts tokens of the output. A token seen in
    either has its logit divided by ``repetition`` [B] when positive and
    multiplied by it otherwise (HF, vLLM); then each output occurrence
    subtracts ``frequency`` [B] and any occurrence subtracts ``presence``
    [B] once (OpenAI).
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, penalised, logits)
    out = out - frequency.unsqueeze(-1) * output_counts
    return out - presence.unsqueeze(-1) * (output_counts > 0).to(out.dtype)


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _apply_token_mask(logits: torch.Tensor, rows: Sequence[SamplingRow], token_mask: TokenMask) -> torch.Tensor:
    position = {row.request_id: i for i, row in enumerate(rows)}
    index = _long([position[request_id] for request_id in token_mask.request_ids], logits.device)
    allowed = unpack_bitmask(token_mask.bitmask.to(logits.device), logits.shape[1])
    ruled_out = torch.zeros_like(logits, dtype=torch.bool)
    ruled_out[index] = ~allowed
    return logits.masked_fill(ruled_out, float("-inf"))


def _exponential_race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    # Dividing by Exp(1) noise and taking the argmax draws from ``probs``
    # without torch.multinomial's device sync. The clamp keeps a zero draw
    # from turning 0/0 into a NaN that argmax would pick.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(probs.dtype).tiny)
    return argmax(probs / noise)


class Sampler:
    """Chooses the next token of every request in a batch, on ``device``.

    It keeps two things per sequence across steps, both owned by the thread
    that runs the steps: a seeded sequence's ``torch.Generator`` (made at its
    first draw, so its tokens depend only on its seed and its own history;
    a sampler that meets a seeded sequence with ``num_output_tokens`` already
    drawn elsewhere replays that many draws first, so a restarted worker
    process continues the sequence exactly)
    and the prompt as a tensor for ``repetition_penalty``. ``forget`` drops
    them when the sequence ends.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        logits_processors: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generators: dict[str, torch.Generator] = {}
        self._prompts: dict[str, torch.Tensor] = {}
        # Logits-processor plugins by name, and each sequence's instances.
        self._processor_factories = dict(logits_processors or {})
        self._processors: dict[str, list[tuple[str, Callable[..., Any]]]] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the per-sequence state of ended sequences."""
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self._processors.pop(request_id, None)

    @property
    def num_sequences(self) -> int:
        """Sequences with state kept here (seeded or penalised by repetition)."""
        return len(self._generators.keys() | self._prompts.keys())

    def _generator(self, row: SamplingRow) -> torch.Generator:
        generator = self._generators.get(row.request_id)
        if generator is None:
            assert row.params.seed is not None
            generator = torch.Generator(device=self.device)
            generator.manual_seed(row.params.seed & _SEED_MASK)
            # A sequence met with output already drawn (by a sampler in a
            # worker process that died): replay those draws, so the
            # generator is where the lost one was and the sequence goes on
            # exactly as it would have. Each draw filled one row of the
            # vocabulary in float32 (_exponential_race), whatever its logits.
            for _ in range(row.num_output_tokens):
                torch.empty(self.vocab_size, dtype=torch.float32, device=self.device).exponential_(generator=generator)
            self._generators[row.request_id] = generator
        return generator

    def _prompt_tensor(self, row: SamplingRow) -> torch.Tensor:
        tensor = self._prompts.get(row.request_id)
        if tensor is None:
            tensor = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=self.device)
            self._prompts[row.request_id] = tensor
        return tensor

    def sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_mask: TokenMask | None = None
    ) -> SamplerOutput:
        """One token for each row of ``logits`` [B, V]; row i is ``rows[i]``.
        ``token_mask`` limits the rows it lists to their allowed tokens.

        ``logits`` is not modified.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {list(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}")
        # Columns past the vocabulary (a padded LM head) are never sampled.
        logits = logits[:, : self.vocab_size].to(device=self.device, dtype=torch.float32)
        params = [row.params for row in rows]
        failed: dict[str, PluginError] = {}
        if any(p.logits_processors for p in params):
            logits = self._run_processors(logits, rows, failed)
        want_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None

        logits = self._bias_mask_penalise(logits, rows, params)
        if token_mask is not None and token_mask.request_ids:
            logits = _apply_token_mask(logits, rows, token_mask)
        random_rows = [i for i, p in enumerate(params) if p.temperature >= _GREEDY_EPS]
        if not random_rows:
            tokens = argmax(logits)
        elif len(random_rows) == len(rows):
            tokens = self._sample_random(logits, rows, random_rows)
        else:
            tokens = argmax(logits)
            tokens[random_rows] = self._sample_random(logits, [rows[i] for i in random_rows], random_rows)
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            self._fill_logprobs(logprobs, raw_logprobs, want_logprobs, token_ids, params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs, failed=failed)

    def _run_processors(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], failed: dict[str, PluginError]
    ) -> torch.Tensor:
        """Apply each row's logits processors (plugins) to a copy of its
        logits, in the order the request names them. One that raises fails
        only its sequence: its row is left as the model made it."""
        logits = logits.clone()
        for i, row in enumerate(rows):
            if not row.params.logits_processors:
                continue
            name = "?"
            try:
                processors = self._processors.get(row.request_id)
                if processors is None:
                    processors = []
                    for spec in row.params.logits_processors:
                        name = spec.name
                        processors.append((name, self._processor_factories[name](dict(spec.args))))
                    self._processors[row.request_id] = processors
                out = logits[i]
                for name, processor in processors:
                    out = processor(row.output_token_ids, out)
                    if not isinstance(out, torch.Tensor) or out.shape != logits[i].shape:
                        raise TypeError(f"it must return a tensor of shape {list(logits[i].shape)}")
                logits[i] = out
            except Exception as exc:
                failed[row.request_id] = PluginError.from_exception(name, "logits processor", exc)
        return logits

    def _bias_mask_penalise(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], params: list[SamplingParams]
    ) -> torch.Tensor:
        # Stages 1-3; the tensor is copied only when one of them applies.
        bias_rows, bias_cols, bias_vals = [], [], []
        for i, p in enumerate(params):
            for token_id, value in p.logit_bias:
                bias_rows.append(i)
                bias_cols.append(token_id)
                bias_vals.append(value)
        mask_rows, mask_cols = [], []
        for i, (row, p) in enumerate(zip(rows, params)):
            if row.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(row.eos_token_ids)
                mask_rows.extend([i] * len(banned))
                mask_cols.extend(banned)
        penalty_rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not (bias_rows or mask_rows or penalty_rows):
            return logits
        logits = logits.clone()
        dev = logits.device
        if bias_rows:
            index = (_long(bias_rows, dev), _long(bias_cols, dev))
            logits.index_put_(index, torch.tensor(bias_vals, dtype=logits.dtype, device=dev), accumulate=True)
        if mask_rows:
            logits[_long(mask_rows, dev), _long(mask_cols, dev)] = float("-inf")
        if penalty_rows:
            logits[penalty_rows] = self._penalised(logits[penalty_rows], [rows[i] for i in penalty_rows])
        return logits

    def _penalised(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> torch.Tensor:
        rows, vocab = logits.shape
        dev = logits.device
        # Ragged id lists are padded with an extra column ``vocab`` that is
        # dropped after the scatter.
        out_len = max((len(row.output_token_ids) for row in seqs), default=0)
        out_ids = torch.full((rows, out_len), vocab, dtype=torch.long)
        for r, row in enumerate(seqs):
            out_ids[r, : len(row.output_token_ids)] = torch.tensor(row.output_token_ids, dtype=torch.long)
        out_ids = out_ids.to(dev)
        counts = torch.zeros(rows, vocab + 1, dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
        prompt_mask = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
        prompts = [(r, self._prompt_tensor(row)) for r, row in enumerate(seqs) if row.params.repetition_penalty != 1.0]
        if prompts:
            # One scatter for the whole batch; prompt tensors are cached.
            lengths = _long([len(t) for _, t in prompts], dev)
            prompt_rows = _long([r for r, _ in prompts], dev).repeat_interleave(lengths)
            prompt_mask[prompt_rows, torch.cat([t for _, t in prompts])] = True

        def per_row(name: str) -> torch.Tensor:
            return torch.tensor([getattr(row.params, name) for row in seqs], dtype=logits.dtype, device=dev)

        return apply_penalties(
            logits,
            prompt_mask,
            counts[:, :vocab],
            per_row("presence_penalty"),
            per_row("frequency_penalty"),
            per_row("repetition_penalty"),
        )

    def verify(self, logits: torch.Tensor, row: SamplingRow, draft: Sequence[int]) -> list[int]:
        """The tokens a speculating row emits (engine/sampling/speculative.py):
        ``logits`` [len(draft) + 1, V] are its rows at the last known token
        and at each proposed one. The row may speculate (``may_speculate``),
        so stages 1-3 are the same at every position."""
        logits = logits[:, : self.vocab_size].to(device=self.device, dtype=torch.float32)
        rows = [row] * logits.shape[0]
        logits = self._bias_mask_penalise(logits, rows, [row.params] * len(rows))
        if row.params.temperature < _GREEDY_EPS:
            return verify_greedy(logits, draft)
        generator = self._generator(row) if row.params.seed is not None else None
        return verify_sampled(self._probs(logits, rows), draft, generator)

    def _sample_random(self, logits: torch.Tensor, seqs: list[SamplingRow], rows: list[int]) -> torch.Tensor:
        if len(rows) != logits.shape[0]:
            logits = logits[rows]
        probs = self._probs(logits, seqs)
        params = [row.params for row in seqs]
        seeded = [r for r, p in enumerate(params) if p.seed is not None]
        if len(seeded) == len(params):
            tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        else:
            tokens = _exponential_race(probs)
        # Each seeded row draws its noise alone from its own generator, so
        # what it gets does not depend on the rest of the batch.
        for r in seeded:
            tokens[r] = _exponential_race(probs[r], self._generator(seqs[r]))
        return tokens

    def _probs(self, logits: torch.Tensor, seqs: Sequence[SamplingRow]) -> torch.Tensor:
        """Stage 5 without the draw: each row's distribution after
        temperature, top-k, top-p and min-p."""
        params = [row.params for row in seqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temperature.unsqueeze(-1)
        top_k = top_p = min_p = None
        if any(0 < p.top_k < logits.shape[1] for p in params):
            top_k = _long([p.top_k for p in params], logits.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
        if top_k is not None or top_p is not None or min_p is not None:
            logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        return logits.softmax(dim=-1)

    def _fill_logprobs(
        self,
        out: list[TokenLogprobs | None],
        raw: torch.Tensor,
        rows: list[int],
        token_ids: list[int],
        params: list[SamplingParams],
    ) -> None:
        chosen = _long([token_ids[i] for i in rows], raw.device).unsqueeze(-1)
        chosen_lp = raw.gather(-1, chosen).squeeze(-1).tolist()
        k = min(max(params[i].logprobs for i in rows), raw.shape[-1])
        top_lp, top_ids = raw.topk(k, dim=-1)
        top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
        for j, i in enumerate(rows):
            n = params[i].logprobs
            top = tuple(zip(top_ids[j][:n], top_lp[j][:n]))
            out[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen_lp[j], top=top)
