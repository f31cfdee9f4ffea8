"""The fused native decode step (engine/kernels/csrc/decode.cpp) against the
model's own layers in torch, for every family the engine loads.

The step writes the decoder layer a second time, in C++; these tests hold
the two to one definition. For each family in ``native_decode.ARCHITECTURES``
(its config from transformers' own config class, found by the architecture's
name) and each variant of what a config may say (GQA, MHA and MQA, head
widths each attention kernel takes, biases, tied embeddings, every rotary
scaling), a tiny random model on each weight format and each ISA variant
this CPU runs goes through prompts, decode steps and a speculative
verification twice: once in the fused step, once in ``DecoderLayer.forward``
with torch's rotary, cache write, paged attention, norms and SwiGLU around
the very same linear kernels (called as the step calls them). Logits and
every layer's keys and values agree.

A family or a config feature the step does not compute
(``native_decode.unsupported``) is refused: the model runs its layers in
torch. Adding a family to the engine adds it here; the step takes it once
it joins ``native_decode.ARCHITECTURES``, and every ``ModelConfig`` field
must have a rule in ``native_decode.REQUIREMENTS``.

Where the library is not built, these tests skip as tests/test_native_kernels.py's do.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.engine.config import SUPPORTED_ARCHITECTURES, SUPPORTED_ROPE_TYPES, ModelConfig
from trioserve.engine.kernels import choose, native_decode
from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.kernels.rtn import quantize_int8_groups
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.loading.compressed import build_quantized
from trioserve.engine.models.llama import ExpertProjections
from trioserve.engine.models.moe import ExpertLinears

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
# Sizes every variant starts from: widths in multiples of 32 (the 4-bit
# and Q8_0 groups), 4 query heads of 16 on 2 KV heads.
BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, sliding_window=None,
)  # fmt: skip
# What a config may say, each tried on every family whose transformers
# config takes its fields. The head widths pick each attention kernel:
# 64 (avx2's and avx512's own 64-wide path, GQA of 3 so a pass takes an
# odd count), 32 and 16 (vectors of 16), 24 (vectors of 8), 12 (scalar).
VARIANTS: dict[str, dict[str, object]] = {
    "gqa": {},
    "mha": dict(num_key_value_heads=4),
    "mqa-head64": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "gqa3-head64": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    "head32": dict(head_dim=32),
    "head24": dict(num_key_value_heads=1, head_dim=24),
    "head12": dict(num_attention_heads=8, head_dim=12),
    "tied": dict(tie_word_embeddings=True),
    "attention-bias": dict(attention_bias=True),
    "rope-linear": dict(rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}),
    "rope-llama3": dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    ),  # fmt: skip
}
# The mixtures' sizes: 8 experts of 64, 2 a token (so a decode step of 3
# rows leaves experts without rows), the top 2 renormalised (Qwen3-MoE's
# norm_topk_prob; Mixtral always renormalises).
MOE = dict(num_experts=8, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
# The variants tried on the families that joined later (each case is a
# second or two on this project's busy 2-core machines): the widths each
# attention kernel takes, a tied head, GQA against MQA.
FEW_VARIANTS = {
    "Qwen3ForCausalLM": ("gqa", "mqa-head64", "head24", "head12", "tied"),
    "Qwen3MoeForCausalLM": ("gqa", "gqa3-head64"),
    "MixtralForCausalLM": ("gqa",),
}

# The weight formats a layer's linears come in: 4-bit blocks (lanes blocks
# on avx2int8), int8 per channel, and int8 in groups of 32 (a GGUF's Q8_0
# matrices beside 4-bit ones).
SCHEMES = ("int4", "int8", "q8_0")


def _model_type(architecture: str) -> str:
    """transformers' model type of ``architecture`` (e.g. ``qwen2``): the one
    whose config class is named for it (other types reuse Llama's class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = [t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture]
    named = f"{architecture.removesuffix('ForCausalLM')}Config"
    return next((t for t in types if transformers.CONFIG_MAPPING[t].__name__ == named), types[0])


def _parameters(architecture: str) -> set[str]:
    return set(inspect.signature(transformers.CONFIG_MAPPING[_model_type(architecture)].__init__).parameters)


def _takes(architecture: str, fields: dict[str, object]) -> bool:
    """Whether the family's transformers config has every field (any config
    stores an unknown one, which its model then ignores); a head width
    without head_dim is the hidden size over the heads (``_fields``)."""
    return set(fields) - {"head_dim", "hidden_size"} <= _parameters(architecture)


def _fields(architecture: str, variant: dict[str, object]) -> dict[str, object]:
    """The variant's config fields for the family: a head width where its
    config has no head_dim (Qwen2's) set by the hidden size."""
    fields = {**BASE, **variant}
    if "Moe" in architecture or "Mixtral" in architecture:
        fields.update({k: v for k, v in MOE.items() if k in _parameters(architecture)})
    if "head_dim" not in _parameters(architecture):
        fields["hidden_size"] = int(fields["num_attention_heads"]) * int(fields.pop("head_dim"))  # type: ignore[call-overload]
    return fields


CASES = [
    pytest.param(arch, name, id=f"{_model_type(arch)}-{name}")
    for arch in sorted(native_decode.ARCHITECTURES)
    for name, fields in VARIANTS.items()
    if _takes(arch, fields) and name in FEW_VARIANTS.get(arch, VARIANTS)
]


@pytest.fixture(scope="module")
def cpu_paths() -> CpuPaths:
    return CpuPaths.from_environment({})


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: a tiny model's step is a few microseconds a parallel
    region, which on a busy machine waits milliseconds for a second thread
    (26 s against 0.5 for one case's checks). A row's result does not
    depend on the threads (tests/test_native_kernels.py runs several)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_checkpoint(architecture: str, fields: dict[str, object]) -> tuple[ModelConfig, list[tuple[str, torch.Tensor]]]:
    """The family's config and Hugging Face-named random weights: matrices
    of unit gain, norm weights and biases away from 1 and 0 (so a norm
    that drops its weight, or a bias left out, shows)."""
    kind = _model_type(architecture)
    hf = transformers.AutoConfig.for_model(kind, architectures=[architecture], **_fields(architecture, fields))
    config = ModelConfig.from_hf_config(hf.to_dict())
    with torch.device("meta"):  # the names and shapes only
        names = transformers.AutoModelForCausalLM.from_config(hf).state_dict()
    gen = torch.Generator().manual_seed(1)
    tensors = []
    for name, tensor in names.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith("norm.weight"):
            value = 1 + 0.3 * torch.randn(tensor.shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.3 * torch.randn(tensor.shape, generator=gen)
        elif "embed_tokens" in name:
            value = torch.randn(tensor.shape, generator=gen)
        else:
            value = torch.randn(tensor.shape, generator=gen) * tensor.shape[-1] ** -0.5
        tensors += _per_expert(name, value, config.moe_routing)
    return config, tensors


# The Hub's names of an expert's gate, up and down, and of a layer's block.
HUB_EXPERTS = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj", "mlp."),
    "mixtral": ("w1", "w3", "w2", "block_sparse_moe."),
}


def _per_expert(name: str, value: torch.Tensor, routing: str | None) -> list[tuple[str, torch.Tensor]]:
    """transformers' fused experts (``mlp.experts.gate_up_proj`` [experts,
    2 * inter, hidden], gate's rows first; ``down_proj``) and router under
    the Hub's names a checkpoint gives, one matrix an expert; any other
    tensor as it is."""
    if routing is None or ".mlp." not in name:
        return [(name, value)]
    gate, up, down, block = HUB_EXPERTS[routing]
    name = name.replace("mlp.", block)
    prefix, _, part = name.rpartition("experts.")
    if part == "gate_up_proj":
        halves = ((e, p, h) for e, w in enumerate(value) for p, h in zip((gate, up), w.chunk(2)))
        return [(f"{prefix}experts.{e}.{p}.weight", h) for e, p, h in halves]
    if part == "down_proj":
        return [(f"{prefix}experts.{e}.{down}.weight", w) for e, w in enumerate(value)]
    return [(name, value)]


def quantized_model(config, tensors, scheme: str, isa: str, cpu_paths: CpuPaths):
    """The model on ``isa``'s native kernel, its projections in ``scheme``."""
    bits = 8 if scheme == "int8" else 4
    kernel = next(k for k in choose.KERNELS if k.name == f"quant_int{bits}_native_{isa}")
    if scheme == "q8_0":  # as a GGUF's Q8_0 matrices come: "auto" keeps them int8 in groups
        tensors = [(n, quantize_int8_groups(t, 32) if "_proj.weight" in n else t) for n, t in tensors]
    choice = choose.KernelChoice(kernel, "auto" if scheme == "q8_0" else scheme, 32)
    return build_quantized(iter(tensors), config, choice, source=Path("tiny"), cpu_paths=cpu_paths)


def _as_the_step_calls(linear: object) -> object:
    """``linear`` calling its kernel with its own variant at every row count,
    as the fused step does (a prompt's calls from the layers would take
    wider activations: int4_native.call_isa)."""
    takes = attrs.has(type(linear)) and "int8_panels" in attrs.fields_dict(type(linear))
    return attrs.evolve(linear, int8_panels=True) if takes else linear


def _layer_as_the_step_calls(projections: object) -> object:
    """A layer's linears (a mixture's attention and experts) as the step calls them."""
    if isinstance(projections, ExpertProjections):
        experts = projections.experts
        made = tuple(ExpertLinears(_as_the_step_calls(e.gate_up), _as_the_step_calls(e.down)) for e in experts.experts)
        return ExpertProjections(_layer_as_the_step_calls(projections.attention), attrs.evolve(experts, experts=made))
    parts = ("qkv_linear", "o_linear", "gate_up_linear", "down_linear")
    return attrs.evolve(projections, **{f: _as_the_step_calls(getattr(projections, f)) for f in parts})


@contextlib.contextmanager
def in_torch(model):
    """The model's layers in torch around the same linears: no fused step,
    attention in torch (not the native attention op, which shares the
    step's code)."""
    made, attention = model._quantized, model.native_attention
    layers = [_layer_as_the_step_calls(p) for p in made.layers]
    model._quantized = attrs.evolve(made, layers=layers, decode=None, head=made.decode_head or made.head)
    model.native_attention = None
    try:
        yield
    finally:
        model._quantized, model.native_attention = made, attention


def _step(model, cache, chunks) -> torch.Tensor:
    with torch.inference_mode():
        return model(ForwardBatch.build(chunks, block_size=BLOCK_SIZE, device="cpu"), cache)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    got, want = got.float(), want.float()
    return bool((got - want).abs().max() <= tol * want.abs().max())


def check_step_against_layers(model, isa: str, cache_dtype: torch.dtype) -> None:
    """Three sequences over scattered blocks: each prompt (up to 9 tokens:
    one call of the row kernels), then three decode steps of all three,
    then a verification of runs of 3, 1 and 2 tokens; the fused step on one
    cache, the layers on another. Logits and both caches agree."""
    made = model._projections()
    assert made.decode is not None
    # Measured: at most 1.3e-6 of the largest logit or cache value on
    # float32 activations and cache, 6e-4 with a 16-bit cache, 1.0e-2 on
    # int8 activations (avx512vnni, avx2int8), whose rounding the two
    # paths' last-bit differences now and then move by a step. A layer
    # computed otherwise (a norm's weight, a bias, a rotary table, a head's
    # keys) moves them by tens of percent.
    if isa in ("avx512vnni", "avx2int8"):
        tol = 3e-2
    else:
        tol = 1e-5 if cache_dtype == torch.float32 else 2e-3
    rng = random.Random(0)
    blocks = list(range(1, 31))
    rng.shuffle(blocks)
    tables = [blocks[i * 5 : i * 5 + 5] for i in range(3)]
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (5, 9, 7)]
    caches = [
        KVCache.allocate(model.config, num_blocks=32, block_size=BLOCK_SIZE, dtype=cache_dtype, device="cpu")
        for _ in range(2)
    ]

    def both(chunks) -> torch.Tensor:
        assert made.decode.runs([len(c.token_ids) for c in chunks], cache_dtype, prompts=True)
        fused = _step(model, caches[0], chunks)
        with in_torch(model):
            layered = _step(model, caches[1], chunks)
        assert fused.shape == layered.shape
        assert _close(fused, layered, tol), (isa, (fused - layered).abs().max().item(), layered.abs().max().item())
        for a, b in ((caches[0].key, caches[1].key), (caches[0].value, caches[1].value)):
            assert _close(a, b, tol), isa
        return layered

    for prompt, table in zip(prompts, tables):
        both([SeqChunk(prompt, 0, table, num_logits=len(prompt))])
    tokens = [p[-1] for p in prompts]
    lengths = [len(p) for p in prompts]
    for step in range(3):
        logits = both([SeqChunk([t], n + step, table) for t, n, table in zip(tokens, lengths, tables)])
        tokens = logits.argmax(-1).tolist()
    runs = [[5, 6, 7], [8], [9, 10]]
    both([SeqChunk(run, n + 3, table, num_logits=len(run)) for run, n, table in zip(runs, lengths, tables)])


@pytest.mark.parametrize(("architecture", "variant"), CASES)
def test_the_fused_step_computes_each_familys_layers(isas, cpu_paths, architecture, variant):
    config, tensors = tiny_checkpoint(architecture, VARIANTS[variant])
    assert native_decode.unsupported(config) == []
    for scheme in SCHEMES:
        for isa in isas:
            model = quantized_model(config, tensors, scheme, isa, cpu_paths)
            check_step_against_layers(model, isa, torch.float32)
    # A 16-bit cache, stored rounded by both, on the best variant here.
    check_step_against_layers(quantized_model(config, tensors, "int4", isas[-1], cpu_paths), isas[-1], torch.float16)


def test_every_supported_family_and_rope_scaling_is_tried():
    tried = {(arch, name) for arch, name in (case.values for case in CASES)}
    assert {arch for arch, _ in tried} == set(native_decode.ARCHITECTURES) <= set(SUPPORTED_ARCHITECTURES)
    ropes = {VARIANTS[name].get("rope_parameters", {}).get("rope_type", "default") for _, name in tried}
    assert ropes == native_decode.ROPE_TYPES <= set(SUPPORTED_ROPE_TYPES)
    # Qwen2's q/k/v carry a bias in every variant; Llama's attention_bias adds o's.
    assert ("LlamaForCausalLM", "attention-bias") in tried


def test_every_config_field_has_a_rule():
    """A field a new family adds to ModelConfig must say what the fused
    step needs of it (native_decode.REQUIREMENTS), so the step never runs a
    layer whose math the field changes unchecked."""
    assert set(native_decode.REQUIREMENTS) == {f.name for f in attrs.fields(ModelConfig)}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (dict(architecture="GemmaForCausalLM"), "architecture='GemmaForCausalLM': the fused step needs a family"),
        (dict(head_dim=15), "head_dim=15: the fused step needs an even head_dim"),
    ],
)
def test_a_feature_the_step_lacks_is_refused_and_the_layers_run(isas, cpu_paths, change, said):
    config, tensors = tiny_checkpoint("LlamaForCausalLM", {})
    model = quantized_model(config, tensors, "int4", isas[-1], cpu_paths)
    made = model._projections()
    unsupported = attrs.evolve(config, **change)
    assert [said in reason for reason in native_decode.unsupported(unsupported)] == [True]
    args = (made.layers, [l.input_layernorm for l in model.layers], [l.post_attention_layernorm for l in model.layers])
    sizes = dict(num_heads=4, num_kv_heads=2, head_dim=16, eps=1e-5)
    assert native_decode.NativeDecode.build(*args, **sizes, config=config) is not None
    assert native_decode.NativeDecode.build(*args, **sizes, config=unsupported) is None


def test_a_rope_scaling_the_step_was_not_checked_with_is_refused():
    config, _ = tiny_checkpoint("LlamaForCausalLM", {})
    yarn = attrs.evolve(config, rope_scaling=attrs.evolve(config.rope_scaling, rope_type="yarn"))
    assert len(native_decode.unsupported(yarn)) == 1
    assert "rope_scaling" in native_decode.unsupported(yarn)[0]


def test_a_model_with_a_feature_the_step_lacks_runs_its_layers(isas, cpu_paths):
    """A family the step was not checked against (here a Llama renamed)
    loads with no fused step: every token runs the layers in torch."""
    config, tensors = tiny_checkpoint("LlamaForCausalLM", {})
    model = quantized_model(attrs.evolve(config, architecture="GemmaForCausalLM"), tensors, "int4", isas[-1], cpu_paths)
    assert model._projections().decode is None
    invariance = model.invariance()
    assert not invariance.invariant and "architecture" in invariance.reason, invariance.reason


@pytest.mark.parametrize(
    ("architecture", "fields", "reason"),
    [
        ("MistralForCausalLM", {"sliding_window": 64}, "sliding_window"),
        ("Gemma2ForCausalLM", {}, "sandwich_norms"),
        ("Gemma3ForCausalLM", {}, "sandwich_norms"),
        ("SmolLM3ForCausalLM", {"num_hidden_layers": 4}, "rope_layers"),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("GptOssForCausalLM", {}, "attention_sinks"),
        ("GptOssForCausalLM", {}, "moe_routing"),
    ],
)
def test_a_layer_the_step_does_not_compute_is_refused_by_field(architecture, fields, reason):
    """Families and features outside the fused step run their layers in
    torch, and the refusal names the field (``/version``'s invariance)."""
    hf = transformers.AutoConfig.for_model(
        _model_type(architecture), architectures=[architecture], **{**_fields(architecture, {}), **fields}
    )
    config = ModelConfig.from_hf_config(hf.to_dict())
    assert any(line.startswith(f"{reason}=") for line in native_decode.unsupported(config))


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, str, str], object]:
    """Models made once per (family, scheme, variant) for this module's hypothesis tests."""
    return {}


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 12), min_size=2, max_size=5),
    row=st.integers(0, 4),
    scheme=st.sampled_from(("int4", "q8_0")),  # int8 per channel runs avx512bf16's panels from 10 rows
    seed=st.integers(0, 2**16),
)
def test_a_rows_bits_do_not_depend_on_what_shares_its_step(
    isas, cpu_paths, built, architecture, lengths, row, scheme, seed
):
    """On each variant whose kernels give a row the same bits at every row
    count (``choose.ROW_INVARIANT_ISAS``), a sequence's prompt and its next
    decode step in the fused step, its q and k heads normed and (Qwen3-MoE)
    its tokens routed to experts shared with the other rows, give it the
    very logits it gets alone."""
    invariant = [isa for isa in isas if isa in choose.ROW_INVARIANT_ISAS]
    if not invariant:
        pytest.skip("no row-invariant native variant on this CPU")
    row %= len(lengths)
    rng = random.Random(seed)
    for isa in invariant:
        key = (architecture, scheme, isa)
        if key not in built:
            built[key] = quantized_model(*tiny_checkpoint(architecture, {}), scheme, isa, cpu_paths)
        model = built[key]
        assert model._projections().decode is not None
        prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in lengths]
        tables = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(lengths))]
        caches = [
            KVCache.allocate(model.config, num_blocks=24, block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu")
            for _ in range(2)
        ]
        together = _step(model, caches[0], [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
        alone = _step(model, caches[1], [SeqChunk(prompts[row], 0, tables[row])])
        assert torch.equal(together[row], alone[0]), (isa, scheme)
        tokens = together.argmax(-1).tolist()
        steps = [SeqChunk([t], len(p), table) for t, p, table in zip(tokens, prompts, tables)]
        together = _step(model, caches[0], steps)
        alone = _step(model, caches[1], [steps[row]])
        assert torch.equal(together[row], alone[0]), (isa, scheme)
