"""Same request, same answer (issue 39): a request's tokens and logprobs do
not depend on its schedule.

A differential test: each request is run alone in a fresh engine (cold
cache, whole prompt in one step, nothing beside it), then hypothesis builds
schedules around it (batch mates arriving at other steps, chunked prefill
at other chunk sizes, a prefix cache warmed by other requests or cold, a KV
pool small enough to preempt and recompute, n-gram speculation on or off)
and every request must give exactly its lone run's token ids and logprobs,
greedy or seeded. On the default model's compressed path, the one
``trioserve serve`` runs, and on its float32 path; marked ``cpu_paths`` so
.ci/run repeats it with the CPU held to AVX2 (the ``avx2int8`` kernels).
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.loading.loader import LoadedModel, load_model
from trioserve.engine.sampling.sampling_params import SamplingParams

from conftest import make_core

pytestmark = [pytest.mark.slow, pytest.mark.cpu_paths]

_FILLER = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "
# Chat prompts share the template's system prefix (a prefix-cache hit for
# every later one); the long one spans several blocks and chunks, and the
# repeated phrases give n-gram speculation proposals to verify.
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colours: red, green, blue, red, green, blue, red, green,",
    "Summarise: " + _FILLER * 8,
    "Count: one two three one two three one two three one two",
)
# Sequences asking for logprobs do not speculate (engine/sampling/speculative.py):
# the last two ask for none, so speculation runs for them.
PARAMS = (
    SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
    SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12, logprobs=2),
    SamplingParams(temperature=1.0, seed=123, max_tokens=10, logprobs=0),
    SamplingParams(temperature=0.0, max_tokens=16),
    SamplingParams(temperature=0.9, seed=11, max_tokens=16),
)
Result = tuple[tuple[int, ...], tuple[object, ...]]


@pytest.fixture(scope="module", params=["auto", "none"])
def compressed(request) -> LoadedModel:
    """The default model as ``trioserve serve`` loads it (compressed, native
    kernels), then dequantized to float32 (oneDNN's packed GEMM)."""
    loaded = load_model(None, quantization=request.param)
    invariance = loaded.model.invariance()
    assert invariance.invariant, invariance
    assert loaded.projection_choice.invariance == invariance
    return loaded


@pytest.fixture(scope="module")
def alone(compressed):
    """Each (prompt, params) run alone in a fresh engine, computed once."""
    results: dict[tuple[int, int], Result] = {}

    def get(prompt: int, params: int) -> Result:
        if (prompt, params) not in results:
            core = make_core(compressed, enable_prefix_caching=False)
            results[(prompt, params)] = _run(core, [(0, "alone", prompt, params)])["alone"]
        return results[(prompt, params)]

    return get


def _run(core: EngineCore, arrivals: list[tuple[int, str, int, int]], most: list[int] | None = None) -> dict[str, Result]:
    """Add each request at its step (``(step, id, prompt, params)``) and run
    the engine until all have finished; each request's tokens and logprobs.
    ``most`` gets the most tokens one output carried (above 1: a
    speculative step kept proposed tokens)."""
    pending = sorted(arrivals)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[object]] = {}
    step = 0
    while pending or core.has_unfinished():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            core.add_request(request_id, [{"role": "user", "content": PROMPTS[prompt]}], PARAMS[params])
            tokens[request_id], logprobs[request_id] = [], []
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            logprobs[output.request_id] += output.logprobs
            if most is not None:
                most.append(len(output.new_token_ids))
        step += 1
    return {r: (tuple(tokens[r]), tuple(logprobs[r])) for r in tokens}


schedules = st.fixed_dictionaries(
    {
        "requests": st.lists(
            st.tuples(st.integers(0, 6), st.integers(0, len(PROMPTS) - 1), st.integers(0, len(PARAMS) - 1)),
            min_size=1,
            max_size=4,
        ),
        "chunk": st.sampled_from([7, 16, 33, 2048]),
        "warm": st.lists(st.integers(0, len(PROMPTS) - 1), max_size=2),
        # 6 MiB of float16 KV holds some 270 tokens of the default model:
        # a few of these requests at once preempt each other.
        "kv_cache_memory": st.sampled_from([6 << 20, 64 << 20]),
        "speculative": st.booleans(),
    }
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules)
def test_a_requests_tokens_and_logprobs_do_not_depend_on_its_schedule(compressed, alone, schedule):
    speculative = {"speculative": "ngram", "num_speculative_tokens": 3} if schedule["speculative"] else {}
    core = make_core(
        compressed,
        kv_cache_memory=schedule["kv_cache_memory"],
        max_num_batched_tokens=schedule["chunk"],
        **speculative,
    )
    if schedule["warm"]:
        _run(core, [(0, f"warm{i}", prompt, 0) for i, prompt in enumerate(schedule["warm"])])
    arrivals = [(step, f"r{i}", prompt, params) for i, (step, prompt, params) in enumerate(schedule["requests"])]
    got = _run(core, arrivals)
    for _, request_id, prompt, params in arrivals:
        assert got[request_id] == alone(prompt, params), (request_id, PROMPTS[prompt], PARAMS[params])


def test_preemption_and_a_warm_cache_leave_every_token_as_it_was(compressed, alone):
    """The schedule the property may or may not draw, made sure of: a pool
    too small for four requests at once preempts (and recomputes) some of
    them, after a warm-up that leaves their prompts in the prefix cache."""
    core = make_core(compressed, kv_cache_memory=6 << 20, max_num_batched_tokens=33)
    _run(core, [(0, "warm", 3, 0), (0, "warm2", 0, 0)])
    arrivals = [(0, "a", 3, 0), (0, "b", 0, 1), (1, "c", 4, 3), (2, "d", 3, 4)]
    got = _run(core, arrivals)
    assert core.scheduler.statistics().num_preemptions > 0
    for _, request_id, prompt, params in arrivals:
        assert got[request_id] == alone(prompt, params), request_id


def test_speculation_on_or_off_gives_the_same_tokens_greedy_and_seeded(compressed, alone):
    """Verification runs the fused step as decode steps do, and a seeded
    draw under n-gram speculation takes the noise a one-token step would
    (engine/sampling/speculative.py verify_sampled), so the tokens match."""
    core = make_core(compressed, speculative="ngram", num_speculative_tokens=4)
    requests = [(0, "a", 2, 4), (0, "b", 4, 4), (0, "c", 4, 3), (1, "d", 2, 3)]
    most: list[int] = []
    got = _run(core, requests, most)
    assert max(most) > 1  # proposals were kept: speculation ran
    for _, request_id, prompt, params in requests:
        assert got[request_id] == alone(prompt, params), request_id


def test_fast_mode_says_it_is_not_invariant():
    """--no-batch-invariant runs prompts on other arithmetic, and says so."""
    compressed = load_model(None, quantization="auto")
    fast = load_model(None, quantization="auto", batch_invariant=False)
    assert not fast.model.invariance().invariant
    assert "--no-batch-invariant" in fast.model.invariance().reason
    assert attrs.evolve(fast.projection_choice, invariance=None).quantization == compressed.projection_choice.quantization


def test_tensor_parallel_shards_say_they_are_not_checked():
    from trioserve.engine.parallel.tensor_parallel import TPLlamaForCausalLM, TPShard
    from trioserve.testing.tiny_model import tiny_model_config

    shard = TPLlamaForCausalLM(TPShard(tiny_model_config(), 0, 2))
    assert not shard.invariance().invariant and "tensor parallelism over 2 ranks" in shard.invariance().reason
