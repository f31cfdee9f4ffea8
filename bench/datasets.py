"""Prompt sets for ``trioserve bench serve``: random, prefix-sharing, and file.

Lengths are in tokens of a local tokenizer, which should be the served
model's: a prompt built here to be N tokens long is N tokens long for that
tokenizer, not necessarily for another. ``random_words`` makes prompts that
need no tokenizer, counted in words, for the soak and slow-reader scripts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import attrs

from trioserve.engine.errors import TrioserveError

# Rounds of decode/re-encode/adjust before a fresh sample is drawn; a round
# almost always lands on the length, so this bound only guards against a
# tokenizer that oscillates.
_MAX_ROUNDS = 16
_MAX_SAMPLES = 8


class DatasetError(TrioserveError, ValueError):
    """A dataset could not be built: a bad file, or impossible lengths."""


# The vocabulary of ``random_words``: plain English words, so that a prompt
# drawn from it tokenizes much like ordinary text.
WORDS = (
    "the a river stone amber quiet lantern copper meadow falcon winter orchard signal harbor velvet ember "
    "north glass thunder silver market garden bridge candle paper island"
).split()


def random_words(rng: random.Random, count: int) -> str:
    """``count`` words drawn from ``WORDS`` with ``rng``, joined by spaces."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


class Tokenizer(Protocol):
    """What the datasets need of a tokenizer; a Hugging Face one fits."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@attrs.frozen
class SampleRequest:
    """One prompt to send, with its length in tokens and its output budget."""

    prompt: str
    prompt_len: int
    output_len: int


@attrs.frozen
class TokenizerJson:
    """A bare ``tokenizer.json`` (the ``tokenizers`` library), no transformers."""

    _tokenizer: object

    @classmethod
    def from_file(cls, path: str | Path) -> TokenizerJson:
        from tokenizers import Tokenizer as _Tokenizer

        return cls(_Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        decoder = self._tokenizer.get_added_tokens_decoder()
        return sorted(i for i, token in decoder.items() if token.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a tokenizer from a ``tokenizer.json`` file, a Hugging Face folder,
    or a ``.gguf`` file; ``None`` means the default model's (SmolLM2-135M)."""
    if path is None:
        # Imported here: the loader imports torch, which nothing else in the
        # benchmark client needs.
        from trioserve.engine.loading.sources import default_model_path

        path = default_model_path()
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"tokenizer not found: {path}")
    if path.name.endswith(".json"):
        return TokenizerJson.from_file(path)
    from transformers import AutoTokenizer

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def _token_pool(tokenizer: Tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    pool = [i for i in range(tokenizer.vocab_size) if i not in special]
    if not pool:
        raise DatasetError("the tokenizer has no ordinary tokens to sample")
    return pool


def exact_length_text(
    tokenizer: Tokenizer, rng: random.Random, length: int, *, lead: str = "", pool: Sequence[int] | None = None
) -> str:
    """Random text that adds exactly ``length`` tokens when appended to ``lead``.

    Random ids rarely survive decode and re-encode unchanged (merges across
    ids, partial UTF-8), so the ids are re-encoded, trimmed or topped up with
    fresh random ids, and checked again until the count is exact.
    """
    if length < 0:
        raise DatasetError("length must be >= 0")
    if length == 0:
        return ""
    pool = _token_pool(tokenizer) if pool is None else pool
    lead_len = len(tokenizer.encode(lead, add_special_tokens=False)) if lead else 0
    for _ in range(_MAX_SAMPLES):
        ids = [rng.choice(pool) for _ in range(length)]
        for _ in range(_MAX_ROUNDS):
            text = tokenizer.decode(ids)
            count = len(tokenizer.encode(lead + text, add_special_tokens=False)) - lead_len
            if count == length:
                return text
            ids = tokenizer.encode(text, add_special_tokens=False)
            if count > length:
                ids = ids[: max(0, len(ids) - (count - length))]
            else:
                ids += [rng.choice(pool) for _ in range(length - count)]
    raise DatasetError(f"could not build a text of exactly {length} tokens")


def sample_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length drawn uniformly from ``[length*(1-r), length*(1+r)]``, at least 1."""
    low = max(1, int(length * (1.0 - range_ratio)))
    high = max(low, int(length * (1.0 + range_ratio)))
    return rng.randint(low, high)


def _check_lengths(num_prompts: int, range_ratio: float, **lengths: int) -> None:
    if num_prompts < 1:
        raise DatasetError("num_prompts must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError("range_ratio must be in [0, 1)")
    for name, value in lengths.items():
        if value < 1:
            raise DatasetError(f"{name} must be >= 1")


def random_dataset(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of random tokens, each exactly as long as
    its drawn input length; the same seed gives the same prompts."""
    _check_lengths(num_prompts, range_ratio, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    samples = []
    for _ in range(num_prompts):
        n_in = sample_length(rng, input_len, range_ratio)
        n_out = sample_length(rng, output_len, range_ratio)
        samples.append(SampleRequest(exact_length_text(tokenizer, rng, n_in, pool=pool), n_in, n_out))
    return samples


def prefix_dataset(
    tokenizer: Tokenizer,
    *,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    num_prefixes: int = 1,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[SampleRequest]:
    """Prompts that share a long prefix (a system prompt) of exactly
    ``prefix_len`` tokens, each followed by its own random part.

    With ``num_prefixes > 1`` the prompts are split evenly across that many
    prefixes and shuffled, so requests for one prefix are interleaved.
    """
    _check_lengths(num_prompts, range_ratio, prefix_len=prefix_len, suffix_len=suffix_len, output_len=output_len)
    if num_prefixes < 1:
        raise DatasetError("num_prefixes must be >= 1")
    rng = random.Random(seed)
    pool = _token_pool(tokenizer)
    prefixes = [exact_length_text(tokenizer, rng, prefix_len, pool=pool) for _ in range(num_prefixes)]
    samples = []
    for i in range(num_prompts):
        prefix = prefixes[i % num_prefixes]
        n_suffix = sample_length(rng, suffix_len, range_ratio)
        suffix = exact_length_text(tokenizer, rng, n_suffix, lead=prefix, pool=pool)
        n_out = sample_length(rng, output_len, range_ratio)
        samples.append(SampleRequest(prefix + suffix, prefix_len + n_suffix, n_out))
    rng.shuffle(samples)
    return samples


def _parse_entry(entry: object, where: str, tokenizer: Tokenizer, output_len: int) -> SampleRequest:
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
        raise DatasetError(f"{where}: expected an object with a string 'prompt'")
    n_out = entry.get("output_len", output_len)
    if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
        raise DatasetError(f"{where}: 'output_len' must be an integer >= 1")
    prompt = entry["prompt"]
    return SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n_out)


def file_dataset(
    path: str | Path, tokenizer: Tokenizer, *, output_len: int, num_prompts: int | None = None
) -> list[SampleRequest]:
    """Prompts from a JSON list or a JSONL file of ``{"prompt": ..., "output_len"?: ...}``.

    ``output_len`` is the budget of entries without one. With ``num_prompts``
    the file is cut to that many, or cycled when it holds fewer.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror}") from None
    try:
        if text.lstrip().startswith("["):
            entries = [(f"{path}[{i}]", e) for i, e in enumerate(json.loads(text))]
        else:
            entries = [
                (f"{path}:{n}", json.loads(line)) for n, line in enumerate(text.splitlines(), 1) if line.strip()
            ]
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    samples = [_parse_entry(entry, where, tokenizer, output_len) for where, entry in entries]
    if not samples:
        raise DatasetError(f"{path}: no prompts")
    if num_prompts is not None:
        samples = [samples[i % len(samples)] for i in range(num_prompts)]
    return samples
