"""The options that describe an ``EngineConfig``: the model and its limits
(every command that starts an engine takes them), and overload control
(``trioserve serve``'s).

Each ``add_*_options`` adds its options to a parser and returns them in
order; the matching ``*_from_args`` turns the parsed values into the config
or its fields. Every option has help text and sits in one of the argument
groups ``GROUPS`` names, by concern (``option_group``); tests/test_cli_help.py
holds every command to that.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from trioserve.engine.config import DEFAULT_GRAMMAR_CACHE_SIZE, KV_CACHE_DTYPES, DegradationPolicy, EngineConfig, generation_config_path
from trioserve.engine.loading.generation_config import read_generation_config
from trioserve.engine.parallel.placement import plan_replicas

from .lora_options import add_lora_options, lora_config_from_args
from .option_types import count, fraction_or_off, parse_memory, recording, seconds


# The concerns options are grouped by in --help, in this order, and what each covers.
GROUPS = {
    "model": "what to serve: the checkpoint, its dtype, its compressed weights and its sampling defaults",
    "engine": "how the engine runs on this machine: batching, the KV cache, kernels, speculation, grammars",
    "scale-out": "replicas, worker processes and tensor parallelism over processes and machines",
    "server": "the HTTP (and gRPC) server: address, authentication, connections, plugins",
    "reliability": "deadlines, queue bounds, overload control, the watchdog and shutdown",
    "observability": "logs and traces",
}


def option_group(parser: argparse.ArgumentParser, title: str) -> Any:
    """``parser``'s argument group ``title`` (``GROUPS`` describes the
    concerns), made the first time it is asked for; groups show in --help in
    the order they were made."""
    for group in parser._action_groups:  # argparse keeps no other index of them
        if group.title == title:
            return group
    return parser.add_argument_group(title, GROUPS.get(title))


def add_option_groups(parser: argparse.ArgumentParser, *titles: str) -> None:
    """Make ``parser``'s groups ``titles`` now, so --help lists them in that order."""
    for title in titles:
        option_group(parser, title)


def add_engine_options(parser: argparse.ArgumentParser, *, several_models: bool = False) -> list[argparse.Action]:
    """Options shared by every command that starts an engine, in the
    groups model, engine and scale-out; with ``several_models``,
    ``--model`` may repeat (``args.model`` is a list). Returns the options
    added, in order."""
    actions: list[argparse.Action] = []
    add = recording(option_group(parser, "model"), actions)
    if several_models:
        add(
            "--model",
            action="append",
            default=None,
            help="checkpoint folder, .gguf file, or NAME=PATH; repeat to serve several models, "
            "requests pick one by their model field (default: SmolLM2-135M-Instruct)",
        )
    else:
        add("--model", default=None, help="checkpoint folder, .gguf file (default: SmolLM2-135M-Instruct)")
    add(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the dtype the model computes in (default: float32 on CPU, bfloat16 on CUDA)",
    )
    # Compressed weights (engine/kernels).
    add(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4"],
        help="weights kept compressed: auto keeps a GGUF's quantized matrices compressed on CPU (Q4_0/Q4_1/Q4_K "
        "in 4 bits, Q5/Q6_K/Q8_0 in int8) and loads float checkpoints as they are; int8 (per channel) / int4 (in groups) quantize any checkpoint "
        "round-to-nearest once, cached in $TRIOSERVE_CACHE; none dequantizes to float, faster for large "
        "batches at twice the memory (default: auto)",
    )
    add(
        "--quantization-group-size",
        type=int,
        default=32,
        help="inputs per int4 scale; must divide every projection's input size (default: 32)",
    )
    add(
        "--generation-config",
        default="auto",
        metavar="auto|none|PATH",
        help="the sampling defaults that fill the fields a request leaves out (temperature, top_p, top_k, "
        "min_p, repetition_penalty): auto reads the model's generation_config.json or its GGUF's sampling "
        "keys; PATH a generation_config.json (or a folder holding one); none ignores the model's. Where "
        "none apply: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05 (default: auto; docs/api.md)",
    )
    actions += add_lora_options(parser, option_group(parser, "model"))

    add = recording(option_group(parser, "engine"), actions)
    add(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed"],
        help="what the model serves: generate (the completions APIs) or embed (/v1/embeddings, its hidden "
        "states pooled as its sentence-transformers config says, else last token, normalised); auto embeds "
        "for a sentence-transformers folder (default: auto)",
    )
    add("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    add("--block-size", type=int, default=16, help="tokens per KV cache block, the prefix cache's unit (default: 16)")
    add(
        "--kv-cache-memory",
        default=None,
        help="bytes (e.g. 2G) or a fraction of free memory (e.g. 0.5) (default: on CPU what --max-num-seqs "
        "contexts take, within a quarter of the available memory and 4 GiB; on CUDA 0.8)",
    )
    # The KV cache's dtype (engine/kernels/kv_dtype_choice.py; its pool's size: engine/core/kv_budget.py).
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="what the KV cache stores: auto picks the first 16-bit dtype (float16, then "
        "bfloat16) whose conversions this CPU runs in hardware (twice the tokens in the same memory), else float32, and the model's dtype on CUDA; "
        "fp8 (e4m3) runs on CUDA only. Unless --kv-cache-memory is given, the CPU pool is sized for "
        "--max-num-seqs contexts of --max-model-len tokens in this dtype, within 4 GiB and a quarter of the available "
        "memory (default: auto)",
    )
    add(
        "--max-model-len",
        type=int,
        default=None,
        help="longest context, prompt and output together, in tokens (default: the model's)",
    )
    add(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences that run together at most; more wait in the queue (default: 64)",
    )
    add(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens one model step computes at most; a longer prompt is prefilled in chunks (default: 2048)",
    )
    add(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV cache blocks of a prompt prefix seen before (default: reused)",
    )
    add(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads for the model step, per replica (default: torch's; with replicas, each one's share "
        "of the cores)",
    )
    add(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps op by op instead of replaying a CUDA graph recorded for each batch "
        "shape (default: graphs on CUDA; no effect on CPU)",
    )
    add(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="run prompts on faster arithmetic that decode steps do not share: a request's tokens may then "
        "depend on its batch mates, the prefix cache and chunking (docs/architecture.md)",
    )
    actions += add_speculative_options(parser)
    actions += add_structured_output_options(parser)

    add = recording(option_group(parser, "scale-out"), actions)
    # Data parallelism (actors/replicas.py, docs/deployment.md).
    add(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each with its own KV cache and scheduler: on CUDA replica i on cuda:i, "
        "on CPU each pinned to a share of the cores (default: 1)",
    )
    add(
        "--worker-mode",
        default="thread",
        choices=["thread", "process"],
        help="run the model step on a thread of this process, or in a worker process that is restarted "
        "if it dies, its requests recomputed (default: thread)",
    )
    actions += add_tensor_parallel_options(parser)
    return actions


def add_tensor_parallel_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Tensor parallelism over processes and machines (docs/deployment.md);
    ``--master-addr`` and ``--master-port`` default to torchrun's
    ``MASTER_ADDR`` and ``MASTER_PORT``; in the group scale-out. Returns
    the options added."""
    group = option_group(parser, "scale-out")
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add("--tensor-parallel-size", type=count, default=1, help="ranks the model is split over (default: 1)")
    add("--nnodes", type=count, default=1, help="machines the ranks run on; node 0 runs the server (default: 1)")
    add(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="address of node 0, where the ranks meet (default: $MASTER_ADDR or 127.0.0.1)",
    )
    add(
        "--master-port",
        type=count,
        default=int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT", "").isdigit() else None,
        help="port of the rendezvous on node 0 (default: $MASTER_PORT; on one machine a free port)",
    )
    add(
        "--distributed-timeout",
        type=seconds,
        default=120.0,
        help="seconds to wait for the master and for every rank to join (default: 120)",
    )
    return actions


def tensor_parallel_fields(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_tensor_parallel_options`` set."""
    return dict(
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        master_addr=args.master_addr,
        master_port=args.master_port,
        distributed_timeout=args.distributed_timeout,
    )


def add_speculative_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Speculative decoding without a draft model (engine/sampling/speculative.py),
    in the group engine. Returns the options added."""
    group = option_group(parser, "engine")
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add(
        "--speculative",
        default=None,
        choices=["ngram"],
        help="ngram: propose each decoding sequence's next tokens by matching its latest tokens against its "
        "prompt and output (prompt lookup) and verify them in one forward; greedy output is unchanged "
        "(default: off)",
    )
    add("--num-speculative-tokens", type=count, default=4, help="tokens proposed per sequence and step (default: 4)")
    add("--speculative-max-ngram", type=count, default=4, help="longest n-gram matched (default: 4)")
    add("--speculative-min-ngram", type=count, default=None,
        help="shortest n-gram matched (default: 2, or the longest when that is 1)")
    return actions


def speculative_fields(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_speculative_options`` set."""
    fields = dict(
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_ngram=args.speculative_max_ngram,
    )
    if args.speculative_min_ngram is not None:  # else EngineConfig's default, which follows the longest
        fields["speculative_min_ngram"] = args.speculative_min_ngram
    return fields


def add_structured_output_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Structured output and tool calling (engine/sampling/grammar.py), in the group
    engine. Returns the options added."""
    group = option_group(parser, "engine")
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add(
        "--grammar-cache-size",
        type=count,
        default=DEFAULT_GRAMMAR_CACHE_SIZE,
        help="compiled grammars (JSON schemas, regexes, grammars, tool schemas) kept for reuse, least recently "
        f"used evicted first; a request whose grammar was evicted compiles it again (default: {DEFAULT_GRAMMAR_CACHE_SIZE})",
    )
    return actions


def structured_output_fields(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_structured_output_options`` set."""
    return dict(grammar_cache_size=args.grammar_cache_size)


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The ``EngineConfig`` that ``add_engine_options``'s values describe;
    ``overrides`` replace fields or set others."""
    fields = dict(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=parse_memory(args.kv_cache_memory),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
        enforce_eager=args.enforce_eager,
        data_parallel_size=args.data_parallel_size,
        worker_mode=args.worker_mode,
        **tensor_parallel_fields(args),
        **speculative_fields(args),
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        **structured_output_fields(args),
        lora=lora_config_from_args(args),
        kv_cache_dtype=args.kv_cache_dtype,
        batch_invariant=args.batch_invariant,
        generation_config=args.generation_config,
        task=args.task,
    )
    fields.update(overrides)
    config = EngineConfig(**fields)
    plan_replicas(config)  # more replicas than devices: refused here, before anything loads
    if config.generation_config not in ("auto", "none"):
        # The flag's file, read now so a bad field stops the command before
        # anything loads (the model's own file is read as the engine opens).
        read_generation_config(generation_config_path(config.generation_config))
    return config


def add_overload_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Overload control (docs/reliability.md, "Overload control"), in the
    group reliability; returns the options added, in order."""
    engine, policy = EngineConfig(), DegradationPolicy()
    group = option_group(parser, "reliability")
    actions: list[argparse.Action] = []
    add = recording(group, actions)
    add(
        "--max-queue-time",
        type=seconds,
        default=None,
        help="drop a request that waited this long (seconds) before any compute, with 503 (default: no bound)",
    )
    add(
        "--adaptive-concurrency",
        action="store_true",
        help="lower the running-sequence limit while TPOT p90 is above --target-tpot-ms, raise it while below",
    )
    add(
        "--target-tpot-ms",
        type=seconds,  # any finite number > 0
        default=engine.target_tpot_ms,
        help=f"the TPOT p90 adaptive concurrency steers to, in ms (default: {engine.target_tpot_ms:g})",
    )
    add(
        "--no-priority-shedding",
        action="store_true",
        help="a full queue refuses a new request instead of dropping a queued one of lower priority",
    )
    add(
        "--low-priority",
        type=int,
        default=policy.low_priority,
        help=f"priority values from this one up count as low priority (default: {policy.low_priority})",
    )
    add(
        "--cap-low-priority-at",
        type=fraction_or_off,
        default=policy.cap_at,
        metavar="FRACTION|off",
        help=f"queue fill from which new low-priority requests get max_tokens capped (default: {policy.cap_at:g})",
    )
    add(
        "--low-priority-max-tokens",
        type=int,
        default=policy.low_priority_max_tokens,
        help=f"that cap (default: {policy.low_priority_max_tokens})",
    )
    add(
        "--refuse-expensive-at",
        type=fraction_or_off,
        default=policy.refuse_expensive_at,
        metavar="FRACTION|off",
        help=f"queue fill from which n > 1 and many top logprobs get 429 (default: {policy.refuse_expensive_at:g})",
    )
    add(
        "--expensive-logprobs",
        type=int,
        default=policy.expensive_logprobs,
        help=f"more top logprobs than this count as expensive (default: {policy.expensive_logprobs})",
    )
    return actions


def overload_config_from_args(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields that ``add_overload_options`` set."""
    return dict(
        max_queue_time=args.max_queue_time,
        adaptive_concurrency=args.adaptive_concurrency,
        target_tpot_ms=args.target_tpot_ms,
        degradation=DegradationPolicy(
            low_priority=args.low_priority,
            cap_at=args.cap_low_priority_at,
            low_priority_max_tokens=args.low_priority_max_tokens,
            refuse_expensive_at=args.refuse_expensive_at,
            expensive_logprobs=args.expensive_logprobs,
            shed_lower_priority=not args.no_priority_shedding,
        ),
    )
