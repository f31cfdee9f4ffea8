"""Tool calling on ``POST /v1/chat/completions``: ``tools``, ``tool_choice``,
the prompt that shows the tools to the model, and the calls read back out.

The tools go into the prompt through the model's own chat template when it
takes ``tools``; a ChatML template without tool support (the default
model's) gets ``CHATML_TOOLS_TEMPLATE``, ChatML in the Hermes/Qwen2 style;
any other template without tool support is refused (400 naming ``tools``).
The model calls a tool in its family's format (web/parsers.py picks it;
Hermes' ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` by
default, the others in web/tool_format_*.py and web/harmony.py). With
``tool_choice: "required"`` the output is constrained to one or more calls
of the listed tools (one with ``parallel_tool_calls: false``), and with a
named function to one call of it, written in the model's format, each
call's arguments valid against its function's schema
(``ToolChoice.forced``), so they always parse. Without a model format at
hand (``ToolChoice.constraint``), the output is bare JSON: one
``{"name", "arguments"}`` object, or the named function's arguments.
A streamed response reads the calls as they are generated: web/tool_stream.py.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import attrs

from trioserve.engine.sampling.structured_output import StructuredOutput

from .errors import InvalidRequest
from .tool_format import Mark, ToolFormat, structural_tag
from .tool_format_json import HermesFormat, NamedFormat, RequiredFormat

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# An object schema with no properties: strict JSON-schema compilers would
# allow only "{}" for a bare {"type": "object"}.
_ANY_OBJECT = {"type": "object", "additionalProperties": True}

# ChatML with tools in the Hermes/Qwen2 style, for ChatML templates that do
# not take ``tools`` themselves. A system message (given or not) lists the
# tools; an assistant's calls are <tool_call> blocks; tool results go back as
# a user turn in <tool_response> blocks.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}\n{{ messages[0].content }}\n{% endif %}\n"
    "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside tags:\n"
    '<tool_call>\n{"name": "the function", "arguments": {"an argument": "its value"}}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}\n<|im_start|>assistant"
    "{%- if message.content %}\n{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls %}\n<tool_call>\n"
    '{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>"
    "{%- elif message.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>"
    "{%- else %}\n<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", param=f"{where}.function.parameters")
    out = {"name": name, "parameters": parameters if parameters else dict(_ANY_OBJECT)}
    if description is not None:
        out["description"] = description
    return out


@attrs.frozen
class ToolChoice:
    """A request's tools (as the template takes them) and how it may call them.

    ``mode`` is ``none``, ``auto``, ``required`` or ``named`` (then ``name``
    is the function); ``parallel`` (``parallel_tool_calls``) is whether
    ``required`` may make more than one call.
    """

    functions: tuple[dict[str, Any], ...]
    mode: str
    name: str | None = None
    parallel: bool = True

    @property
    def forces_calls(self) -> bool:
        """Whether the output must be calls (``required`` or a named function)."""
        return self.mode in ("required", "named")

    @property
    def schemas(self) -> dict[str, dict[str, Any]]:
        """Each function's parameters' schema, by name."""
        return {f["name"]: f["parameters"] for f in self.functions}

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def forced(self, model_format: ToolFormat, mark: Mark, *, after_reasoning: bool = False) -> StructuredOutput | None:
        """The output's constraint for ``required`` and ``named``: calls in
        ``model_format``'s own syntax (None for other modes, or a format
        that cannot force calls). ``mark`` writes the format's markers (as
        tokens of the model's vocabulary); ``after_reasoning``: the calls
        follow the model's reasoning."""
        forced = getattr(model_format, "forced", None)
        if not self.forces_calls or forced is None:
            return None
        functions = [f for f in self.functions if self.mode == "required" or f["name"] == self.name]
        one = self.mode == "named" or not self.parallel
        element = forced(functions, one=one, mark=mark, after_reasoning=after_reasoning)
        return StructuredOutput.structural_tag(structural_tag(element), field="tools")

    def constraint(self) -> StructuredOutput | None:
        """The output's constraint: the call's JSON for ``required`` and ``named``."""
        if self.mode == "named":
            function = next(f for f in self.functions if f["name"] == self.name)
            return StructuredOutput.json_schema(function["parameters"], field=f"tools[{self.name}].parameters")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [f["name"]]}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"],
                }
                for f in self.functions
            ]
            schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
            return StructuredOutput.json_schema(schema, field="tools")
        return None


def tool_choice(body: dict[str, Any]) -> ToolChoice | None:
    """The body's ``tools`` and ``tool_choice``, checked; None when the
    request has no tools or chose ``none``."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of functions", param="tools")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must not name a function twice", param="tools")
    if choice is None or choice == "auto":
        mode, name = "auto", None
    elif choice == "none":
        return None
    elif choice == "required":
        mode, name = "required", None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode, name = "named", choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    else:
        raise InvalidRequest(
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}", param="tool_choice"
        )
    if mode != "auto" and (body.get("response_format") or {}).get("type", "text") != "text":
        raise InvalidRequest(f"tool_choice {mode} cannot be combined with response_format", param="tool_choice")
    if mode != "auto" and body.get("structured_outputs") is not None:
        raise InvalidRequest(f"tool_choice {mode} cannot be combined with structured_outputs", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return ToolChoice(functions, mode, name, parallel is not False)


def tools_template(tokenizer: Any) -> str | None:
    """The chat template that renders tools for this tokenizer: its own if it
    takes ``tools``, ChatML's with tools for a ChatML one, else None."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return None
    if "tools" in template:
        return template
    if "<|im_start|>" in template:
        return CHATML_TOOLS_TEMPLATE
    return None


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: ToolChoice | None,
    *,
    with_tools: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], str]:
    """Token ids and text of ``messages`` rendered for generation, with
    ``template_kwargs`` as template variables (``enable_thinking``, ...).
    ``with_tools``: through ``tools_template``, ``tools`` shown to the
    model; raises ``InvalidRequest`` naming ``tools`` when the model's
    template cannot show tools, ``messages`` when it rejects them."""
    template = tools_template(tokenizer) if with_tools else tokenizer.chat_template
    if not template:
        param = "tools" if tools is not None else "messages"
        what = "does not support tool calling" if with_tools else "is missing: use a plain completion"
        raise InvalidRequest(f"this model's chat template {what} ({param})", param=param)
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=None if tools is None else tools.template_tools,
            chat_template=template if with_tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except TemplateError as exc:
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from None
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)], text


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(name: Any, arguments: Any, names: set[str]) -> dict[str, Any] | None:
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def call_format(tools: ToolChoice, model_format: ToolFormat | None = None) -> ToolFormat:
    """The format the output's calls are written in: the model's (Hermes
    when none is given), unless ``required`` or a named function forced
    bare JSON (no model format, or one that cannot force calls)."""
    if tools.forces_calls and hasattr(model_format, "forced"):
        return model_format  # type: ignore[return-value]
    if tools.mode == "required":
        return RequiredFormat()
    if tools.mode == "named":
        return NamedFormat(tools.name or "")
    return model_format if model_format is not None else HermesFormat()


def parse_tool_calls(text: str, tools: ToolChoice, model_format: ToolFormat | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """A message's content (None if empty) and its tool calls, in OpenAI's
    shape (``id``, ``type``, ``function.name``, ``function.arguments`` as
    JSON text), from the model's ``text`` read in ``call_format``. A call
    whose arguments are not a JSON object is dropped; with no call left,
    the whole text is content."""
    names = {f["name"] for f in tools.functions}
    scan = call_format(tools, model_format).scan(text, tools.schemas, True)
    calls = [c for s in scan.calls if (c := _as_call(s.name, s.arguments, names)) is not None]
    if not calls:
        content = scan.content if not scan.calls else text
        return content or None, []
    return scan.content.strip() or None, calls
