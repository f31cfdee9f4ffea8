"""The engine on CUDA against the engine on CPU (skipped without CUDA).

One tiny random-weight Llama (``_save_tiny("llama")``: head_dim != hidden /
heads, llama3 RoPE, attention biases, tied embeddings) with a word-level
tokenizer is loaded through ``load_model`` twice, float32 on CPU and float32
on CUDA (TF32 off, see conftest). The same mixed workload through
``EngineCore`` on each (chunked prefill sharing steps with decodes, prefix
cache hits, ``n > 1``, penalties, logit bias, logprobs, priorities) must give
the same greedy tokens. bfloat16 and float16 must run on CUDA, the KV cache
must live there, and the actors must drive a CUDA model from their worker
thread.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import trio
from conftest import make_core
from test_model_equivalence import _save_tiny

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.loading.loader import LoadedModel, load_model
from trioserve.engine.sampling.sampler import Sampler
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.rows import SamplingRow
from trioserve.testing.tiny_model import write_word_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BLOCK_SIZE = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny("llama", folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    write_word_tokenizer(folder, vocab)
    return folder


@pytest.fixture(scope="module")
def cpu_loaded(checkpoint) -> LoadedModel:
    return load_model(str(checkpoint), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def cuda_loaded(checkpoint) -> LoadedModel:
    return load_model(str(checkpoint), dtype="float32", device="cuda")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _run_all(core: EngineCore) -> dict[tuple[str, int], dict]:
    results: dict[tuple[str, int], dict] = {}
    while core.has_unfinished():
        for out in core.step():
            entry = results.setdefault((out.request_id, out.index), {"tokens": [], "logprobs": [], "text": ""})
            entry["tokens"].extend(out.new_token_ids)
            entry["logprobs"].extend(out.logprobs)
            entry["text"] += out.text_delta
            if out.finished:
                entry["finish"] = out.finish_reason
                entry["num_cached_tokens"] = out.num_cached_tokens
    return results


def _workload(loaded: LoadedModel) -> tuple[dict, dict, EngineCore]:
    """Two rounds through one EngineCore; return each round's results and the core.

    Round 1: long prompts cut into chunks by a 32-token budget that share
    steps with short prompts' decodes, more requests than sequences, n=2,
    penalties with a logit bias, logprobs, priorities. Round 2: prompts that
    share full blocks with round 1's, so they hit the prefix cache.
    """
    vocab = loaded.model_config.vocab_size
    rng = random.Random(11)
    # A float32 cache on both devices: "auto" rounds keys and values to 16
    # bits on CPUs that convert fast, which moves top logprobs by ~1e-2.
    core = make_core(loaded, block_size=BLOCK_SIZE, max_num_batched_tokens=32, max_num_seqs=6, kv_cache_dtype="float32")
    long0, long1 = _prompt(rng, 70, vocab), _prompt(rng, 45, vocab)
    first = [
        ("long0", long0, SamplingParams(max_tokens=12, **GREEDY), 0),
        ("long1", long1, SamplingParams(max_tokens=10, **GREEDY), 0),
        ("n2", _prompt(rng, 20, vocab), SamplingParams(n=2, max_tokens=9, **GREEDY), 0),
        ("pen", _prompt(rng, 13, vocab),
         SamplingParams(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                        logit_bias={5: 4.0, 7: -100.0}, **GREEDY), 0),
        ("lp", _prompt(rng, 9, vocab), SamplingParams(max_tokens=8, logprobs=3, **GREEDY), 0),
        ("min", _prompt(rng, 6, vocab), SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0), 0),
        *[(f"s{i}", _prompt(rng, 3 + 2 * i, vocab), SamplingParams(max_tokens=14 - i, **GREEDY), i % 2)
          for i in range(5)],
    ]  # fmt: skip
    for request_id, prompt, params, priority in first:
        core.add_request(request_id, prompt, params, priority=priority)
    round1 = _run_all(core)
    hits_before = core.block_manager.statistics().prefix_cache_hits
    second = [
        ("again0", long0[:64] + _prompt(rng, 5, vocab), SamplingParams(max_tokens=7, **GREEDY)),
        ("again1", list(long1), SamplingParams(max_tokens=5, **GREEDY)),
    ]
    for request_id, prompt, params in second:
        core.add_request(request_id, prompt, params)
    round2 = _run_all(core)
    assert core.block_manager.statistics().prefix_cache_hits > hits_before
    return round1, round2, core


def _comparable(results: dict) -> dict:
    return {
        key: (r["tokens"], r["text"], r["finish"], r["num_cached_tokens"], [lp.token_id for lp in r["logprobs"]])
        for key, r in results.items()
    }


def test_engine_core_greedy_outputs_on_cuda_equal_cpu(cpu_loaded, cuda_loaded):
    assert cuda_loaded.device.type == "cuda" and cpu_loaded.device.type == "cpu"
    cpu1, cpu2, _ = _workload(cpu_loaded)
    cuda1, cuda2, core = _workload(cuda_loaded)
    assert core.kv_cache.key.device.type == "cuda" and core.kv_cache.value.device.type == "cuda"
    assert _comparable(cuda1) == _comparable(cpu1)
    assert _comparable(cuda2) == _comparable(cpu2)
    # Both completions of the greedy n=2 request are the same; the second reads the prompt from the cache.
    assert cuda1[("n2", 0)]["tokens"] == cuda1[("n2", 1)]["tokens"]
    assert cuda1[("n2", 1)]["num_cached_tokens"] > 0
    assert cuda2[("again0", 0)]["num_cached_tokens"] == 64
    assert cuda2[("again1", 0)]["num_cached_tokens"] == 40  # the full blocks of 45 tokens
    assert 7 not in cuda1[("pen", 0)]["tokens"]
    for key, r in cuda1.items():
        assert len(r["tokens"]) > 0, key
    lp_cuda, lp_cpu = cuda1[("lp", 0)]["logprobs"], cpu1[("lp", 0)]["logprobs"]
    assert len(lp_cuda) == 8
    for a, b in zip(lp_cuda, lp_cpu):
        assert abs(a.logprob - b.logprob) < 1e-3
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(a.top, b.top))


def test_forward_logits_on_cuda_match_cpu(cpu_loaded, cuda_loaded):
    """One mixed batch (a prefill from 0, a chunk after a cached prefix,
    decodes of several context lengths) gives the same float32 logits."""
    config = cpu_loaded.model_config
    rng = random.Random(3)
    tables = [[9, 2, 14], [5, 0, 11, 7], [3], [12, 1, 6], [4, 8]]
    prefix = [_prompt(rng, n, config.vocab_size) for n in (0, 13, 4, 20, 9)]
    step = [
        _prompt(rng, 17, config.vocab_size),
        _prompt(rng, 6, config.vocab_size),
        [1],
        [2],
        [3],
    ]
    logits = {}
    for loaded in (cpu_loaded, cuda_loaded):
        kv = KVCache.allocate(config, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float32, device=loaded.device)
        with torch.inference_mode():
            warm = [SeqChunk(p, 0, t, 0) for p, t in zip(prefix, tables) if p]
            loaded.model(ForwardBatch.build(warm, block_size=BLOCK_SIZE, device=loaded.device), kv)
            chunks = [SeqChunk(s, len(p), t, len(s)) for p, s, t in zip(prefix, step, tables)]
            out = loaded.model(ForwardBatch.build(chunks, block_size=BLOCK_SIZE, device=loaded.device), kv)
        assert out.device.type == loaded.device.type and out.dtype == torch.float32
        logits[loaded.device.type] = out.cpu()
    scale = logits["cpu"].abs().max()
    assert scale > 1.0
    assert (logits["cuda"] - logits["cpu"]).abs().max() < 1e-4 * max(1.0, float(scale) / 10)


def test_sampler_on_cuda_matches_cpu_for_deterministic_stages():
    vocab = 50
    torch.manual_seed(5)
    logits = torch.randn(6, vocab) * 4

    def states():
        params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
            SamplingParams(temperature=0.0, logit_bias={11: 50.0}),
            SamplingParams(temperature=0.0, min_tokens=3, logprobs=4),
            SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, seed=42, logprobs=2),
            SamplingParams(temperature=1.0, top_k=1, seed=7),
        ]
        prompt = [int(logits[1].argmax()), 3, 4]
        output = [int(logits[1].argmax())] * 2
        eos = (int(logits[3].argmax()),)
        return [SamplingRow.for_sequence(f"row{i}", p, prompt, output, eos) for i, p in enumerate(params)]

    cpu = Sampler(vocab, "cpu").sample(logits, states())
    cuda_sampler = Sampler(vocab, "cuda")
    cuda = cuda_sampler.sample(logits.cuda(), states())
    # Every row but the seeded temperature-0.7 one is deterministic.
    for row in (0, 1, 2, 3, 5):
        assert cuda.token_ids[row] == cpu.token_ids[row], row
    assert cuda.token_ids[2] == 11
    assert cuda.token_ids[3] != int(logits[3].argmax())  # EOS masked until min_tokens
    top3 = logits[4].topk(3).indices.tolist()
    assert cuda.token_ids[4] in top3
    # A seeded row is reproducible on CUDA.
    again = Sampler(vocab, "cuda").sample(logits.cuda(), states())
    assert again.token_ids == cuda.token_ids
    for row in (3, 4):
        a, b = cuda.logprobs[row], cpu.logprobs[row]
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_on_cuda(checkpoint, cuda_loaded, dtype):
    loaded = load_model(str(checkpoint), dtype=dtype, device="cuda")
    assert loaded.dtype == getattr(torch, dtype)
    assert {p.device.type for p in loaded.model.parameters()} == {"cuda"}
    core = make_core(loaded, block_size=BLOCK_SIZE, max_num_batched_tokens=32)
    assert core.kv_cache.key.dtype == getattr(torch, dtype) and core.kv_cache.key.device.type == "cuda"
    rng = random.Random(1)
    vocab = loaded.model_config.vocab_size
    prompts = {f"h{i}": _prompt(rng, 5 + 11 * i, vocab) for i in range(4)}
    for request_id, prompt in prompts.items():
        core.add_request(request_id, prompt, SamplingParams(max_tokens=10, **GREEDY))
    seeded = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=10, ignore_eos=True)
    core.add_request("seeded", prompts["h1"], seeded)
    results = _run_all(core)
    assert len(results) == 6
    for key, r in results.items():
        assert len(r["tokens"]) == 10, key
        assert all(0 <= t < vocab for t in r["tokens"]), key
    # Half precision tracks float32: a prefill's logits within a few percent of the range.
    logits = {}
    for model_loaded in (loaded, cuda_loaded):
        kv = KVCache.allocate(
            model_loaded.model_config, num_blocks=4, block_size=BLOCK_SIZE, dtype=model_loaded.dtype, device="cuda"
        )
        chunk = SeqChunk(prompts["h1"], 0, [2, 0], len(prompts["h1"]))
        batch = ForwardBatch.build([chunk], block_size=BLOCK_SIZE, device="cuda")
        with torch.inference_mode():
            logits[model_loaded.dtype] = model_loaded.model(batch, kv).cpu()
    assert logits[loaded.dtype].dtype == torch.float32
    scale = logits[torch.float32].abs().max()
    assert (logits[loaded.dtype] - logits[torch.float32]).abs().max() < 0.03 * scale


def test_default_device_dtype_and_kv_budget_on_cuda(checkpoint):
    """No device given: CUDA and bfloat16; the KV pool from a fraction of free
    GPU memory, capped at max_num_seqs full contexts."""
    config = EngineConfig(model=str(checkpoint), max_num_seqs=4, block_size=BLOCK_SIZE)
    core = EngineCore.from_config(config)
    assert core.loaded.device.type == "cuda" and core.loaded.dtype == torch.bfloat16
    wanted = 4 * config.blocks_per_sequence(core.model_config)
    assert core.kv_cache.num_blocks == wanted
    assert core.kv_cache.key.device.type == "cuda"
    core.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, **GREEDY))
    assert len(_run_all(core)[("r", 0)]["tokens"]) == 4


def test_actors_drive_a_cuda_model_from_their_worker_thread(cpu_loaded, cuda_loaded):
    """open_engine on the CUDA model: the step runs in the executor's thread;
    the outputs equal EngineCore's on CPU."""
    from trioserve.actors import open_engine

    rng = random.Random(8)
    vocab = cuda_loaded.model_config.vocab_size
    items = [(f"a{i}", _prompt(rng, 4 + 9 * i, vocab), SamplingParams(max_tokens=6 + i, **GREEDY)) for i in range(6)]
    config = EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=16 << 20, max_num_seqs=4, max_num_batched_tokens=32)

    direct = EngineCore(cpu_loaded, config)
    for request_id, prompt, params in items:
        direct.add_request(request_id, prompt, params)
    expected = {key[0]: r["tokens"] for key, r in _run_all(direct).items()}

    got: dict[str, list[int]] = {}

    async def main() -> None:
        with trio.fail_after(120):
            await serve()

    async def serve() -> None:
        async with open_engine(config, loaded=cuda_loaded) as engine:

            async def one(request_id, prompt, params) -> None:
                tokens = []
                async for out in engine.generate(prompt, params, request_id=request_id):
                    tokens.extend(out.new_token_ids)
                got[request_id] = tokens

            async with trio.open_nursery() as nursery:
                for item in items:
                    nursery.start_soon(one, *item)

    trio.run(main)
    assert got == expected


# Families whose layers differ from Llama's, on CUDA: Gemma 3's sliding
# layers (a KV group of their own) and soft-capped scores, gpt-oss's sinks,
# windows and experts, Qwen3-MoE's grouped experts, Phi-3's partial rotary.
FAMILIES = ("gemma3", "gpt-oss", "qwen3-moe", "phi3")


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_family_on_cuda_equals_cpu(tmp_path, kind):
    """The mixed workload (prompts past every window, prefix-cache hits)
    gives the same greedy tokens on CUDA as on CPU, for each family."""
    _save_tiny(kind, tmp_path)
    write_word_tokenizer(tmp_path, json.loads((tmp_path / "config.json").read_text())["vocab_size"])
    cpu1, cpu2, _ = _workload(load_model(str(tmp_path), dtype="float32", device="cpu"))
    cuda1, cuda2, core = _workload(load_model(str(tmp_path), dtype="float32", device="cuda"))
    assert core.kv_cache.key.device.type == "cuda"
    assert {k: r["tokens"] for k, r in cuda1.items()} == {k: r["tokens"] for k, r in cpu1.items()}
    # The same tokens after a prefix-cache hit; how much a hit finds may
    # differ (a CPU pool reuses written blocks first, evicting sooner).
    assert {k: r["tokens"] for k, r in cuda2.items()} == {k: r["tokens"] for k, r in cpu2.items()}
    assert cuda2[("again0", 0)]["num_cached_tokens"] == 64
