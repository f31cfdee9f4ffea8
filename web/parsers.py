"""Which reasoning parser and tool-call format read a model's output:
``--reasoning-parser`` and ``--tool-call-parser`` (vLLM's names), or,
left out, what the model's chat template shows it writes.

From the template: harmony's ``<|channel|>`` is gpt-oss (``gpt_oss``
reasoning, ``openai`` calls); ``<think>`` or ``enable_thinking`` is a
``qwen3`` reasoning model; calls are ``qwen3_coder`` for
``<function=``, ``mistral`` for ``[TOOL_CALLS]``, ``llama3_json`` for
Llama 3's ``<|python_tag|>`` or header tokens, and ``hermes`` for
``<tool_call>`` or any ChatML template (web/tools.py shows tools to a
ChatML template that has no tool support in the Hermes style). A
template with no think tags gets no reasoning parser: its output reads
as it always did.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .harmony import HarmonyFormat, HarmonyReasoning
from .reasoning import ReasoningParser, ThinkTags
from .tool_format import ToolFormat
from .tool_format_json import HermesFormat
from .tool_format_llama3 import Llama3JsonFormat
from .tool_format_mistral import MistralFormat
from .tool_format_qwen3_coder import Qwen3CoderFormat

REASONING_PARSERS: Mapping[str, ReasoningParser] = {
    "qwen3": ThinkTags("qwen3"),
    "deepseek_r1": ThinkTags("deepseek_r1", always_inside=True),
    "gpt_oss": HarmonyReasoning(),
}
TOOL_CALL_PARSERS: Mapping[str, ToolFormat] = {
    "hermes": HermesFormat(),
    "llama3_json": Llama3JsonFormat(),
    "mistral": MistralFormat(),
    "qwen3_coder": Qwen3CoderFormat(),
    "openai": HarmonyFormat(),
}
AUTO, NONE = "auto", "none"
REASONING_CHOICES = (AUTO, NONE, *REASONING_PARSERS)
TOOL_CALL_CHOICES = (AUTO, *TOOL_CALL_PARSERS)


def _source(template: Any) -> str:
    if isinstance(template, Mapping):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def reasoning_parser_name(template: Any, flag: str | None = None) -> str | None:
    """The reasoning parser's name: ``flag``'s, or the template's (None: none)."""
    if flag not in (None, AUTO):
        return None if flag == NONE else flag
    source = _source(template)
    if "<|channel|>" in source:
        return "gpt_oss"
    if "<think>" in source or "enable_thinking" in source:
        return "qwen3"
    return None


def tool_call_parser_name(template: Any, flag: str | None = None) -> str:
    """The tool-call format's name: ``flag``'s, or the template's."""
    if flag not in (None, AUTO):
        return flag
    source = _source(template)
    if "<|channel|>" in source:
        return "openai"
    if "<function=" in source:
        return "qwen3_coder"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or ("<|start_header_id|>" in source and "tools" in source):
        return "llama3_json"
    return "hermes"


@attrs.frozen
class OutputParsers:
    """How one served model's output is read: its reasoning parser (None:
    none) and its tool-call format."""

    reasoning: ReasoningParser | None
    tools: ToolFormat

    @classmethod
    def for_template(cls, template: Any, reasoning_flag: str | None = None, tool_flag: str | None = None) -> OutputParsers:
        name = reasoning_parser_name(template, reasoning_flag)
        return cls(None if name is None else REASONING_PARSERS[name], TOOL_CALL_PARSERS[tool_call_parser_name(template, tool_flag)])

    def special_tokens(self, with_tools: bool) -> bool:
        """Whether the text must keep special tokens: the markers the
        active parsers read are special tokens in their models' vocabularies."""
        reasoning = self.reasoning is not None and self.reasoning.special_tokens
        return reasoning or (with_tools and getattr(self.tools, "special_tokens", False))
