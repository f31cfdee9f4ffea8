"""A checkpoint's tokenizer on the ``tokenizers`` library alone.

A checkpoint with a ``tokenizer.json`` needs nothing of transformers to
tokenize: the file holds the whole pipeline (normalizer, pre-tokenizer,
model, post-processor, decoder, added tokens), and what transformers adds on
top is read from ``tokenizer_config.json`` (special tokens, the chat
template, clean-up of decoded text). ``FastTokenizer`` loads both as
transformers' ``PreTrainedTokenizerFast.from_pretrained`` does and gives the
engine the small part of that class's API it uses: ``encode``, ``decode``,
``apply_chat_template``, token/id conversion, the special tokens and their
ids, ``get_vocab`` and ``save_pretrained``. Not importing transformers keeps
about 45 MiB and a second of start-up out of a serving process (see
docs/architecture.md).

What it reproduces of transformers' loading (checked by
tests/test_fast_tokenizer.py against transformers itself):

- the added tokens of ``tokenizer_config.json``'s ``added_tokens_decoder``
  are added to the backend again (their flags there win), then every
  special token the config names that the backend does not have yet, as a
  special token; with no ``added_tokens_decoder``, the legacy
  ``special_tokens_map.json`` names the special tokens;
- named special tokens are the seven standard ones (``bos_token``, ...)
  and any other ``*_token`` key of the config (``image_token``, ...);
  ``additional_special_tokens`` / ``extra_special_tokens`` list the rest;
- truncation and padding are off; a missing post-processor becomes one that
  adds nothing; ``split_special_tokens`` sets the backend's
  ``encode_special_tokens``;
- the chat template comes from ``chat_template.jinja`` and
  ``additional_chat_templates/*.jinja`` when they exist, else from the
  config (a string, or a list of named templates);
- ``decode`` cleans up tokenization spaces only when the config asks and the
  model is not BPE (transformers skips the clean-up for BPE).

Not reproduced: transformers' Mistral pre-tokenizer patch (applied only
when a config asks with ``fix_mistral_regex``), ``continue_final_message``,
batched calls and tensors. Checkpoints without a ``tokenizer.json`` keep
transformers' ``AutoTokenizer`` (engine/text/tokenizer.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from trioserve.engine.text.chat_template import ChatTemplates

# transformers' named special tokens; a config may name more (``*_token``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Replacements transformers' ``clean_up_tokenization`` makes, in its order.
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # fmt: skip
# Special tokens a transformers tokenizer class names by default when its
# config leaves them out: Gemma's configs omit ``mask_token``, and its class
# makes ``<mask>`` special all the same (skipped by ``skip_special_tokens``).
_CLASS_DEFAULTS = {"GemmaTokenizer": {"mask_token": "<mask>"}, "GemmaTokenizerFast": {"mask_token": "<mask>"}}


def _token_text(value: Any) -> str | None:
    """A special token as a config writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, *, named: bool) -> AddedToken:
    """The AddedToken transformers makes of a config's special token value."""
    if isinstance(value, str):
        return AddedToken(value, special=True)
    fields = {k: v for k, v in value.items() if k in ("content", "single_word", "lstrip", "rstrip", "normalized", "special")}
    token = AddedToken(**fields)
    if named and not token.special:
        token = AddedToken(**{**fields, "special": True})
    return token


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return value


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {entry["name"]: entry["template"] for entry in template}
    return template


class FastTokenizer:
    """A ``tokenizers.Tokenizer`` with the special tokens, chat template and
    decoding options of its checkpoint. Build one with ``from_folder``.

    The method names and arguments are transformers' (a tokenizer from
    ``AutoTokenizer`` serves the same callers). Thread-safe for encoding,
    decoding and rendering: nothing here changes after loading.
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        extra_special_tokens: Sequence[str] = (),
        chat_template: str | Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        """``backend`` is used as it is (``from_folder`` prepares it);
        ``special_tokens`` maps names (``"bos_token"``, ...) to token text."""
        self._backend = backend
        self._special = dict(special_tokens or {})
        self._extra = tuple(extra_special_tokens)
        template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
        self.chat_template: str | dict[str, str] | None = template
        # transformers skips its clean-up for BPE models: it would eat real spaces.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"
        self._templates = ChatTemplates()

    @classmethod
    def from_folder(cls, folder: str | Path) -> FastTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (and the
        chat template files) of checkpoint folder ``folder``.

        Raises ``OSError`` for missing or unreadable files, ``ValueError``
        (``json.JSONDecodeError`` among them) and ``Exception`` from
        ``tokenizers`` for malformed ones."""
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        backend.no_truncation()
        backend.no_padding()

        named: dict[str, Any] = {}  # name -> str or AddedToken dict, as the config has it
        extra: list[Any] = []
        sources = [config]
        if "added_tokens_decoder" not in config:
            sources.append(_read_json(folder / "special_tokens_map.json"))  # legacy, read only then
        for source in sources:
            for key, value in source.items():
                if key in ("extra_special_tokens", "additional_special_tokens"):
                    if isinstance(value, Mapping):
                        named.update(value)
                    elif isinstance(value, (list, tuple)):
                        for item in value:
                            if _token_text(item) not in [_token_text(v) for v in extra]:
                                extra.append(item)
                elif key.endswith("_token") and _token_text(value) is not None:
                    named[key] = value
        for key, value in _CLASS_DEFAULTS.get(config.get("tokenizer_class"), {}).items():
            if key not in config:  # an explicit null in the config means none
                named.setdefault(key, value)
        # The standard names first, in their order: a token missing from the
        # vocabulary gets the next free id in this order.
        named = {**{k: named[k] for k in SPECIAL_TOKEN_NAMES if k in named}, **named}

        # The config's added tokens go in again, in id order: where their flags
        # differ from tokenizer.json's, the config's win (as in transformers).
        decoder = config.get("added_tokens_decoder") or {}
        replayed = [AddedToken(**decoder[k]) for k in sorted(decoder, key=int) if isinstance(decoder[k], Mapping)]
        known = {t.content for t in backend.get_added_tokens_decoder().values()} | {t.content for t in replayed}
        missing: list[AddedToken] = []
        for value, is_named in [(v, True) for v in named.values()] + [(v, False) for v in extra]:
            text = _token_text(value)
            if text is not None and text not in known:
                known.add(text)
                missing.append(_added_token(value, named=is_named))
        if replayed or missing:
            backend.add_tokens(replayed + missing)
        if backend.post_processor is None:
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))

        return cls(
            backend,
            special_tokens={name: _token_text(value) for name, value in named.items()},
            extra_special_tokens=[_token_text(v) for v in extra if _token_text(v) is not None],
            chat_template=_chat_template(folder, config),
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # -- the backend and the vocabulary -----------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` underneath (read it, do not change it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """The model's base vocabulary, without added tokens (as transformers')."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Every token's text (as the model stores it) to its id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        """The stored text of one id (None if unknown), or of each of ``ids``."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """The id of one token (the unknown token's if it has none), or of each."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        found = self._backend.token_to_id(token)
        if found is None and token != self.unk_token:
            return self._token_id(self.unk_token)
        return found

    # -- special tokens ------------------------------------------------------------

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (``bos_token``, ..., then model-specific
        ones), as chat templates see them."""
        standard = {name: self._special[name] for name in SPECIAL_TOKEN_NAMES if self._special.get(name) is not None}
        others = {name: text for name, text in self._special.items() if name not in SPECIAL_TOKEN_NAMES}
        return {**standard, **others}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, without repeats."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self._extra]))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in self.convert_tokens_to_ids(self.all_special_tokens) if i is not None]

    bos_token = property(lambda self: self._special.get("bos_token"), doc="The beginning-of-sequence token, or None.")
    eos_token = property(lambda self: self._special.get("eos_token"), doc="The end-of-sequence token, or None.")
    unk_token = property(lambda self: self._special.get("unk_token"), doc="The unknown token, or None.")
    pad_token = property(lambda self: self._special.get("pad_token"), doc="The padding token, or None.")
    bos_token_id = property(lambda self: self._token_id(self.bos_token), doc="The id of ``bos_token``, or None.")
    eos_token_id = property(lambda self: self._token_id(self.eos_token), doc="The id of ``eos_token``, or None.")
    unk_token_id = property(lambda self: self._token_id(self.unk_token), doc="The id of ``unk_token``, or None.")
    pad_token_id = property(lambda self: self._token_id(self.pad_token), doc="The id of ``pad_token``, or None.")

    # -- text <-> ids --------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``; ``add_special_tokens`` runs the
        post-processor (a BOS token, for models whose tokenizer adds one)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """transformers' call form, for one text: ``{"input_ids": encode(text)}``."""
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (an int is one id); ``skip_special_tokens``
        leaves out the tokens marked special."""
        ids = [ids] if isinstance(ids, int) else [int(i) for i in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    # -- chat ------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template source to use: ``chat_template`` (a template, or the
        name of one of this tokenizer's), else this tokenizer's (its
        ``tool_use`` one when there are tools and it has one, else ``default``).
        Raises ``ValueError`` when there is none."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(f"this tokenizer has several chat templates and no default: {sorted(own)}")
        if chat_template is not None:
            return chat_template
        if own is None:
            raise ValueError("this tokenizer has no chat template")
        return own

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render ``conversation`` (a list of message dicts) with the chat
        template (``get_chat_template``) and return its token ids (encoded
        without special tokens: the template writes them), or its text when
        not ``tokenize``. ``tools`` are JSON schemas; ``kwargs`` are more
        template variables, over the special tokens'.

        Raises ``jinja2.TemplateError`` when the template fails,
        ``ValueError`` for an empty conversation or no template."""
        if return_dict:
            raise ValueError("return_dict=True is not supported: the result is a list of ids")
        source = self.get_chat_template(chat_template, tools)
        text = self._templates.render(
            source,
            conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            variables={**self.special_tokens_map, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- saving ------------------------------------------------------------------------

    def save_pretrained(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into
        ``folder`` (created if needed); ``from_folder`` and transformers
        both load them back to this tokenizer."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self._special}
        if self._extra:
            config["extra_special_tokens"] = list(self._extra)
        if self.chat_template is not None:
            config["chat_template"] = (
                [{"name": k, "template": v} for k, v in self.chat_template.items()]
                if isinstance(self.chat_template, dict)
                else self.chat_template
            )
        if self._clean_up:
            config["clean_up_tokenization_spaces"] = True
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
