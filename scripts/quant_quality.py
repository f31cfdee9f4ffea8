"""Quality of the compressed paths on a model (the default one unless
``--model``, e.g. another GGUF of it): perplexity over
tests/data/quality_text.txt, the largest logit difference from the float32
path (which dequantizes the same GGUF exactly), and greedy agreement over
4 x 64 tokens (teacher-forced on float32's continuation, and free-running).

    .venv/bin/python scripts/quant_quality.py [--quantization int8 int4 auto] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trioserve.engine.loading.loader import load_model
from trioserve.testing.quality import greedy_tokens, perplexity, prompt_logits

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "quality_text.txt"
PROMPTS = (
    "The history of the lighthouse begins",
    "Write a short poem about the sea at night.",
    "List three uses of copper and explain each.",
    "def fibonacci(n):",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", nargs="+", default=["int8", "int4"], help="compressed paths to compare")
    parser.add_argument("--model", default=None, help="a model path (default: the default model)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    reference = load_model(args.model, quantization="none")
    ids = reference.tokenizer(TEXT.read_text())["input_ids"]
    ref = prompt_logits(reference.model, ids)
    ref_greedy = {p: greedy_tokens(reference.model, reference.tokenizer(p)["input_ids"], 64) for p in PROMPTS}
    del reference  # one model at a time
    print(f"{len(ids)} tokens; float32 perplexity {perplexity(ref, ids):.4f}")
    for q in args.quantization:
        loaded = load_model(args.model, quantization=q)
        logits = prompt_logits(loaded.model, ids)
        ppl = perplexity(logits, ids)
        free = forced = 0
        for p, want in ref_greedy.items():
            prompt = loaded.tokenizer(p)["input_ids"]
            got = greedy_tokens(loaded.model, prompt, 64)
            free += sum(a == b for a, b in zip(got, want))
            teacher = prompt_logits(loaded.model, prompt + want)[len(prompt) - 1 : -1].argmax(-1).tolist()
            forced += sum(a == b for a, b in zip(teacher, want))
        print(
            f"{q}: {loaded.projection_choice.summary}; perplexity {ppl:.4f} ({ppl / perplexity(ref, ids) - 1:+.2%}); "
            f"max |logit - float32| {(logits - ref).abs().max().item():.4f} (float32 logits span "
            f"{ref.abs().max().item():.1f}); greedy agreement teacher-forced {forced}/256, free-running {free}/256"
        )


if __name__ == "__main__":
    main()
