"""``trioserve bench quality``: the quality of the compressed paths on a
model (the default one unless ``--model``, e.g. another GGUF of it):
perplexity over a text, the largest logit difference from the float32 path
(which dequantizes the same GGUF exactly), and greedy agreement over
4 x 64 tokens (teacher-forced on float32's continuation, and free-running).

The text is the test suite's, tests/data/quality_text.txt, unless
``--text``; tests/test_quant_quality.py holds the default model's paths to
the same figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trioserve.engine.loading.loader import load_model
from trioserve.testing.quality import greedy_tokens, perplexity, prompt_logits

from ..arguments import positive_int, usage_error

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "quality_text.txt"
PROMPTS = (
    "The history of the lighthouse begins",
    "Write a short poem about the sea at night.",
    "List three uses of copper and explain each.",
    "def fibonacci(n):",
)
TOKENS = 64


def add_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser(
        "quality",
        help="perplexity and greedy agreement of the compressed paths against float32",
        description=__doc__.split("\n\n")[0].removeprefix("``trioserve bench quality``: "),
        epilog=__doc__.split("\n\n", 1)[1],
    )
    model = p.add_argument_group("model")
    model.add_argument("--quantization", nargs="+", default=["int8", "int4"],
                       help="compressed paths to compare, as serve's --quantization (default: int8 int4)")  # fmt: skip
    model.add_argument("--model", default=None, help="a model path (default: the default model)")
    work = p.add_argument_group("workload")
    work.add_argument("--text", type=Path, default=TEXT, help="the text of the perplexity (default: the tests')")
    work.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if not args.text.is_file():
        return usage_error("quality", f"no text at {args.text} (a checkout's tests/data; give --text)")
    torch.set_num_threads(args.threads)
    reference = load_model(args.model, quantization="none")
    ids = reference.tokenizer(args.text.read_text())["input_ids"]
    ref = prompt_logits(reference.model, ids)
    ref_greedy = {p: greedy_tokens(reference.model, reference.tokenizer(p)["input_ids"], TOKENS) for p in PROMPTS}
    del reference  # one model at a time
    total = TOKENS * len(PROMPTS)
    print(f"{len(ids)} tokens; float32 perplexity {perplexity(ref, ids):.4f}")
    for q in args.quantization:
        loaded = load_model(args.model, quantization=q)
        logits = prompt_logits(loaded.model, ids)
        ppl = perplexity(logits, ids)
        free = forced = 0
        for p, want in ref_greedy.items():
            prompt = loaded.tokenizer(p)["input_ids"]
            got = greedy_tokens(loaded.model, prompt, TOKENS)
            free += sum(a == b for a, b in zip(got, want))
            teacher = prompt_logits(loaded.model, prompt + want)[len(prompt) - 1 : -1].argmax(-1).tolist()
            forced += sum(a == b for a, b in zip(teacher, want))
        print(
            f"{q}: {loaded.projection_choice.summary}; perplexity {ppl:.4f} ({ppl / perplexity(ref, ids) - 1:+.2%}); "
            f"max |logit - float32| {(logits - ref).abs().max().item():.4f} (float32 logits span "
            f"{ref.abs().max().item():.1f}); greedy agreement teacher-forced {forced}/{total}, "
            f"free-running {free}/{total}"
        )
    return 0
