"""The batched sampler: truncation sets, penalties, seeds, masks, logprobs."""

import itertools
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import assume, given, settings

from trioserve.engine.sampling import sampler as sampler_module
from trioserve.engine.sampling.argmax import argmax
from trioserve.engine.sampling.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p_min_p,
)
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.rows import SamplingRow

# Probabilities chosen so that no cumulative sum lands on a tested top_p.
PROBS = [0.05, 0.4, 0.1, 0.3, 0.15]
EOS = 0


_ids = itertools.count()


def make_state(output=(), prompt=(1, 2), eos=(EOS,), request_id=None, **params):
    """A sampling row; each gets its own sequence id unless ``request_id``
    names one (the sampler keeps a seeded sequence's generator by id)."""
    return SamplingRow.for_sequence(
        f"seq{next(_ids)}" if request_id is None else request_id,
        SamplingParams(**params),
        tuple(prompt),
        tuple(output),
        eos,
    )


def kept(logits_row):
    return {i for i, x in enumerate(logits_row.tolist()) if x != -math.inf}


def truncate_one(probs, top_k=None, top_p=None, min_p=None):
    logits = torch.tensor([probs]).log()

    def arg(value, dtype):
        return None if value is None else torch.tensor([value], dtype=dtype)

    out = apply_top_k_top_p_min_p(logits, arg(top_k, torch.long), arg(top_p, torch.float32), arg(min_p, torch.float32))
    return kept(out[0])


# --- truncation sets, computed by hand ---------------------------------------


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, {1}), (2, {1, 3}), (3, {1, 3, 4}), (4, {1, 2, 3, 4}), (0, {0, 1, 2, 3, 4}), (-1, {0, 1, 2, 3, 4}), (9, {0, 1, 2, 3, 4})],
)
def test_top_k_keeps_the_k_largest(k, expected):
    assert truncate_one(PROBS, top_k=k) == expected


def test_top_k_keeps_ties_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5, 2.0, -1.0]])
    out = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([2]))
    assert kept(out[0]) == {0, 2, 4}


@pytest.mark.parametrize(
    ("p", "expected"),
    # mass ranked above each token: 0.4 -> 0, 0.3 -> 0.4, 0.15 -> 0.7, 0.1 -> 0.85, 0.05 -> 0.95
    [(0.3, {1}), (0.4, {1}), (0.5, {1, 3}), (0.75, {1, 3, 4}), (0.9, {1, 2, 3, 4}), (0.97, {0, 1, 2, 3, 4}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert truncate_one(PROBS, top_p=p) == expected


@pytest.mark.parametrize(
    ("min_p", "expected"),
    # thresholds: 0.4 * min_p
    [(0.0, {0, 1, 2, 3, 4}), (0.1, {0, 1, 2, 3, 4}), (0.2, {1, 2, 3, 4}), (0.3, {1, 3, 4}), (0.5, {1, 3}), (0.9, {1}), (1.0, {1})],
)
def test_min_p_keeps_tokens_above_a_fraction_of_the_best(min_p, expected):
    assert truncate_one(PROBS, min_p=min_p) == expected


def test_top_p_applies_to_what_top_k_left():
    # Without top_k the mass above 0.15 is 0.7 < 0.72; after top_k=4 drops
    # 0.05 it is 0.7 / 0.95 = 0.737 >= 0.72.
    assert truncate_one(PROBS, top_p=0.72) == {1, 3, 4}
    assert truncate_one(PROBS, top_k=4, top_p=0.72) == {1, 3}
    assert truncate_one(PROBS, top_k=4, top_p=0.9, min_p=0.3) == {1, 3, 4}


def test_each_row_gets_its_own_truncation():
    logits = torch.tensor([PROBS] * 4).log()
    out = apply_top_k_top_p_min_p(
        logits,
        top_k=torch.tensor([0, 2, 0, 4]),
        top_p=torch.tensor([1.0, 1.0, 0.5, 0.9]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.3]),
    )
    assert [kept(row) for row in out] == [{0, 1, 2, 3, 4}, {1, 3}, {1, 3}, {1, 3, 4}]


def reference_kept(logits, k, p, min_p):
    # The definitions in apply_top_k_top_p_min_p's docstring, in float64.
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if 0 < k < len(logits):
        kth = logits[order[k - 1]]
        order = [i for i in order if logits[i] >= kth]
    z = sum(math.exp(logits[i]) for i in order)
    probs = {i: math.exp(logits[i]) / z for i in order}
    above = 0.0
    margins = []
    kept_p = []
    for i in order:
        margins.append(abs(above - p))
        if p >= 1.0 or above < p:
            kept_p.append(i)
        above += probs[i]
    best = max(probs[i] for i in kept_p)
    margins += [abs(probs[i] - min_p * best) for i in kept_p]
    result = {i for i in kept_p if probs[i] >= min_p * best}
    return result, min(margins)


@settings(max_examples=150, deadline=None)
@given(
    ints=st.lists(st.integers(-30, 30), min_size=2, max_size=12, unique=True),
    k=st.integers(-1, 14),
    p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_truncation_matches_a_reference(ints, k, p, min_p):
    logits = [x / 4 for x in ints]
    expected, margin = reference_kept(logits, k, p, min_p)
    assume(margin > 1e-4)  # float32 cannot decide sets on a knife edge
    out = apply_top_k_top_p_min_p(
        torch.tensor([logits]), torch.tensor([k]), torch.tensor([p], dtype=torch.float32), torch.tensor([min_p])
    )
    assert kept(out[0]) == expected


# A few values, so that rows hold ties, with -inf and NaN among them.
_CELLS = st.sampled_from([-2.0, -1.0, 0.0, 0.5, 3.0, float("-inf"), float("inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 70),
    data=st.data(),
)
def test_the_fast_argmax_gives_what_argmax_gives_ties_and_nans_included(rows, width, data):
    # Greedy tokens, speculative verification and the exponential race use
    # engine/sampling/argmax.py's torch.max indices for their speed; they must be
    # argmax's own (a row's first largest value, NaN the largest) on the
    # torch this runs, or greedy output would change with it.
    cells = data.draw(st.lists(_CELLS, min_size=rows * width, max_size=rows * width))
    x = torch.tensor(cells, dtype=torch.float32).view(rows, width)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x[0], dim=0), x[0].argmax())
    wide = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(width)).mul_(4).round_()  # many ties
    assert torch.equal(argmax(wide), wide.argmax(dim=-1))


# --- penalties -----------------------------------------------------------------

PEN_LOGITS = [2.0, -1.0, 0.5, 3.0, -0.5, 1.2]
PEN_PROMPT = [0, 1]
PEN_OUTPUT = [3, 3, 4]
# repetition 2, presence 0.5, frequency 0.25, by hand:
#   0: prompt, positive: 2 / 2 = 1.0       1: prompt, negative: -1 * 2 = -2.0
#   2: unseen: 0.5                         3: 3 / 2 - 2 * 0.25 - 0.5 = 0.5
#   4: -0.5 * 2 - 1 * 0.25 - 0.5 = -1.75   5: unseen: 1.2
PEN_EXPECTED = [1.0, -2.0, 0.5, 0.5, -1.75, 1.2]


def test_penalties_match_hand_computation():
    prompt_mask = torch.tensor([[True, True, False, False, False, False]])
    counts = torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.0, 0.0]])
    out = apply_penalties(
        torch.tensor([PEN_LOGITS]), prompt_mask, counts, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    )
    assert out[0].tolist() == pytest.approx(PEN_EXPECTED)


def test_sampler_applies_penalties_per_row():
    logits = torch.tensor([PEN_LOGITS] * 3)
    states = [
        make_state(output=list(PEN_OUTPUT), prompt=PEN_PROMPT, temperature=0.0),
        make_state(
            output=list(PEN_OUTPUT),
            prompt=PEN_PROMPT,
            eos=(),
            temperature=0.0,
            repetition_penalty=2.0,
            presence_penalty=0.5,
            frequency_penalty=0.25,
        ),
        make_state(output=list(PEN_OUTPUT), prompt=PEN_PROMPT, temperature=0.0, repetition_penalty=1.1),
    ]
    # Unpenalised, token 3 wins; penalised by hand, token 5 does.
    assert Sampler(6).sample(logits, states).token_ids == [3, 5, 3]


def test_penalised_distribution_matches_reference():
    # With temperature 1, token frequencies follow softmax(PEN_EXPECTED).
    n = 20000
    torch.manual_seed(1)
    state = dict(prompt=PEN_PROMPT, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    states = [make_state(output=list(PEN_OUTPUT), **state) for _ in range(n)]
    tokens = Sampler(6).sample(torch.tensor([PEN_LOGITS] * n), states).token_ids
    expected = torch.tensor(PEN_EXPECTED).softmax(-1).tolist()
    freq = [tokens.count(t) / n for t in range(6)]
    assert freq == pytest.approx(expected, abs=0.015)


# --- greedy, bias, min_tokens, logprobs -----------------------------------------


def test_greedy_takes_the_argmax_for_a_large_batch():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    before = logits.clone()
    out = Sampler(1000).sample(logits, [make_state(temperature=0.0) for _ in range(64)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 64
    assert torch.equal(logits, before)


def test_padded_vocab_columns_are_never_sampled():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 50.0
    states = [make_state(temperature=0.0), make_state(temperature=1.0)]
    assert all(t < 10 for t in Sampler(10).sample(logits, states).token_ids)


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    best = logits[2].argmax().item()
    second = logits[2].topk(2).indices[1].item()
    states = [
        make_state(temperature=1.0, logit_bias={7: 100}),
        make_state(temperature=0.0, logit_bias={11: 100}),
        make_state(temperature=0.0, logit_bias={best: -100}),
    ]
    for _ in range(5):
        assert Sampler(50).sample(logits, states).token_ids == [7, 11, second]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0]])  # EOS (0) best, then stop token 2
    sampler = Sampler(4)
    state = make_state(output=[3, 3], temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sampler.sample(logits, [state]).token_ids == [3]
    state = make_state(output=[3, 3, 3], temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sampler.sample(logits, [state]).token_ids == [EOS]


def test_ignore_eos_leaves_eos_unmasked_but_still_masks_stop_tokens():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0]])
    state = make_state(temperature=0.0, min_tokens=5, stop_token_ids=[2], ignore_eos=True)
    assert Sampler(4).sample(logits, [state]).token_ids == [EOS]
    logits = torch.tensor([[1.0, 1.0, 8.0, 7.0]])
    assert Sampler(4).sample(logits, [state]).token_ids == [3]


def test_logprobs_are_those_of_the_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    states = [
        make_state(temperature=0.5, logprobs=3, repetition_penalty=1.5, logit_bias={4: 5}),
        make_state(temperature=0.0),
        make_state(temperature=0.0, logprobs=0),
    ]
    out = Sampler(40).sample(logits, states)
    raw = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item())
    top = raw[0].topk(3)
    assert [t for t, _ in first.top] == top.indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(top.values.tolist())
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third.top == ()
    assert third.logprob == pytest.approx(raw[2].max().item())


# --- randomness -------------------------------------------------------------------


def seeded_run(seed, position, neighbours, steps=8):
    # Run a seeded request for ``steps`` tokens at ``position`` among other
    # rows; its row of logits depends only on the step.
    vocab = 300
    sampler = Sampler(vocab)
    out = []
    for step in range(steps):
        target = make_state(
            output=out, request_id="target", seed=seed, temperature=0.9, top_p=0.95, presence_penalty=0.3
        )
        others = [make_state(output=range(step), request_id=f"n{i}", **kw) for i, kw in enumerate(neighbours)]
        row = torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))
        batch = torch.randn(len(others) + 1, vocab)  # neighbours differ on every run
        batch[position] = row
        states = others[:position] + [target] + others[position:]
        out.append(sampler.sample(batch, states).token_ids[position])
    return out


NEIGHBOURS = [
    [],
    [{"temperature": 0.0}],
    [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"seed": 7}, {"temperature": 0.0, "logprobs": 2}],
    [{"seed": 42}, {"temperature": 1.3, "min_p": 0.1, "repetition_penalty": 1.2}] * 3,
]


@pytest.mark.parametrize("neighbours", NEIGHBOURS)
def test_seeded_tokens_do_not_depend_on_the_batch(neighbours):
    torch.manual_seed(len(neighbours))  # the unseeded neighbours' draws vary too
    alone = seeded_run(42, 0, [])
    for position in {0, len(neighbours) // 2, len(neighbours)}:
        assert seeded_run(42, position, neighbours) == alone


def test_different_seeds_give_different_tokens():
    runs = {tuple(seeded_run(seed, 0, [], steps=6)) for seed in range(5)}
    assert len(runs) > 1


def test_temperature_sampling_follows_softmax():
    n = 40000
    logits_row = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    for temperature in (0.5, 1.0, 2.0):
        torch.manual_seed(0)
        states = [make_state(temperature=temperature) for _ in range(n)]
        tokens = Sampler(5).sample(logits_row.expand(n, 5), states).token_ids
        expected = (logits_row / temperature).softmax(-1).tolist()
        assert [tokens.count(t) / n for t in range(5)] == pytest.approx(expected, abs=0.01)


def test_seeded_sampling_follows_softmax_and_respects_truncation():
    n = 3000
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    state = make_state(seed=3, temperature=1.0, top_k=3)
    sampler = Sampler(5)
    tokens = [sampler.sample(logits, [state]).token_ids[0] for _ in range(n)]
    assert set(tokens) <= {0, 3, 4}
    expected = logits[0, [0, 3, 4]].softmax(-1).tolist()
    assert [tokens.count(t) / n for t in (0, 3, 4)] == pytest.approx(expected, abs=0.03)


def test_rejects_logits_of_the_wrong_shape():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler(10).sample(torch.zeros(2, 10), [make_state()])
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(10).sample(torch.zeros(1, 9), [make_state()])


def test_top_p_over_a_large_vocabulary_equals_a_full_sort():
    # Peaked rows find their nucleus among the top candidates; flat rows do
    # not and are sorted in full. Both must keep what a full sort keeps.
    generator = torch.Generator().manual_seed(0)
    vocab = 3 * sampler_module.TOP_P_CANDIDATES
    peaked = torch.randn(4, vocab, generator=generator) * 4.0
    flat = torch.randn(4, vocab, generator=generator) * 0.01
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0] * 2)
    out = apply_top_k_top_p_min_p(logits, top_p=top_p)
    expected = sampler_module._top_p_by_sort(logits, top_p)
    assert torch.equal(out.isinf(), expected.isinf())
    kept_counts = (~out.isinf()).sum(dim=-1)
    assert (kept_counts[:3] < sampler_module.TOP_P_CANDIDATES).all()  # peaked: candidates sufficed
    assert (kept_counts[4:7] > sampler_module.TOP_P_CANDIDATES).all()  # flat: the fallback ran
    assert (kept_counts[[3, 7]] == vocab).all()  # p = 1 keeps everything


def test_a_seeded_sequence_keeps_its_generator_until_forgotten():
    logits = torch.zeros(1, 50)  # uniform: every draw comes from the generator
    sampler = Sampler(50)
    row = make_state(request_id="s", seed=7, temperature=1.0)
    first = [sampler.sample(logits, [row]).token_ids[0] for _ in range(6)]
    assert sampler.num_sequences == 1
    sampler.forget(["s"])
    assert sampler.num_sequences == 0
    # A new sequence under the same id starts from its seed again.
    again = [sampler.sample(logits, [row]).token_ids[0] for _ in range(6)]
    assert again == first and len(set(first)) > 1
