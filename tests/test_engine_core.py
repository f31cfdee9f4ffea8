"""EngineCore end to end on the default model."""

from __future__ import annotations

import pytest
from conftest import make_core

from trioserve.engine.errors import InvalidRequestError, RequestTooLongError
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run_all(core) -> dict[tuple[str, int], dict]:
    """Step until done; collect text, tokens and finish reason per completion."""
    results: dict[tuple[str, int], dict] = {}
    while core.has_unfinished():
        for out in core.step():
            entry = results.setdefault((out.request_id, out.index), {"text": "", "tokens": [], "finish": None})
            entry["text"] += out.text_delta
            entry["tokens"].extend(out.new_token_ids)
            if out.finished:
                assert entry["finish"] is None, "a completion reported two final outputs"
                entry["finish"] = out.finish_reason
                entry["num_output_tokens"] = out.num_output_tokens
                entry["num_cached_tokens"] = out.num_cached_tokens
    return results


PROMPTS = [
    "The quick brown fox",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "Tell me about trio, the Python library for structured concurrency, in one paragraph.",
    "def fibonacci(n):",
    "Bonjour, je m'appelle",
    "The capital of Japan is",
    "Here is a list of fruits: apple, banana,",
]


def test_mixed_batch_matches_each_request_alone(default_loaded):
    """16 requests of mixed lengths, chunked prefill mixing with decodes,
    give the same greedy text as each run alone."""
    requests = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)] * (1 + i // 8)
        if i % 3 == 0:
            prompt = [{"role": "user", "content": prompt}]
        requests.append((f"r{i}", prompt, SamplingParams(max_tokens=8 + (i % 5) * 3, **GREEDY)))

    # A small token budget forces long prompts into several prefill chunks
    # that share steps with other requests' decodes.
    core = make_core(default_loaded, max_num_batched_tokens=48, max_num_seqs=16)
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    together = run_all(core)

    for rid, prompt, params in requests:
        alone_core = make_core(default_loaded)
        alone_core.add_request(rid, prompt, params)
        alone = run_all(alone_core)[(rid, 0)]
        assert together[(rid, 0)]["tokens"] == alone["tokens"], rid
        assert together[(rid, 0)]["text"] == alone["text"], rid
        assert together[(rid, 0)]["finish"] is FinishReason.LENGTH
        assert len(alone["tokens"]) == params.max_tokens


def test_greedy_continuation_equals_transformers_generate(default_loaded):
    """>= 64 greedy tokens for 4 chat-templated prompts, token for token as
    transformers' generate on the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from trioserve.engine.loading.sources import default_model_path
    from trioserve.engine.text.tokenizer import apply_chat_template

    gguf = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    reference.eval()
    tokenizer = default_loaded.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a short poem about autumn leaves.",
        "Explain what a hash table is.",
        "List three uses of copper.",
    ]
    core = make_core(default_loaded)
    prompts = {}
    for i, question in enumerate(questions):
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": question}])
        prompts[f"q{i}"] = ids
        # min_tokens masks EOS as transformers' min_new_tokens does, so both
        # continue past the natural end of the answer the same way.
        core.add_request(f"q{i}", ids, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64))
    ours = run_all(core)
    for rid, ids in prompts.items():
        with torch.inference_mode():
            generated = reference.generate(
                torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=2
            )
        expected = generated[0, len(ids) :].tolist()
        assert len(expected) == 64
        assert ours[(rid, 0)]["tokens"] == expected, rid


def test_abort_frees_every_block_before_the_next_step(default_loaded):
    core = make_core(default_loaded)
    free_before = core.block_manager.statistics().num_free_blocks
    core.add_request("long", "Count slowly to one thousand:", SamplingParams(max_tokens=200, **GREEDY))
    core.add_request("other", "Hello", SamplingParams(max_tokens=8, **GREEDY))
    for _ in range(3):
        core.step()
    assert core.block_manager.statistics().num_free_blocks < free_before
    assert core.abort("long")
    # The next plan's batch frees them before its allocations; 'other'
    # still holds its own blocks.
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.request_id == "long"] == [("long", FinishReason.ABORT)]
    holders = core.scheduler.block_holders()
    assert list(holders) == ["other"]
    assert core.block_manager.statistics().num_free_blocks == free_before - len(holders["other"])
    assert run_all(core)[("other", 0)]["finish"] is FinishReason.LENGTH
    assert core.block_manager.statistics().num_free_blocks == free_before
    core.block_manager.check_invariants({})


def test_stop_string_ends_generation_and_is_not_emitted(default_loaded):
    core = make_core(default_loaded)
    core.add_request("free", "1, 2, 3, 4,", SamplingParams(max_tokens=24, **GREEDY))
    unstopped = run_all(core)[("free", 0)]["text"]
    assert " 7" in unstopped, unstopped
    core.add_request("stopped", "1, 2, 3, 4,", SamplingParams(max_tokens=24, stop=[" 7"], **GREEDY))
    stopped = run_all(core)[("stopped", 0)]
    assert stopped["finish"] is FinishReason.STOP
    assert stopped["text"] == unstopped[: unstopped.index(" 7")]
    core.add_request("kept", "1, 2, 3, 4,", SamplingParams(max_tokens=24, stop=[" 7"], include_stop_str_in_output=True, **GREEDY))
    assert run_all(core)[("kept", 0)]["text"] == unstopped[: unstopped.index(" 7") + 2]
    # A stop string completed by the last token max_tokens allows is still a stop.
    core.add_request("free", "1, 2, 3, 4,", SamplingParams(max_tokens=24, **GREEDY))
    outputs = [out for _ in range(64) if core.has_unfinished() for out in core.step()]
    text, last = "", None
    for last, out in enumerate(outputs, start=1):
        text += out.text_delta
        if " 7" in text:
            break
    core.add_request("at-length", "1, 2, 3, 4,", SamplingParams(max_tokens=last, stop=[" 7"], **GREEDY))
    final = [out for _ in range(64) if core.has_unfinished() for out in core.step()][-1]
    assert (final.finish_reason, final.stop_reason) == (FinishReason.STOP, " 7")


def test_n_seeded_completions_share_the_prompt_and_reproduce(default_loaded):
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = "Tell me a story about a dragon who loved to bake bread. " * 4

    core = make_core(default_loaded)
    core.add_request("story", prompt, params)
    first = run_all(core)
    assert sorted(first) == [("story", 0), ("story", 1), ("story", 2)]
    texts = [first[("story", i)]["tokens"] for i in range(3)]
    assert len({tuple(t) for t in texts}) == 3, "seeded completions must differ from one another"
    # The prompt's full blocks were computed once: later completions hit the prefix cache.
    assert core.block_manager.statistics().prefix_cache_hits > 0

    again = make_core(default_loaded)
    again.add_request("story", prompt, params)
    second = run_all(again)
    assert [second[("story", i)]["tokens"] for i in range(3)] == texts


def test_bad_requests_are_refused_and_the_engine_keeps_serving(default_loaded):
    core = make_core(default_loaded, max_model_len=64)
    core.add_request("good", "Hello there", SamplingParams(max_tokens=6, **GREEDY))
    with pytest.raises(RequestTooLongError) as too_long:
        core.add_request("long", "word " * 200, SamplingParams(max_tokens=6))
    assert too_long.value.field == "prompt" and "64" in str(too_long.value)
    with pytest.raises(InvalidRequestError) as bad_bias:
        core.add_request("bias", "Hi", SamplingParams(logit_bias={10**9: 1.0}))
    assert bad_bias.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError) as dup:
        core.add_request("good", "Hi", SamplingParams())
    assert dup.value.field == "request_id"
    with pytest.raises(InvalidRequestError) as empty:
        core.add_request("empty", "", SamplingParams())
    assert empty.value.field == "prompt"
    # Text with a lone surrogate has no UTF-8 form: no tokenizer takes it.
    with pytest.raises(InvalidRequestError, match="lone UTF-16 surrogate at index 3") as surrogate:
        core.add_request("surrogate", "Hi \ud800", SamplingParams())
    assert surrogate.value.field == "prompt"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "\udfff"}]
    with pytest.raises(InvalidRequestError) as surrogate_chat:
        core.add_request("surrogate-chat", chat, SamplingParams())
    assert surrogate_chat.value.field == "messages[1].content"
    results = run_all(core)
    assert list(results) == [("good", 0)]
    assert len(results[("good", 0)]["tokens"]) == 6
