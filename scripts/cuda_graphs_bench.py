"""Decode steps with and without CUDA graphs (engine/runtime/cuda_graphs.py), on a
random-weight model of SmolLM2-135M's exact shape (the default model's file
is too large to send to a lent GPU machine; greedy decoding with
``ignore_eos`` does the same work whatever the weights).

For each batch size, EngineCore runs that many prompts of --input-len
random tokens to --output-len tokens, greedy, once with ``enforce_eager``
and once with graphs, the two taking turns for --rounds rounds. A decode
step is one in which every running sequence decodes (no prompt chunk); its
time is ``schedule`` + ``execute`` + ``process_output``, sampling and the
read of the tokens to the host included. Also compared: the greedy tokens
of the two modes.

    python scripts/cuda_graphs_bench.py --device cuda --out /tmp/graphs.json
    python scripts/cuda_graphs_bench.py --device cpu --small   # checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from trioserve.engine.config import EngineConfig, ModelConfig, RopeScaling
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import write_word_tokenizer


def smollm2_shape(layers: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        rope_scaling=RopeScaling(),
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def random_model(config: ModelConfig, dtype: torch.dtype, device: torch.device, folder: Path) -> LoadedModel:
    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                scale = 1.0 if "embed" in name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator, device=device) * scale)
    write_word_tokenizer(folder, config.vocab_size)
    tokenizer = FastTokenizer.from_folder(folder)
    return LoadedModel(model, config, tokenizer, "random-smollm2-135m", folder, dtype, device)


def run(loaded: LoadedModel, prompts: list[list[int]], output_len: int, *, enforce_eager: bool) -> dict:
    config = EngineConfig(
        device=str(loaded.device),
        max_num_seqs=len(prompts),
        max_num_batched_tokens=max(2048, sum(map(len, prompts))),
        max_model_len=len(prompts[0]) + output_len + 16,
        enforce_eager=enforce_eager,
        warm_up=False,
        # Enough for the largest batch; not CUDA's default of most of the
        # free memory, for each of the engines this script builds in turn.
        kv_cache_memory=4 << 30,
    )
    core = EngineCore(loaded, config)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"r{i}", ids, params)
    steps: list[float] = []
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while core.has_unfinished():
        step_start = time.perf_counter()
        plan = core.schedule()
        outputs = core.process_output(plan, core.execute(plan))
        elapsed = time.perf_counter() - step_start
        if plan.chunks and len(plan.chunks) == len(prompts) and all(c.num_tokens == 1 for c in plan.chunks):
            steps.append(elapsed * 1000)
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    graphs = core.runner.decode_graphs
    statistics_of_graphs = None if graphs is None else str(graphs.statistics())
    del core, graphs
    gc.collect()  # this engine's KV cache and graphs go before the next one's come
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    steps.sort()
    result = {
        "mode": "eager" if enforce_eager else "graphs",
        "batch": len(prompts),
        "decode_steps": len(steps),
        "step_ms_p50": round(statistics.median(steps), 3),
        "step_ms_p10": round(steps[len(steps) // 10], 3),
        "step_ms_p90": round(steps[len(steps) * 9 // 10], 3),
        "output_tok_per_s": round(sum(map(len, tokens.values())) / seconds, 1),
        "graphs": statistics_of_graphs,
    }
    return result, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="2 layers, short requests: checks the script")
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = smollm2_shape(2 if args.small else 30)
    input_len, output_len = (8, 8) if args.small else (args.input_len, args.output_len)
    with tempfile.TemporaryDirectory() as folder:
        loaded = random_model(config, getattr(torch, args.dtype), device, Path(folder))
        report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "torch": torch.__version__, "dtype": args.dtype, "runs": [], "token_agreement": {}}  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = torch.randint(3, config.vocab_size, (batch, input_len), generator=generator).tolist()
            run(loaded, prompts[:1], 4, enforce_eager=False)  # warm-up: CUDA context, cuBLAS
            tokens = {}
            for _ in range(args.rounds):
                for eager in (True, False):
                    result, tokens[eager] = run(loaded, prompts, output_len, enforce_eager=eager)
                    report["runs"].append(result)
                    print(json.dumps(result), flush=True)
            same = sum(a == b for r in tokens[True] for a, b in zip(tokens[True][r], tokens[False][r]))
            total = sum(map(len, tokens[True].values()))
            report["token_agreement"][batch] = f"{same}/{total}"
            print(f"batch {batch}: greedy tokens equal with and without graphs: {same}/{total}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
