"""Tensor parallelism over gloo: ranks as real processes on this machine.

Each test forms a real group (spawned ranks, a TCP rendezvous on
127.0.0.1), so each costs a few seconds of process start; the models are
tiny random checkpoints saved with transformers, except the default
model's test (slow). What they check:

- logits of TP=2 against TP=1 within 1e-4, step by step through chunked
  prefills and decodes, on Llama, Mistral with one KV head (replicated on
  both ranks), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Phi-3 (fused
  matrices, longrope, partial rotary) and SmolLM3 (layers without rope);
- the embedded engine and ``trioserve serve --tensor-parallel-size 2``
  produce TP=1's greedy tokens, and leave no rank behind, after a clean
  exit and after SIGKILL of the server;
- two "machines" (a ``trioserve worker`` process tree beside the engine)
  give TP=1's greedy output;
- the errors come before anything starts.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs
import httpx
import psutil
import pytest
import torch
import transformers
import trio

from trioserve.actors import open_engine
from trioserve.bench.process import serving_process
from trioserve.engine.config import EngineConfig
from trioserve.engine.parallel.distributed import DistributedError, free_port
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.engine.sampling.structured_output import StructuredOutput
from trioserve.engine.parallel.tensor_parallel import TPShard, check_tensor_parallel
from trioserve.engine.loading.sources import read_model_config, resolve_checkpoint
from trioserve.testing.tiny_model import tokenizer

TRIOSERVE = str(Path(sys.executable).parent / "trioserve")
PROMPT_LENS = (11, 30, 5)


def _configs() -> dict:
    common = dict(vocab_size=203, max_position_embeddings=256, num_hidden_layers=2)
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # the newer families' defaults lie past 203
    return {
        "llama": transformers.LlamaConfig(
            **common, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, tie_word_embeddings=True, attention_bias=True,
        ),
        # One KV head, so with two ranks it is replicated on both.
        "mistral": transformers.MistralConfig(
            **common, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
            tie_word_embeddings=False, sliding_window=None,
        ),
        "qwen2": transformers.Qwen2Config(
            **common, hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
            tie_word_embeddings=False, use_sliding_window=False,
        ),
        # q/k RMSNorm over each head: replicated, applied to a rank's own heads.
        "qwen3": transformers.Qwen3Config(
            **common, **ids, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=24, tie_word_embeddings=False, use_sliding_window=False,
        ),
        # Fused qkv_proj and gate_up_proj, split by the loader before sharding;
        # longrope with partial rotary.
        "phi3": transformers.Phi3Config(
            **common, **ids, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=False, partial_rotary_factor=0.5, original_max_position_embeddings=64,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [2.0, 3.0, 4.0, 8.0],
                             "original_max_position_embeddings": 64},
        ),
        # Every other layer without rope.
        "smollm3": transformers.SmolLM3Config(
            **common, **ids, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            tie_word_embeddings=True, no_rope_layer_interval=2,
        ),
    }  # fmt: skip


def _save(kind: str, path: Path) -> Path:
    """A random ``kind`` checkpoint with peaked logits, and a tokenizer."""
    torch.manual_seed(0)
    config = _configs()[kind]
    hf = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
          "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
          "phi3": transformers.Phi3ForCausalLM, "smollm3": transformers.SmolLM3ForCausalLM}[kind](config)  # fmt: skip
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(2.0 * torch.randn_like(p) / math.sqrt(p.shape[1]))
    hf.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {kind: _save(kind, root / kind) for kind in _configs()}


def _config(path: Path, **fields) -> EngineConfig:
    # A float32 cache: a 16-bit one rounds keys and values that each rank
    # computes with its own summation order, which moves logits past 1e-4.
    base = dict(model=str(path), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                warm_up=False, kv_cache_memory=1 << 30, num_threads=1, kv_cache_dtype="float32")  # fmt: skip
    return EngineConfig(**{**base, **fields})


def _prompts(vocab: int) -> list[list[int]]:
    return [[(i * 37 + j * 11) % (vocab - 1) + 1 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return out


def _ranks_of(process: psutil.Process) -> list[psutil.Process]:
    return [p for p in process.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3"])
def test_logits_match_one_rank(kind, checkpoints):
    """Every step's logits (chunked prefills of three prompts, then decodes
    beside them) within 1e-4 of TP=1's; then the ranks exit on close."""
    one = EngineCore.from_config(_config(checkpoints[kind]))
    two = EngineCore.from_config(_config(checkpoints[kind], tensor_parallel_size=2))
    ranks = _ranks_of(psutil.Process())
    assert len(ranks) == 1
    try:
        for i, ids in enumerate(_prompts(one.model_config.vocab_size)):
            one.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        worst, steps, decodes = 0.0, 0, 0
        while one.has_unfinished():
            plan = one.schedule()
            with torch.inference_mode():
                expected = one.runner.forward(plan.plan)
            got = two.runner.logits(plan.plan)
            assert got.shape == expected.shape
            worst = max(worst, (got - expected).abs().max().item())
            decodes += any(c.is_decode for c in plan.plan.chunks)
            steps += 1
            one.process_output(plan, one.execute(plan))  # the same keys and values again
        assert steps > 8 and decodes > 4
        assert worst < 1e-4
    finally:
        two.close()
    gone, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive


def test_open_engine_greedy_matches_one_rank_and_stops_its_ranks(checkpoints):
    """The actors' engine on TP=2 streams TP=1's greedy tokens; leaving
    ``open_engine`` stops the rank process."""
    path = checkpoints["qwen2"]
    prompts = _prompts(203)
    expected = _greedy(EngineCore.from_config(_config(path)), prompts, 16)
    assert len({t for tokens in expected.values() for t in tokens}) > 5  # not one token repeated
    ranks: list[psutil.Process] = []

    async def main() -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        async with open_engine(_config(path, tensor_parallel_size=2)) as engine:
            ranks.extend(_ranks_of(psutil.Process()))

            async def one(i: int, ids: list[int]) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
                tokens = []
                async for output in engine.generate(ids, params, request_id=f"r{i}"):
                    tokens += output.new_token_ids
                got[f"r{i}"] = tokens

            async with trio.open_nursery() as nursery:
                for i, ids in enumerate(prompts):
                    nursery.start_soon(one, i, ids)
        return got

    assert trio.run(main) == expected
    assert len(ranks) == 1
    gone, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive


def test_structured_output_is_masked_on_rank_zero_beside_the_forward(checkpoints):
    """A constrained request through the actors on TP=2 (its mask filled
    while every rank runs the forward; rank 0 samples with it) gets the
    tokens the offline TP=1 engine gives (the mask filled before the step)."""
    path = checkpoints["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_output=StructuredOutput.regex("[a-c]{2,6}"))
    prompts = _prompts(203)
    one = EngineCore.from_config(_config(path))
    expected: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        one.add_request(f"r{i}", ids, params)
    while one.has_unfinished():
        for o in one.step():
            expected[o.request_id] += o.new_token_ids

    async def main() -> dict[str, list[int]]:
        got: dict[str, list[int]] = {}
        async with open_engine(_config(path, tensor_parallel_size=2)) as engine:

            async def run(i: int, ids: list[int]) -> None:
                got[f"r{i}"] = [t async for o in engine.generate(ids, params, request_id=f"r{i}") for t in o.new_token_ids]

            async with trio.open_nursery() as nursery:
                for i, ids in enumerate(prompts):
                    nursery.start_soon(run, i, ids)
        return got

    assert trio.run(main) == expected
    for tokens in expected.values():
        assert re.fullmatch("[a-c]{2,6}", one.tokenizer.decode(tokens, skip_special_tokens=True))


def test_serve_tensor_parallel_and_sigkill_leaves_no_rank(checkpoints, tmp_path):
    """``trioserve serve --tensor-parallel-size 2`` answers with TP=1's
    greedy completion; SIGKILL of the server takes its rank with it."""
    path = checkpoints["llama"]
    core = EngineCore.from_config(_config(path))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt = [50, 17, 142, 99, 3, 77]  # ids: the tokenizer's text would fall outside the tiny vocabulary
    core.add_request("r0", prompt, params)
    expected = "".join(o.text_delta for _ in range(40) if core.has_unfinished() for o in core.step())
    assert not core.has_unfinished() and expected
    flags = ["--model", str(path), "--tensor-parallel-size", "2", "--num-threads", "1", "--max-model-len", "128",
             "--kv-cache-memory", "64M", "--block-size", "4"]  # fmt: skip
    with serving_process(flags, log=tmp_path / "serve.log") as (url, proc):
        ranks = _ranks_of(psutil.Process(proc.pid))
        assert len(ranks) == 1
        body = {"model": path.name, "prompt": prompt, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["text"]
        assert text == expected
        proc.kill()
        proc.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive


def test_two_nodes_on_loopback_match_one_rank(checkpoints, tmp_path):
    """Node 1 is a ``trioserve worker`` process tree; node 0 the engine.
    Greedy output equals TP=1's; stopping the engine ends the worker."""
    path = checkpoints["mistral"]
    prompts = _prompts(203)
    expected = _greedy(EngineCore.from_config(_config(path)), prompts, 12)
    assert len({t for tokens in expected.values() for t in tokens}) > 5
    port = free_port()
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [TRIOSERVE, "worker", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--device", "cpu", "--num-threads", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        core = EngineCore.from_config(_config(path, tensor_parallel_size=2, nnodes=2, master_port=port))
        try:
            assert _greedy(core, prompts, 12) == expected
        finally:
            core.close()
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        log.close()


# -- errors before anything starts ---------------------------------------------------


def test_sizes_that_do_not_split_the_model_are_refused_naming_its_heads(checkpoints):
    folder, _ = resolve_checkpoint(None)
    smollm = read_model_config(folder)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's 9 attention heads"):
        check_tensor_parallel(smollm, 2)
    check_tensor_parallel(smollm, 3)
    # Before any rank starts: no child process is made.
    with pytest.raises(ValueError, match="9 attention heads"):
        EngineCore.from_config(EngineConfig(tensor_parallel_size=2))
    assert not _ranks_of(psutil.Process())
    qwen2 = read_model_config(checkpoints["qwen2"])  # 6 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"neither divides the model's 2 KV heads"):
        check_tensor_parallel(qwen2, 3)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_tensor_parallel(qwen2, 6)  # 80 features
    # What the shards do not split yet is refused by name, not run wrong.
    mixture = attrs.evolve(qwen2, moe_routing="mixtral", num_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"is not split across ranks \(moe_routing='mixtral'\)"):
        check_tensor_parallel(mixture, 2)
    check_tensor_parallel(mixture, 1)
    gemma_like = attrs.evolve(qwen2, sandwich_norms=True, hidden_act="gelu_pytorch_tanh")
    with pytest.raises(ValueError, match="sandwich_norms=True, hidden_act='gelu_pytorch_tanh'"):
        check_tensor_parallel(gemma_like, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must be a multiple of nnodes \(2\)"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="master_port is required"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)


def test_shards_partition_heads_features_and_vocabulary(checkpoints):
    """Across the ranks, every query head, feature and vocabulary row is held
    once; a KV head is held by the ranks whose query heads read it."""
    config = read_model_config(checkpoints["mistral"])  # 4 heads, 1 KV head
    for size in (1, 2, 4):
        shards = [TPShard(config, r, size) for r in range(size)]
        heads = [h for s in shards for h in range(s.first_head, s.first_head + s.num_heads)]
        assert heads == list(range(config.num_attention_heads))
        group = config.num_attention_heads // config.num_key_value_heads
        for s in shards:
            assert s.first_kv_head == s.first_head // group and s.num_kv_heads == 1
        assert [x for s in shards for x in range(*s.intermediate)] == list(range(config.intermediate_size))
        rows = [x for s in shards for x in range(*s.vocab)]
        assert rows[: config.vocab_size] == list(range(config.vocab_size)) and len(rows) % size == 0


def test_unreachable_master_is_a_timeout_naming_the_address():
    """A worker whose master never answers fails within its timeout with
    the address in the message; it starts no rank."""
    port = free_port()  # nothing listens there
    start = time.monotonic()
    result = subprocess.run(
        [TRIOSERVE, "worker", "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--distributed-timeout", "2", "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port} did not answer within 2 s" in result.stderr
    assert time.monotonic() - start < 60


def test_rank_zero_waiting_for_a_missing_node_times_out_naming_the_address(checkpoints):
    """The engine's side: a second machine that never joins ends the
    rendezvous after ``distributed_timeout`` with the address named."""
    port = free_port()
    config = _config(checkpoints["qwen2"], tensor_parallel_size=2, nnodes=2, master_port=port, distributed_timeout=3)
    with pytest.raises(DistributedError, match=f"rendezvous at 127.0.0.1:{port} failed within 3 s"):
        EngineCore.from_config(config)
    assert not _ranks_of(psutil.Process())


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers.",
]


@pytest.mark.slow
def test_default_model_greedy_output_identical_at_three_ranks():
    """SmolLM2-135M (9 heads, 3 KV heads) on three ranks: the same greedy
    64 tokens as one rank for four chat prompts."""
    # float32 cache, as in _config: the ranks' own rounding must not decide a
    # near-tie; the float weights the ranks load (a GGUF is dequantized for them).
    fields = dict(max_model_len=512, max_num_seqs=4, kv_cache_memory=64 << 20, warm_up=False, num_threads=1,
                  kv_cache_dtype="float32", quantization="none")  # fmt: skip
    prompts = [[{"role": "user", "content": text}] for text in CHATS]

    def run(core: EngineCore) -> list[list[int]]:
        ids = [core.tokenize(p) for p in prompts]
        try:
            return list(_greedy(core, ids, 64).values())
        finally:
            core.close()

    expected = run(EngineCore.from_config(EngineConfig(**fields)))
    assert run(EngineCore.from_config(EngineConfig(**fields, tensor_parallel_size=3))) == expected


def test_the_worker_takes_its_machine_and_master_from_launcher_variables(monkeypatch):
    from trioserve.web.cli import build_parser

    for name in ("NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):  # no index anywhere: --node-rank is required
        build_parser().parse_args(["worker", "--tensor-parallel-size", "2", "--nnodes", "2"])
    monkeypatch.setenv("GROUP_RANK", "1")  # torchrun's name for the machine's index
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    args = build_parser().parse_args(["worker", "--tensor-parallel-size", "2", "--nnodes", "2"])
    assert (args.node_rank, args.master_addr, args.master_port) == (1, "10.0.0.1", 29555)
    monkeypatch.setenv("NODE_RANK", "2")
    args = build_parser().parse_args(["worker", "--tensor-parallel-size", "3", "--nnodes", "3", "--node-rank", "1"])
    assert args.node_rank == 1  # the flag wins over the environment
    assert build_parser().parse_args(["worker", "--tensor-parallel-size", "3", "--nnodes", "3"]).node_rank == 2
