"""The compressed paths' quality on the default model (issue 13): perplexity
over a fixed text of 2,705 tokens (tests/data/quality_text.txt) within 2% of
the float32 path, greedy top-1 agreement on 4 x 64 tokens of at least 90%, and
the logits' largest difference from the float32 path, which dequantizes the
same GGUF exactly (so only the kernel differs; trioserve bench quality
prints the figures)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trioserve.engine.loading.loader import load_model
from trioserve.testing.quality import greedy_tokens, perplexity, prompt_logits

TEXT = Path(__file__).parent / "data" / "quality_text.txt"
PROMPTS = (
    "The history of the lighthouse begins",
    "Write a short poem about the sea at night.",
    "List three uses of copper and explain each.",
    "def fibonacci(n):",
)


@pytest.fixture(scope="module")
def reference(default_loaded):
    """The float32 path's logits over the text and greedy tokens after each prompt."""
    ids = default_loaded.tokenizer(TEXT.read_text())["input_ids"]
    assert len(ids) >= 2000
    greedy = {p: greedy_tokens(default_loaded.model, default_loaded.tokenizer(p)["input_ids"], 64) for p in PROMPTS}
    return ids, prompt_logits(default_loaded.model, ids), greedy


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_compressed_default_model_keeps_perplexity_and_greedy_choices(reference, scheme):
    ids, ref_logits, ref_greedy = reference
    loaded = load_model(None, quantization=scheme)
    assert loaded.projection_choice.quantization == scheme
    logits = prompt_logits(loaded.model, ids)
    ref_ppl, ppl = perplexity(ref_logits, ids), perplexity(logits, ids)
    assert abs(ppl / ref_ppl - 1) <= 0.02, (ppl, ref_ppl)
    # Not equal: the kernels sum in another order (and int8 rounds the Q4_1
    # weights once more), so a test that they match would fail; the largest
    # difference over 2,705 x 49,152 logits is a tail figure, bounded here
    # and printed (pytest -s) for docs/benchmarks.md.
    diff = (logits - ref_logits).abs().max().item()
    print(f"{scheme}: perplexity {ppl:.4f} vs {ref_ppl:.4f}, max logit difference {diff:.4f}")
    assert 0 < diff < 0.1 * ref_logits.abs().max()
    # Chunks of 512 run torch's GEMM over the dequantized matrices; in chunks
    # of 100 the native kernels' panels run (csrc/panel.h, with bfloat16
    # products where the CPU has AVX512_BF16), as in a batch of decode steps.
    panel_ppl = perplexity(prompt_logits(loaded.model, ids, chunk=100), ids)
    print(f"{scheme}: perplexity in chunks of 100 tokens {panel_ppl:.4f}")
    assert abs(panel_ppl / ref_ppl - 1) <= 0.02, (panel_ppl, ref_ppl)
    agree = agree_rows = 0
    for prompt, want in ref_greedy.items():
        p = loaded.tokenizer(prompt)["input_ids"]
        # Teacher-forced: the compressed model's top-1 at each of float32's 64 positions.
        got = prompt_logits(loaded.model, p + want)[len(p) - 1 : -1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(got, want, strict=True))
        # ... and one token a forward, as decode steps run: the row kernels
        # (int8 activations for 4-bit weights where the CPU has AVX512_VNNI).
        got = prompt_logits(loaded.model, p + want, chunk=1)[len(p) - 1 : -1].argmax(-1).tolist()
        agree_rows += sum(a == b for a, b in zip(got, want, strict=True))
    print(f"{scheme}: greedy agreement teacher-forced {agree}/256, one token a forward {agree_rows}/256")
    assert agree >= 0.9 * 4 * 64, agree
    assert agree_rows >= 0.9 * 4 * 64, agree_rows
