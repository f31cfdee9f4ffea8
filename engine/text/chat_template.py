"""Chat templates: Jinja rendering of a conversation into prompt text.

A checkpoint's chat template is Jinja source written against the
environment Hugging Face transformers renders it in, so this module builds
the same environment (transformers 5's ``chat_template_utils``): a sandbox
that cannot change its inputs, ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` block tag (which only
marks the assistant's part when training; here it renders its body), a
``tojson`` filter that does not escape HTML and takes ``indent``,
``separators`` and ``sort_keys``, and the globals ``raise_exception``,
``strftime_now``, a restricted ``dict`` and a ``namespace`` that refuses
underscore names. The template sees plain JSON data only (``plain_data``),
messages without their ``None`` fields, a message's reasoning under each of
the names templates read, and the tokenizer's named special tokens as
variables (``bos_token``, ...).

``render`` raises ``jinja2.TemplateError`` when the template does
(``raise_exception``) or cannot be parsed; callers turn that into a request
error. Compiled templates are cached by ``ChatTemplates``, one per template
source, for the tokenizer that owns it.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning is given under; templates read one of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """``dict`` as templates call it: a constructor and ``fromkeys``, no
    access to the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace``, refusing names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own signature trick
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for name in values:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment chat templates are written against."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def plain_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (str, int, float, bool, None,
    dict, list, tuple): the sandbox only knows those are harmless. Subclasses
    of them lose their extra methods, dataclasses and pydantic models become
    dicts, anything else a placeholder naming its type (``"<ndarray>"``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        return plain_data(value.item())  # a numpy scalar: np.bool_(False) must stay falsy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{index}] is not a dict: {message!r}")
    # APIs send content=None or tool_calls=None; templates handle a missing
    # key but would render a None as "None".
    out = {key: value for key, value in message.items() if value is not None}
    reasoning = next((out[key] for key in REASONING_FIELDS if key in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplates:
    """Compiles and caches chat templates (by source) and renders them.

    Thread-safe: requests render in the event loop's worker threads.
    """

    def __init__(self) -> None:
        self._env = make_environment()
        self._compiled: dict[str, jinja2.Template] = {}
        self._lock = threading.Lock()

    def compile(self, source: str) -> jinja2.Template:
        """The compiled ``source``; raises ``jinja2.TemplateSyntaxError``."""
        with self._lock:
            template = self._compiled.get(source)
            if template is None:
                template = self._compiled[source] = self._env.from_string(source)
            return template

    def render(
        self,
        source: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The text of ``messages`` rendered by template ``source``, with
        ``tools`` (JSON schemas), ``documents`` and ``variables`` (the
        special tokens, then any extra template variables) visible to it.

        Raises ``ValueError`` for an empty conversation, ``TypeError`` for a
        message, tool or document that is not a dict, and
        ``jinja2.TemplateError`` when the template fails."""
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for name, items in (("tools", tools), ("documents", documents)):
            for i, item in enumerate(items or ()):
                if not isinstance(item, Mapping):
                    raise TypeError(f"{name}[{i}] is not a dict: {item!r}")
        chat = [_message(m, i) for i, m in enumerate(plain_data(list(messages)))]
        return self.compile(source).render(
            messages=chat,
            tools=plain_data(None if tools is None else list(tools)),
            documents=plain_data(None if documents is None else list(documents)),
            add_generation_prompt=add_generation_prompt,
            **plain_data(dict(variables or {})),
        )
