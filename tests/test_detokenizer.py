"""Streaming detokenization over the default model's tokenizer."""

import random

import hypothesis.strategies as st
import pytest
import transformers
from hypothesis import given, settings

from trioserve.engine.text.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from trioserve.engine.loading.sources import default_model_path

EMOJI = "Hi 😀👍🏽! Family: 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷 ✨🎉 ok"
CJK = "你好，世界！日本語のテキストと한국어 텍스트。東京タワー"
MIXED = "The café costs 5€ — naïve résumé;\n東京 in 2024 🚀\tdone. ½ ∑ x² → ∞"
TEXTS = [EMOJI, CJK, MIXED]
CHAT_PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def tokenizer():
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def groups(ids, rng):
    # Split ``ids`` into consecutive groups of 1 to 5 tokens.
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        yield ids[i : i + n]
        i += n


def stream(detok, chunks):
    deltas = [detok.add_tokens(chunk) for chunk in chunks]
    return deltas, detok.finish()


def expected_with_stop(text, stops, include):
    # The occurrence that ends first wins; of two ending together, the one
    # that starts first.
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return (text[:end] if include else text[:start]), stop


# --- plain streaming ------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_joins_to_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = stream(detok, [[t] for t in ids])
    assert all("\ufffd" not in d.text for d in deltas)
    assert all(d.stop_str is None for d in deltas)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids) == text
    assert detok.text == text
    # Characters split over tokens were held back, not emitted in halves.
    assert any(d.text == "" for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(4))
def test_random_groups_after_a_chat_prompt_join_to_decode(tokenizer, text, seed):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, CHAT_PROMPT))
    deltas, tail = stream(detok, groups(ids, random.Random(seed)))
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(ids)


def test_incomplete_character_at_the_end_is_flushed_by_finish(tokenizer):
    ids = encode(tokenizer, "end 😀")
    cut = ids[:-1]  # the emoji's last byte is missing
    assert tokenizer.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, tail = stream(detok, [[t] for t in cut])
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(cut)
    assert "\ufffd" in tail
    assert detok.finish() == ""


def test_prompt_ending_inside_a_character(tokenizer):
    ids = encode(tokenizer, "a 😀 b")
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, tail = stream(detok, [[t] for t in output])
    assert "".join(d.text for d in deltas) + tail == tokenizer.decode(output)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Hello 世界") + [im_end] + encode(tokenizer, " again")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    deltas, tail = stream(detok, [[t] for t in ids])
    joined = "".join(d.text for d in deltas) + tail
    assert joined == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in joined) is not skip


def test_decoding_cost_grows_linearly(tokenizer):
    # Each token decodes a short window, not the whole output again.
    class Counting:
        decoded = 0

        def decode(self, ids, skip_special_tokens):
            Counting.decoded += len(ids)
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = encode(tokenizer, (MIXED + EMOJI + CJK) * 12)
    detok = IncrementalDetokenizer(Counting(), encode(tokenizer, CHAT_PROMPT))
    for t in ids:
        detok.add_tokens([t])
    assert detok.text + detok.finish() == tokenizer.decode(ids)
    assert Counting.decoded < 12 * len(ids)


# --- stop strings ------------------------------------------------------------------

STOP_TEXT = "The answer is 世界 and then 😀 more text after the stop."


def assert_spans_tokens(tokenizer, ids, stop):
    # The test is only meaningful if no single token holds the whole stop.
    assert all(stop not in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["is 世界", "界 and", "n 😀 m", "after the"])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_stop_string_across_token_boundaries(tokenizer, include, stop, seed):
    ids = encode(tokenizer, STOP_TEXT)
    assert_spans_tokens(tokenizer, ids, stop)
    expected, _ = expected_with_stop(STOP_TEXT, [stop], include)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop, "never there"], include_stop_str_in_output=include)
    chunks = [[t] for t in ids] if seed is None else list(groups(ids, random.Random(seed)))
    emitted = ""
    for i, chunk in enumerate(chunks):
        delta = detok.add_tokens(chunk)
        emitted += delta.text
        # Nothing past the cut is ever emitted, and no more than
        # len(longest stop) - 1 characters are held back.
        assert expected.startswith(emitted)
        if delta.stop_str is not None:
            break
        complete = tokenizer.decode([t for c in chunks[: i + 1] for t in c]).rstrip("\ufffd")
        assert len(complete) - len(emitted) <= len("never there") - 1
    assert delta == DetokenizerDelta(delta.text, stop)
    assert emitted == expected == detok.text
    assert detok.stop_str == stop
    assert detok.finish() == ""
    with pytest.raises(RuntimeError):
        detok.add_tokens(ids[-1:])


def test_first_stop_to_end_wins_within_one_call(tokenizer):
    ids = encode(tokenizer, STOP_TEXT)
    stops = ["more text", "then 😀", "answer is 世界 and then 😀 more"]
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    delta = detok.add_tokens(ids)
    assert delta == DetokenizerDelta("The answer is 世界 and ", "then 😀")


def test_partial_stop_at_the_end_is_flushed(tokenizer):
    ids = encode(tokenizer, "Count to three: one two thr")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three!", "xyz"])
    deltas, tail = stream(detok, [[t] for t in ids])
    assert "".join(d.text for d in deltas) == "Count to three: one two "
    assert tail == "thr"
    assert detok.stop_str is None


def test_stop_made_of_special_token_text_is_found_when_not_skipped(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Done.") + [im_end] + encode(tokenizer, "junk")
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False, stop=["<|im_end|>"])
    deltas = []
    for t in ids:
        deltas.append(detok.add_tokens([t]))
        if t == im_end:
            break
    assert "".join(d.text for d in deltas) == "Done."
    assert deltas[-1].stop_str == "<|im_end|>"
    assert detok.finished


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(tokenizer, [], stop=["ok", ""])


ALPHABET = "ab ,.世界東京😀👍🏽é\n"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    data=st.data(),
    include=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_stops_match_a_reference(tokenizer, text, data, include, seed):
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start : start + data.draw(st.integers(1, 6))]
    other = data.draw(st.text(alphabet=ALPHABET, min_size=1, max_size=4))
    stops = [stop, other]
    ids = encode(tokenizer, text)
    expected, expected_stop = expected_with_stop(text, stops, include)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, CHAT_PROMPT), stop=stops, include_stop_str_in_output=include)
    emitted = ""
    for chunk in groups(ids, random.Random(seed)):
        delta = detok.add_tokens(chunk)
        assert "\ufffd" not in delta.text
        emitted += delta.text
        assert expected.startswith(emitted)
        if delta.stop_str is not None:
            break
    emitted += detok.finish()
    assert emitted == expected
    assert detok.stop_str == expected_stop
