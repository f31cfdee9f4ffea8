"""A GGUF's byte-level BPE tokenizer as ``tokenizer.json`` and
``tokenizer_config.json``, built with the ``tokenizers`` library alone.

A GGUF carries its tokenizer as metadata (llama.cpp's keys: the tokens,
their types, the merges, the pre-tokenizer's name, the special ids and the
chat template). llama-server builds its tokenizer from those keys at load;
trioserve writes them once into the file's cache entry as the files
``engine/text/fast_tokenizer.py`` reads. transformers can do the same
(``AutoTokenizer.from_pretrained(..., gguf_file=...)``), but importing it
imports torch and its distributed and compiler modules: 5-8 CPU seconds of
a first start, against well under one for this module (docs/performance.md,
"Start-up: where the time goes").

``tokenizer_files`` builds what transformers 5 builds from the same keys for
the byte-level vocabularies (``tokenizer.ggml.model`` "gpt2": Llama 3,
Qwen 2 and 3, SmolLM 2 and 3, gpt-oss, Mistral's Tekken, Phi-4):

- the vocabulary, each token spelled in GPT-2's byte alphabet (a token the
  file writes in plain text, such as a special token, is respelled byte by
  byte only when it holds a character outside that alphabet), and the
  file's merges, in a BPE model without an unknown token;
- the pre-tokenizer: the split pattern llama.cpp names by
  ``tokenizer.ggml.pre`` followed by a byte-level step, or for a name not in
  ``PRE_TOKENIZER_SPLITS`` GPT-2's own byte-level pre-tokenizer; a
  byte-level decoder;
- the control tokens (type 3) as special added tokens, but for one holding
  a character outside the byte alphabet (a mislabel: a real token of such a
  vocabulary is always spelled in it); user-defined ones (type 4, such as
  ``<think>``) as added tokens that are not special; a named special token
  the vocabulary does not mark as control, as a special added token;
- the post-processor adds the BOS and EOS tokens where the file's
  ``add_bos_token`` / ``add_eos_token`` ask;
- ``tokenizer_config.json`` names the BOS, EOS, unknown and padding tokens
  by the file's ids and holds its chat template.

One difference from transformers' result, on purpose: transformers builds a
byte-level tokenizer through its GPT-2 class, whose default special token
``<|endoftext|>`` it adds to a vocabulary that lacks it (Llama 3's), as a
token past the model's last row; none is added here.
tests/test_gguf_tokenizer.py holds the rest equal to transformers' on real
vocabularies. Other tokenizer models (sentencepiece's "llama", Gemma's,
Phi-3's, T5's) are left to transformers (``reads`` says which).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's token types that become added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# The special tokens a config names, by the GGUF id key that gives each.
_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}  # fmt: skip
# transformers' "no limit" for model_max_length (int(1e30)), which its saved configs carry.
_NO_MAX_LENGTH = int(1e30)

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split its vocabulary's merges were learned on
# (the names transformers 5 knows; any other keeps GPT-2's byte-level split).
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _O200K),
}  # fmt: skip


def reads(fields: dict[str, Any]) -> bool:
    """Whether ``tokenizer_files`` builds the tokenizer these GGUF fields
    describe: a byte-level BPE vocabulary with its merges."""
    return fields.get("tokenizer.ggml.model") == "gpt2" and bool(fields.get("tokenizer.ggml.merges"))


def wants_strings(key: str) -> bool:
    """The string arrays ``tokenizer_files`` needs from ``GGUFFile``."""
    return key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: the printable Latin-1 bytes
    as themselves, the other 68 as the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in kept}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def tokenizer_files(fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``tokenizer.json``'s text and ``tokenizer_config.json``'s content for
    the GGUF fields ``fields`` (``GGUFFile.fields`` read with
    ``wants_strings``), which ``reads`` accepts. Raises ``ValueError``
    naming the key for a vocabulary it cannot build."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or ())
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merges = []
    for merge in fields["tokenizer.ggml.merges"]:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise ValueError(f"tokenizer.ggml.merges: {merge!r} is not two tokens separated by a space")
        merges.append((pair[0], pair[1]))
    backend = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                   fuse_unk=False)
    )  # fmt: skip
    split = PRE_TOKENIZER_SPLITS.get(str(fields.get("tokenizer.ggml.pre")))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )  # fmt: skip
    backend.decoder = decoders.ByteLevel()
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types)
        if kind == _CONTROL and set(token) <= alphabet
    ]
    backend.add_special_tokens(control)
    known = backend.get_vocab()
    backend.add_tokens(
        [AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
         if kind == _USER_DEFINED and token in known]
    )  # fmt: skip
    named = {}
    for name, key in _SPECIAL_IDS.items():
        index = fields.get(f"tokenizer.ggml.{key}")
        if index is not None and not 0 <= int(index) < len(tokens):
            raise ValueError(f"tokenizer.ggml.{key}: {index} is not an id of the {len(tokens)} tokens")
        named[name] = None if index is None else tokens[int(index)]
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    backend.add_special_tokens(
        [AddedToken(token, special=True) for token in dict.fromkeys(named.values()) if token and token not in added]
    )
    backend.post_processor = _post_processor(fields, named, backend)
    backend.no_truncation()
    backend.no_padding()
    config: dict[str, Any] = {
        "backend": "tokenizers",
        **named,
        "model_max_length": _NO_MAX_LENGTH,
        "tokenizer_class": "TokenizersBackend",
    }
    if fields.get("tokenizer.chat_template"):
        config["chat_template"] = fields["tokenizer.chat_template"]
    return backend.to_str(), config


def _post_processor(fields: dict[str, Any], named: dict[str, str | None], backend: Tokenizer) -> Any:
    """A template adding BOS before and EOS after a sequence where the file asks."""
    ends = []
    for flag, name in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        token = named[name]
        ends.append(token if fields.get(f"tokenizer.ggml.{flag}") and token is not None else None)
    bos, eos = ends
    single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if bos else []), "$B:1", *([f"{eos}:1"] if eos else [])])
    special = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def config_json(config: dict[str, Any]) -> str:
    """``tokenizer_config.json``'s text for ``config``."""
    return json.dumps(config, indent=2, ensure_ascii=False)
