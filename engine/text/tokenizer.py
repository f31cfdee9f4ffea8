"""Tokenizer loading from local files, chat templating and EOS discovery.

A checkpoint with a ``tokenizer.json`` gets a ``FastTokenizer`` (the
``tokenizers`` library and jinja2 only, engine/text/fast_tokenizer.py): a
serving process then never imports transformers, whose tokenizer machinery
costs about 45 MiB and a second of start-up. Other checkpoints (a
SentencePiece ``tokenizer.model`` only, say) get transformers'
``AutoTokenizer``, imported only then. Both answer the same calls.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trioserve.engine.errors import InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trioserve.engine.text.fast_tokenizer import FastTokenizer

logger = logging.getLogger(__name__)

# Any one of these makes a folder a tokenizer folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path) -> FastTokenizer | PreTrainedTokenizerBase:
    """Load the tokenizer in checkpoint folder ``path`` from local files only:
    a ``FastTokenizer`` when it has a ``tokenizer.json``, else transformers'.

    Raises ``ModelLoadError`` naming the folder when it has no tokenizer files
    or they cannot be read.
    """
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        if (path / "tokenizer.json").is_file():
            # tokenizer.json defines the whole pipeline (normalizer through
            # post-processor), so one generic class reproduces any
            # model-specific one, as transformers' PreTrainedTokenizerFast does.
            from trioserve.engine.text.fast_tokenizer import FastTokenizer

            tokenizer = FastTokenizer.from_folder(path)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # json, tokenizers, sentencepiece and OS errors all end here
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {type(exc).__name__}: {exc}") from None
    if not tokenizer.chat_template:
        logger.warning("%s: the tokenizer has no chat template; only plain completions will work", path)
    return tokenizer


def check_text(text: str, field: str) -> None:
    """Raise ``InvalidRequestError`` naming ``field`` unless ``text`` is
    Unicode text a tokenizer takes: a Python string may hold a lone UTF-16
    surrogate (JSON's ``"\\ud800"`` decodes to one), which has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{field} is not valid Unicode text: it holds a lone UTF-16 surrogate at index {exc.start}", field=field
        ) from None


def apply_chat_template(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template into token ids.

    Raises ``InvalidRequestError`` (field ``messages``) when the tokenizer has
    no template or the template rejects the messages (many raise on an
    unexpected role order), and naming the message when its text is not
    Unicode text (``check_text``).
    """
    if not tokenizer.chat_template:
        raise InvalidRequestError("this model has no chat template; use a plain completion", field="messages")
    for i, message in enumerate(messages):
        for key in ("role", "content"):
            if isinstance(message.get(key), str):
                check_text(message[key], f"messages[{i}].{key}")
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except TemplateError as exc:
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}", field="messages") from None
    return [int(i) for i in ids]


def eos_token_ids(
    tokenizer: FastTokenizer | PreTrainedTokenizerBase, config_eos: Iterable[int] = (), folder: Path | None = None
) -> tuple[int, ...]:
    """Every token id that ends generation, in order, without repeats.

    The union of the model config's ``eos_token_id`` (``config_eos``),
    ``generation_config.json``'s in ``folder`` (Llama 3 lists several there)
    and the tokenizer's ``eos_token_id``.
    """
    ids: list[int] = [int(i) for i in config_eos]
    if folder is not None:
        ids.extend(_generation_config_eos(Path(folder) / "generation_config.json"))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def _generation_config_eos(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            return []
        return [int(i) for i in eos] if isinstance(eos, list) else [int(eos)]
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        # An optional file: a broken one costs only its extra EOS ids.
        logger.warning("%s: ignored, unreadable: %s", path, exc)
        return []
