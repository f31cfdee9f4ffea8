"""Compare llguidance and xgrammar on this machine: compile time of a
mid-size JSON schema and mask time per step, with the default model's
tokenizer. Usage: python scripts/grammar_backends.py [--rows 32] [--steps 40]"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from trioserve.engine.loading import gguf_cache

from trioserve.engine.loading import loader, sources

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active"],
}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@math.org", "tags": ["math", "poetry"],
                   "address": {"street": "12 St James Sq", "city": "London", "zip": "12345"},
                   "role": "admin", "score": 0.97, "active": True})


def _offset(row: int, num_ids: int, steps: int) -> int:
    # Rows start at different points of the document, so their states differ.
    return row % max(1, num_ids - steps)


def bench_llguidance(hf, rows, steps):
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    tok = llguidance.hf.from_tokenizer(hf, n_vocab=49152)
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    err = llguidance.LLMatcher.validate_grammar(grammar, tok)
    m = llguidance.LLMatcher(tok, grammar)
    first = time.perf_counter() - t0
    ids = tok.tokenize_str(TEXT)
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(rows)]
    for r, mt in enumerate(matchers):
        mt.consume_tokens(ids[: _offset(r, len(ids), steps)])
    mask = lnp.allocate_token_bitmask(rows, tok.vocab_size)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        for i, mt in enumerate(matchers):
            lnp.fill_next_token_bitmask(mt, mask, i)
        times.append(time.perf_counter() - t)
        for r, mt in enumerate(matchers):
            assert mt.consume_token(ids[_offset(r, len(ids), steps) + step]), mt.get_error()
    t = time.perf_counter()
    executor = llguidance.LLExecutor()
    par = []
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(rows)]
    for r, mt in enumerate(matchers):
        mt.consume_tokens(ids[: _offset(r, len(ids), steps)])
    for step in range(steps):
        t = time.perf_counter()
        lnp.fill_next_token_bitmask_par(executor, [(mt, i) for i, mt in enumerate(matchers)], mask)
        par.append(time.perf_counter() - t)
        for r, mt in enumerate(matchers):
            mt.consume_token(ids[_offset(r, len(ids), steps) + step])
    return first, times, par, err


def bench_xgrammar(hf, rows, steps):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=49152)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    first = time.perf_counter() - t0
    ids = hf.encode(TEXT, add_special_tokens=False)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
    for r, mt in enumerate(matchers):
        for token in ids[: _offset(r, len(ids), steps)]:
            assert mt.accept_token(token)
    mask = xgr.allocate_token_bitmask(rows, info.vocab_size)
    times = []
    for step in range(steps):
        t = time.perf_counter()
        for i, mt in enumerate(matchers):
            mt.fill_next_token_bitmask(mask, i)
        times.append(time.perf_counter() - t)
        for r, mt in enumerate(matchers):
            assert mt.accept_token(ids[_offset(r, len(ids), steps) + step])
    return first, times, None, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = gguf_cache.ensure_converted(sources.default_model_path(), None)
    # Both backends take a transformers tokenizer (the engine's own is a
    # FastTokenizer, engine/text/fast_tokenizer.py).
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        first, times, par, err = fn(hf, args.rows, args.steps)
        ms = [t * 1000 for t in times]
        line = f"{name}: compile {first * 1000:.1f} ms; mask for {args.rows} rows: median {statistics.median(ms):.2f} ms, mean {statistics.mean(ms):.2f} ms, max {max(ms):.2f} ms"
        if par:
            pms = [t * 1000 for t in par]
            line += f"; parallel median {statistics.median(pms):.2f} ms"
        print(line, "" if not err else err)


if __name__ == "__main__":
    main()
