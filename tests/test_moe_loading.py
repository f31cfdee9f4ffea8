"""Qwen3-MoE and Mixtral on compressed weights (``--quantization int8|int4``
over a float checkpoint, engine/loading/compressed.py with
``moe_weights.ExpertCollector``) and from GGUF files written as llama.cpp
writes them (``ffn_*_exps`` tensors of all a layer's experts).

The compressed reference is our float model over the very values the cache
holds (the checkpoint rounded, then dequantized), as test_gguf_families'
dense check; the GGUF reference is transformers reading the same file where
it can (qwen3moe), else our float path over the folder the file was written
from, on the values the file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_gguf_families import PROMPT, _build, _hf_greedy, _rewrite
from test_model_equivalence import _save_gpt_oss_mxfp4, _save_tiny

from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels import q6k_lanes
from trioserve.engine.kernels.q6k_lanes import Q6KLanes
from trioserve.engine.loading import rtn_cache
from trioserve.engine.loading.loader import load_model
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.models.moe import SparseMoeBlock
from trioserve.testing.gguf_writer import quantize, write_gguf
from trioserve.testing.quality import greedy_tokens, prompt_logits
from trioserve.testing.tiny_model import write_word_tokenizer

pytestmark = pytest.mark.cpu_paths

KINDS = ("qwen3-moe", "mixtral")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each MoE family's folder and transformers model, built once."""
    root = tmp_path_factory.mktemp("moe")
    return {kind: (root / kind, _build(kind, root / kind)) for kind in KINDS}


def _held_tensors(obj: object, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor a compressed linear holds (its attrs fields, recursively)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 3 or not attrs.has(type(obj)):
        return []
    return [t for v in attrs.asdict(obj, recurse=False).values() for t in _held_tensors(v, depth + 1)]


def _expert_blocks(model: LlamaForCausalLM) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.layers if layer.mlp is not None]


def assert_experts_compressed(model: LlamaForCausalLM) -> None:
    """No float parameter but the embeddings and the routers, and no expert
    linear holding a float32 tensor of an expert matrix's size or more."""
    matrices = [n for n, p in model.named_parameters() if p.dim() >= 2]
    assert sorted(matrices) == sorted(["embed_tokens", *(f"layers.{i}.mlp.router" for i in model.config.moe_layers)])
    blocks = _expert_blocks(model)
    assert blocks and all(not b.float_experts for b in blocks)
    for block in blocks:
        smallest = block.hidden_size * block.intermediate_size
        experts = block.experts(pack=False).experts
        assert len(experts) == block.num_experts
        for expert in experts:
            for linear in (expert.gate_up, expert.down):
                held = _held_tensors(linear)
                assert held, f"{type(linear).__name__} holds no tensor we can see"
                wide = [t for t in held if t.is_floating_point() and t.element_size() >= 4 and t.numel() >= smallest]
                assert not wide, f"{type(linear).__name__} holds float32 {[tuple(t.shape) for t in wide]}"


def _rounded_reference(cache: Path, model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Our float model over the values the rtn cache holds, dequantized."""
    [entry] = list(cache.iterdir())
    rounded = [(n, t if isinstance(t, torch.Tensor) else t.dequantize()) for n, t in rtn_cache.read(entry)]
    reference = LlamaForCausalLM(model.config, dtype=torch.float32, device="cpu", cpu_paths=model.cpu_paths)
    reference.load_weights(rounded)
    return reference


def assert_near(got: torch.Tensor, want: torch.Tensor, bound: float) -> None:
    """Each position's logits within ``bound`` of the largest reference
    logit, but for at most one position in ten: a token whose router scores
    two experts within the kernels' rounding of each other may take the
    other one (a different, equally valid expert mix)."""
    error = (got - want).abs().amax(-1) / want.abs().max()
    assert float((error <= bound).float().mean()) >= 0.9, error
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.8


def assert_greedy_near(model: LlamaForCausalLM, reference: LlamaForCausalLM, bound: float) -> None:
    """``model``'s 16 greedy tokens are each, given the ones before, the
    reference's best or within ``bound`` of the largest reference logit of
    it (a near tie the compressed arithmetic may break the other way), and
    most are the reference's best."""
    tokens = greedy_tokens(model, PROMPT[:4], 16)
    logits = prompt_logits(reference, PROMPT[:4] + tokens)[3:-1]  # the rows that predict them
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    assert ((logits.max(-1).values - chosen) <= bound * logits.abs().max()).all()
    assert float((logits.argmax(-1) == torch.tensor(tokens)).float().mean()) >= 0.75


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_moe_runs_on_compressed_experts(built, tmp_path, kind, scheme):
    folder, _ = built[kind]
    cache = tmp_path / "cache"
    quant = load_model(str(folder), quantization=scheme, cache_dir=cache)
    assert quant.projection_choice.quantization == scheme
    assert_experts_compressed(quant.model)
    reference = _rounded_reference(cache, quant.model)
    assert_near(prompt_logits(quant.model, PROMPT), prompt_logits(reference, PROMPT), 0.08)
    assert_greedy_near(quant.model, reference, 0.08)


@pytest.mark.parametrize(("checkpoint", "scheme"), [("float", "int8"), ("mxfp4", "int8"), ("mxfp4", "int4")])
def test_gpt_oss_runs_on_compressed_experts(tmp_path, checkpoint, scheme):
    """gpt-oss's fused expert tensors, float or the Hub's MXFP4 pairs, built
    one expert at a time: MXFP4 groups run exactly as int8 groups (the
    reference, our float model over the cache, decodes them exactly too);
    float experts are rounded at load like the rest (int8 only here: the
    reference holds them unrounded)."""
    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    hf = _save_tiny("gpt-oss", folder) if checkpoint == "float" else _save_gpt_oss_mxfp4(folder)
    write_word_tokenizer(folder, hf.config.vocab_size)
    cache = tmp_path / "cache"
    quant = load_model(str(folder), quantization=scheme, cache_dir=cache)
    assert_experts_compressed(quant.model)
    reference = _rounded_reference(cache, quant.model)
    assert_near(prompt_logits(quant.model, PROMPT), prompt_logits(reference, PROMPT), 0.08)
    assert_greedy_near(quant.model, reference, 0.08)


def test_a_missing_expert_is_refused_naming_it(built, tmp_path):
    folder, _ = built["mixtral"]
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"broken: .*missing weights.*layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight"):
        load_model(str(broken), quantization="int8", cache_dir=tmp_path / "cache")


# The MoE families from GGUF: the files as llama.cpp writes them. llama.cpp's
# qwen3moe has no dense layers among its sparse ones (mlp_only_layers).
# Each type once (the file's loading is the same for every family): Q8_0
# and Q5_0 as int8 groups, Q4_0 and Q4_K as 4-bit groups, Q6_K's groups of 16.
GGUF_TYPES = {"qwen3-moe": ("Q8_0", "Q4_0", "Q4_K"), "mixtral": ("Q5_0", "Q6_K")}
_FOR_GGUF = {"qwen3-moe": {"mlp_only_layers": []}, "mixtral": {}}
# The K-quants need rows of 256: every matrix that wide (4 heads of 64).
_WIDE = {
    "qwen3-moe": {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64},
    "mixtral": {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64},
}


def _transformers_reading(path: Path, hf: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """transformers' own model of the GGUF at ``path`` (qwen3moe): its
    reader's tensors, in its config with the expert width it does not read
    (``expert_feed_forward_length``) put back."""
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.moe_intermediate_size = hf.config.moe_intermediate_size
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config).eval()


def _ours_as_stored(folder: Path, qtype: str, cpu_paths) -> LlamaForCausalLM:
    """Our float model over ``folder``'s weights as the writer stores them in
    ``qtype``: each matrix (an expert's too, never a router) quantized (the
    writer's ``quantize``) and dequantized by gguf-py."""
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    tensors = []
    for name, t in load_file(folder / "model.safetensors").items():
        if t.dim() == 2 and t.shape[-1] % block == 0 and not name.endswith(".gate.weight"):
            t = torch.from_numpy(gguf.quants.dequantize(quantize(t.float().numpy(), qtype), kind)).view(t.shape)
        tensors.append((name, t.float()))
    model = LlamaForCausalLM(config, dtype=torch.float32, device="cpu", cpu_paths=cpu_paths)
    model.load_weights(tensors)
    return model


@pytest.mark.parametrize(("kind", "qtype"), [(k, t) for k, types in GGUF_TYPES.items() for t in types])
def test_a_moe_gguf_loads_as_its_weights_compute(tmp_path, cpu_paths, kind, qtype):
    """Float: within 1e-4 of transformers reading the same file (Qwen3-MoE);
    transformers reads no Llama-architecture file with experts, so Mixtral's
    reference is our float model over the folder the file was written from,
    on the values the file holds. Compressed ("auto"): the file's own blocks,
    one expert at a time."""
    folder = tmp_path / kind
    hf = _build(kind, folder, **_FOR_GGUF[kind], **(_WIDE[kind] if qtype.endswith("_K") else {}))
    path = write_gguf(folder, tmp_path / f"{kind}-{qtype}.gguf", qtype, name=f"tiny-{kind}")
    stored = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors if "_exps" in t.name}
    assert stored and set(stored.values()) == {qtype}
    if kind == "qwen3-moe":
        reference = _transformers_reading(path, hf)
        with torch.no_grad():
            want = reference(torch.tensor([PROMPT])).logits[0]
        want_tokens = _hf_greedy(reference, PROMPT[:4], 64)
    else:
        reference = _ours_as_stored(folder, qtype, cpu_paths)
        want, want_tokens = prompt_logits(reference, PROMPT), greedy_tokens(reference, PROMPT[:4], 64)
    cache = tmp_path / "cache"
    float_model = load_model(str(path), quantization="none", cache_dir=cache)
    assert float_model.model_config.architecture == hf.config.architectures[0]
    got = prompt_logits(float_model.model, PROMPT)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    assert greedy_tokens(float_model.model, PROMPT[:4], 64) == want_tokens
    auto = load_model(str(path), quantization="auto", cache_dir=cache)
    assert_experts_compressed(auto.model)
    assert_near(prompt_logits(auto.model, PROMPT), want, 0.08)
    if qtype == "Q6_K" and any(f"({isa})" in auto.model.projection_choice.reason for isa in q6k_lanes.ISAS):
        # avx512vnni and avx2int8 hold a file's Q6_K experts at their width
        # (q6k_lanes), as their dense Q6_K projections, and the fused decode
        # step takes them.
        for block in _expert_blocks(auto.model):
            for expert in block.experts(pack=False).experts:
                assert isinstance(expert.gate_up.weight, Q6KLanes) and isinstance(expert.down.weight, Q6KLanes)
        assert auto.model._projections().decode is not None


def _gpt_oss_as_stored(hf: transformers.PreTrainedModel, qtype: str, expert_qtype: str) -> transformers.PreTrainedModel:
    """``hf`` with its matrices as the writer stores them: the attention's
    and the LM head's in ``qtype``, each expert's (``[experts, in, out]``
    in the checkpoint: quantized along ``in``) in ``expert_qtype``; routers,
    biases, sinks and norms as they are."""

    def stored(data: np.ndarray, kind: str) -> np.ndarray:
        t = gguf.GGMLQuantizationType[kind]
        return gguf.quants.dequantize(quantize(data, kind), t).astype(np.float32)

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                data = p.detach().transpose(1, 2).contiguous().numpy()
                p.copy_(torch.from_numpy(stored(data, expert_qtype)).transpose(1, 2))
            elif p.dim() == 2 and "router" not in name and not name.endswith("bias"):
                p.copy_(torch.from_numpy(stored(p.detach().numpy(), qtype)))
    return hf


def test_a_gpt_oss_gguf_loads_with_its_mxfp4_experts(tmp_path):
    """llama.cpp's gpt-oss file: experts in MXFP4 (gate and up apart, with
    biases), attention sinks, the rest here in Q8_0. transformers' GGUF
    reader fails on gpt-oss's metadata (a TypeError in 5.25), so the
    reference is transformers' model on the values the file holds. Float:
    within 1e-4, 64 greedy tokens equal; compressed ("auto"): the MXFP4
    groups run exactly as int8 groups, one expert at a time."""
    folder = tmp_path / "gpt-oss"
    hf = _build("gpt-oss", folder, swiglu_limit=7.0)  # llama.cpp's clamp: the file does not carry one
    path = write_gguf(folder, tmp_path / "gpt-oss.gguf", "Q8_0", name="tiny-gpt-oss", expert_qtype="MXFP4")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {k for n, k in kinds.items() if n.endswith("_exps.weight")} == {"MXFP4"}
    assert kinds["blk.0.attn_sinks.weight"] == "F32"
    reference = _gpt_oss_as_stored(hf, "Q8_0", "MXFP4")
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    cache = tmp_path / "cache"
    float_model = load_model(str(path), quantization="none", cache_dir=cache)
    assert float_model.model_config.architecture == "GptOssForCausalLM"
    got = prompt_logits(float_model.model, PROMPT)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    assert greedy_tokens(float_model.model, PROMPT[:4], 64) == _hf_greedy(reference, PROMPT[:4], 64)
    auto = load_model(str(path), quantization="auto", cache_dir=cache)
    assert_experts_compressed(auto.model)
    assert_near(prompt_logits(auto.model, PROMPT), want, 0.08)


def test_a_moe_gguf_without_an_experts_tensor_is_refused_naming_it(tmp_path, cpu_paths):
    """On both paths: the conversion (float) and the compressed reader."""
    folder = tmp_path / "mixtral"
    _build("mixtral", folder)
    source = write_gguf(folder, tmp_path / "mixtral.gguf", "Q8_0")
    missing = _rewrite(source, tmp_path / "missing.gguf", lambda n, d: None if n == "blk.1.ffn_up_exps.weight" else d)
    named = r"missing\.gguf: .*layers\.1\.block_sparse_moe\.experts\.0\.w3\.weight"
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(missing), quantization="none", cache_dir=tmp_path / "c")
    with pytest.raises(ModelLoadError, match=named):
        load_model(str(missing), quantization="auto", cache_dir=tmp_path / "c")
