"""Structured output on the tiny random model (the default model's
tokenizer): grammars compile, cache and fail naming the field; the mask
reaches only constrained rows; a random model's output always matches its
choice or regex; a dead end ends the request with an error."""

from __future__ import annotations

import json
import pickle
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_core
from trioserve.engine.errors import InvalidRequestError
from trioserve.engine.sampling.grammar import GrammarCompiler, GrammarError, GrammarMatchers, MaskRequest, unpack_bitmask
from trioserve.engine.sampling.sampler import Sampler
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.runtime.step_plan import StepPlan
from trioserve.engine.sampling.rows import SamplingRow, TokenMask
from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.testing.tiny_model import VOCAB_SIZE, tiny_loaded, tokenizer


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(tokenizer(), VOCAB_SIZE, (2,))


@pytest.mark.parametrize(
    ("constraint", "field", "says"),
    [
        (StructuredOutput.regex("(ab", field="structured_outputs.regex"), "structured_outputs.regex", "parenthesis"),
        (StructuredOutput.grammar("root ::= (", field="structured_outputs.grammar"), "structured_outputs.grammar", "EBNF"),
        (StructuredOutput.json_schema({"type": "nonsense"}, field="response_format.json_schema.schema"),
         "response_format.json_schema.schema", "nonsense"),
        (StructuredOutput.json_schema({"type": "string", "minLength": 5, "maxLength": 2}), "structured_output.json", "minLength"),
    ],
)
def test_unusable_constraints_name_their_field(compiler, constraint, field, says):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(constraint)
    assert info.value.field == field
    assert says in str(info.value) and ".cc:" not in str(info.value)


def test_constraint_shapes_are_checked():
    with pytest.raises(InvalidRequestError, match="non-empty list") as info:
        StructuredOutput.choice([], field="structured_outputs.choice")
    assert info.value.field == "structured_outputs.choice"
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput.json_schema("{nope")
    with pytest.raises(InvalidRequestError, match="non-empty string"):
        StructuredOutput.regex("")
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(ignore_eos=True, structured_output=StructuredOutput.json_object())
    assert info.value.field == "ignore_eos"


def test_compiled_grammars_are_cached_by_kind_and_spec(compiler):
    first = compiler.compile(StructuredOutput.json_schema({"type": "integer"}))
    again = compiler.compile(StructuredOutput.json_schema('{"type": "integer"}', field="elsewhere"))
    assert again is first
    assert compiler.cached(StructuredOutput.regex("[0-9]+")) is None
    assert compiler.compile(StructuredOutput.regex("[0-9]+")) is not first


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=3, max_size=3), st.integers(65, 96))
def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j(words, vocab):
    bitmask = torch.tensor([words], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, vocab)[0].tolist()
    expected = [bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)]
    assert allowed == expected


@settings(max_examples=25, deadline=None)
@given(st.sets(st.integers(0, VOCAB_SIZE - 1), max_size=6))
def test_fill_bans_exactly_the_banned_tokens_beside_the_grammar(compiler, banned):
    import xgrammar

    constraint = StructuredOutput.json_object()
    matchers = GrammarMatchers(compiler)
    matchers.add("a", constraint)
    matchers.add("b", constraint)
    banned = banned | {31, 63}  # bit 31 is int32's sign bit
    filled = matchers.fill([MaskRequest("a"), MaskRequest("b", tuple(sorted(banned)))])
    mask, dead = filled.mask, filled.dead
    # The grammar's own mask, through xgrammar's own allocation.
    reference = xgrammar.allocate_token_bitmask(1, VOCAB_SIZE)
    xgrammar.GrammarMatcher(compiler.compile(constraint)).fill_next_token_bitmask(reference, 0)
    grammar = unpack_bitmask(reference, VOCAB_SIZE)[0]
    allowed = unpack_bitmask(mask.bitmask, VOCAB_SIZE)
    assert dead == () and mask.request_ids == ("a", "b")
    assert torch.equal(allowed[0], grammar)
    expected = grammar.clone()
    expected[sorted(banned)] = False
    assert torch.equal(allowed[1], expected)


def _row(request_id, **params):
    return SamplingRow(request_id=request_id, params=SamplingParams(**params), eos_token_ids=(2,), num_output_tokens=0)


def test_sampler_masks_only_the_listed_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, 64)
    rows = [_row("free", temperature=0), _row("held", temperature=0), _row("drawn", temperature=1.0, seed=3)]
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 5) | (1 << 7)
    mask = TokenMask(("held",), bitmask)
    sampler = Sampler(64)
    masked = sampler.sample(logits, rows, mask).token_ids
    assert masked[1] in (5, 7)
    assert masked[1] == (5 if logits[1, 5] > logits[1, 7] else 7)
    unmasked = Sampler(64).sample(logits, rows).token_ids
    assert masked[0] == unmasked[0] and masked[2] == unmasked[2]


def test_a_plan_with_a_mask_pickles():
    bitmask = torch.tensor([[1, -1]], dtype=torch.int32)
    plan = StepPlan(chunks=(), token_mask=TokenMask(("a",), bitmask))
    copy = pickle.loads(pickle.dumps(plan))
    assert copy.token_mask.request_ids == ("a",) and torch.equal(copy.token_mask.bitmask, bitmask)


def _run(core, requests):
    """Add ``requests`` (id -> params) together and step to the end; texts,
    token ids and finish reasons by id."""
    for request_id, params in requests.items():
        core.add_request(request_id, "Answer:", params)
    texts = {rid: "" for rid in requests}
    tokens = {rid: [] for rid in requests}
    reasons = {}
    while core.has_unfinished():
        for out in core.step():
            texts[out.request_id] += out.text_delta
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    return texts, tokens, reasons


@pytest.fixture(scope="module")
def core():
    return make_core(tiny_loaded(), max_num_seqs=32)


def test_random_model_output_always_matches_choice_and_regex(core):
    choices = ["red", "green", "blue sky", 'say "hi"']
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    requests = {}
    for seed in range(6):
        requests[f"c{seed}"] = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=12, structured_output=StructuredOutput.choice(choices)
        )
        requests[f"r{seed}"] = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=16, structured_output=StructuredOutput.regex(pattern)
        )
    requests["j"] = SamplingParams(temperature=0, max_tokens=6, structured_output=StructuredOutput.json_schema({"enum": [1, 22]}))
    texts, _, reasons = _run(core, requests)
    for request_id, text in texts.items():
        assert reasons[request_id] is FinishReason.STOP, (request_id, text)
        if request_id.startswith("c"):
            assert text in choices
        elif request_id.startswith("r"):
            assert re.fullmatch(pattern, text), text
        else:
            assert json.loads(text) in (1, 22)
    assert len(core.grammars) == 0  # every matcher dropped with its request


def test_free_rows_get_the_same_tokens_beside_constrained_ones(core):
    free = {f"f{i}": SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=6) for i in range(8)}
    _, alone, _ = _run(core, free)
    constrained = {
        f"s{i}": SamplingParams(temperature=1.0, seed=i, max_tokens=6, structured_output=StructuredOutput.regex("[a-c]+"))
        for i in range(8)
    }
    _, mixed, _ = _run(core, {**free, **constrained})
    assert {rid: mixed[rid] for rid in free} == alone


def test_a_grammar_with_no_allowed_token_ends_its_request_with_an_error(core):
    # After "yes" the grammar allows only EOS, which min_tokens still bans.
    dead = SamplingParams(temperature=0, max_tokens=8, min_tokens=5, structured_output=StructuredOutput.choice(["yes"]))
    texts, _, reasons = _run(core, {"dead": dead, "other": SamplingParams(temperature=0, max_tokens=4)})
    assert reasons == {"dead": FinishReason.ERROR, "other": FinishReason.LENGTH}
    assert texts["dead"] == "yes"
    failures = core.take_failures()
    assert list(failures) == ["dead"] and isinstance(failures["dead"], GrammarError)
    assert "allows no token" in str(failures["dead"])


def test_validate_refuses_an_unusable_schema_before_admitting(core):
    params = SamplingParams(structured_output=StructuredOutput.regex("[", field="structured_outputs.regex"))
    with pytest.raises(InvalidRequestError) as info:
        core.add_request("bad", "x", params)
    assert info.value.field == "structured_outputs.regex"
    assert not core.has_unfinished()


def test_bitmask_is_int32_and_sized_to_the_vocabulary(core):
    core.add_request("m", "x", SamplingParams(max_tokens=2, structured_output=StructuredOutput.choice(["a", "b"])))
    plan = core.schedule()
    mask = plan.plan.token_mask
    assert mask.request_ids == ("m",)
    assert mask.bitmask.dtype == torch.int32 and mask.bitmask.shape == (1, (VOCAB_SIZE + 31) // 32)
    allowed = np.flatnonzero(unpack_bitmask(mask.bitmask, VOCAB_SIZE)[0].numpy())
    assert {tokenizer().decode([t]) for t in allowed} <= {"a", "b"}
    core.process_output(plan, core.execute(plan))
    while core.has_unfinished():
        core.step()


async def test_the_actors_constrain_and_report_a_dead_grammar_as_a_failure():
    from trioserve.actors.engine import open_engine
    from trioserve.actors.errors import RequestFailed
    from trioserve.testing.tiny_model import engine_config

    choice = StructuredOutput.choice(["alpha", "beta"])
    async with open_engine(engine_config(num_blocks=64), loaded=tiny_loaded()) as engine:

        async def text(params):
            return "".join([out.text_delta async for out in engine.generate("x", params)])

        dead = SamplingParams(temperature=0, max_tokens=8, min_tokens=6, structured_output=choice)
        with pytest.raises(RequestFailed) as info:
            await text(dead)
        assert info.value.code == "structured_output_failed"
        assert "allows no token" in info.value.public_message
        assert await text(SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_output=choice)) in ("alpha", "beta")
        assert len(engine.core.grammars) == 0


async def test_replicas_share_one_grammar_cache_and_constrain_on_either():
    import trio

    from trioserve.actors.engine import open_engine
    from trioserve.testing.tiny_model import engine_config

    choices = ["alpha", "beta", "gamma"]
    async with open_engine(engine_config(num_blocks=64, data_parallel_size=2), loaded=tiny_loaded()) as engine:
        compilers = {id(replica.core.grammars.compiler) for replica in engine.replicas}
        assert len(compilers) == 1  # compiled once by prepare, found by whichever replica gets the request

        async def text(seed: int) -> str:
            params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, structured_output=StructuredOutput.choice(choices))
            return "".join([out.text_delta async for out in engine.generate(f"prompt {seed}", params)])

        results: list[str] = []

        async def run(seed: int) -> None:
            results.append(await text(seed))

        async with trio.open_nursery() as nursery:  # at once, so the load spreads them over both
            for seed in range(6):
                nursery.start_soon(run, seed)
        assert len(results) == 6 and set(results) <= set(choices)
        assert all(replica.executor.statistics().num_steps > 0 for replica in engine.replicas)


def test_a_constraint_waits_for_its_starts_after_sequence(compiler):
    # A reasoning model's answer: free until the output ends with (7, 9),
    # then the grammar's. A false start (7 then not 9) does not open it.
    matchers = GrammarMatchers(compiler)
    answer = StructuredOutput.choice(["yes"])
    matchers.add("r", answer.after((7, 9)))
    rows = [MaskRequest("r", banned=(3,))]
    everything = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    everything[3] = False
    for token in (5, 7, 7, 4, 7):
        assert not matchers.started("r")
        assert torch.equal(unpack_bitmask(matchers.fill(rows).mask.bitmask, VOCAB_SIZE)[0], everything)
        assert matchers.accept("r", token)
    assert matchers.accept("r", 9) and matchers.started("r")
    matchers.add("plain", answer)
    grammar = unpack_bitmask(matchers.fill([MaskRequest("plain")]).mask.bitmask, VOCAB_SIZE)[0]
    assert torch.equal(unpack_bitmask(matchers.fill([MaskRequest("r")]).mask.bitmask, VOCAB_SIZE)[0], grammar)
    assert not grammar.all()
    matchers.remove("r")
    assert "r" not in matchers and len(matchers) == 1


def test_starts_after_is_checked_and_not_part_of_the_grammars_key(compiler):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput.json_object(field="response_format").after([1, -2])
    assert info.value.field == "response_format"
    plain = StructuredOutput.regex("[0-9]+")
    gated = plain.after([4, 5])
    assert gated.starts_after == (4, 5) and gated.key == plain.key and gated != plain
    assert compiler.compile(gated) is compiler.compile(plain)


def test_a_structural_tag_compiles_and_names_its_field_when_it_cannot(compiler):
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "<call>"}, {"type": "json_schema", "json_schema": {"enum": [1, 2]}}]}}  # fmt: skip
    compiled = compiler.compile(StructuredOutput.structural_tag(tag))
    matcher = __import__("xgrammar").GrammarMatcher(compiled)
    assert matcher.accept_string("<call>2") and not matcher.accept_string("3")
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(StructuredOutput.structural_tag({"type": "structural_tag", "format": {"type": "nope"}}, field="tools"))
    assert info.value.field == "tools" and "structural tag" in str(info.value)


def test_the_core_samples_freely_until_the_marker_then_by_the_grammar(core):
    # The marker is whatever the free model writes as its 3rd and 4th
    # tokens; from there on the output is the choice.
    _, free, _ = _run(core, {"free": SamplingParams(temperature=0, max_tokens=4)})
    marker = tuple(free["free"][2:4])
    gated = StructuredOutput.choice(["yes", "no"]).after(marker)
    texts, tokens, reasons = _run(core, {"gated": SamplingParams(temperature=0, max_tokens=12, structured_output=gated)})
    assert tokens["gated"][:4] == free["free"]  # the constraint did not touch them
    assert reasons["gated"] is FinishReason.STOP
    answer = core.output_processor.tokenizer.decode(tokens["gated"][4:-1] if tokens["gated"][-1] == 2 else tokens["gated"][4:])
    assert answer in ("yes", "no"), texts["gated"]
    assert len(core.grammars) == 0
