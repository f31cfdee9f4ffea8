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

from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf_families import PROMPT, _build

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading import rtn_cache
from trioserve.engine.loading.loader import load_model
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.models.moe import SparseMoeBlock
from trioserve.testing.quality import greedy_tokens, prompt_logits

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
    assert greedy_tokens(quant.model, PROMPT[:4], 8) == greedy_tokens(reference, PROMPT[:4], 8)


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
