"""Every dense family from a GGUF file written as llama.cpp writes it
(``testing/gguf_writer.py``), float and compressed, and the compressed path
over a float checkpoint (``--quantization int8|int4``) for every family.

The reference is transformers' own model on the weights the file holds:
the checkpoint's matrices quantized (by gguf-py, the K-quants by the
writer) and dequantized by gguf-py, as the writer stores them. SmolLM3's
file, which transformers' GGUF reader refuses, is read by trioserve's own
conversion (engine/loading/gguf_cache.py); the reference is the same. The configs are test_model_equivalence's, changed only
where a GGUF cannot carry a feature (no Qwen3 sliding window, Gemma's attention scale derived from the
head width and Gemma 3's window pattern fixed at 6).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from test_model_equivalence import HF_MODELS

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels.rtn import Int4Weight, Int8Weight
from trioserve.engine.loading import compressed, gguf_config, rtn_cache
from trioserve.engine.loading.loader import load_model
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.testing.gguf_writer import quantize, write_gguf
from trioserve.testing.quality import greedy_tokens, prompt_logits
from trioserve.testing.tiny_model import write_word_tokenizer

pytestmark = pytest.mark.cpu_paths

PROMPT = [1, 5, 9, 3, 7, 11, 4, 8, 20, 30, 40, 2, 6, 13, 17, 19, 23, 29, 31, 37]
# Each family's file in one quantized type, so that every type gguf-py
# writes is read; Llama and Phi-3 (the permuted and the fused layouts) in F16 too.
GGUF_TYPES = {
    "llama": ("Q4_0", "F16"), "mistral": ("Q8_0",), "qwen2": ("Q8_0",), "qwen3": ("Q5_1",),
    "gemma2": ("Q5_0",), "gemma3": ("Q4_1",), "phi3": ("Q8_0", "F16"), "smollm3": ("Q8_0",),
}  # fmt: skip
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3")
# What a GGUF cannot carry, changed in test_model_equivalence's configs
# (Llama's llama3 rotary, which it carries as a table, has its own test).
_FOR_GGUF = {
    "llama": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    "qwen3": {"use_sliding_window": False},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {"num_hidden_layers": 6, "query_pre_attn_scalar": 32,
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}}},
}  # fmt: skip


def _build(kind: str, folder: Path, **changes) -> transformers.PreTrainedModel:
    """test_model_equivalence's tiny ``kind`` (its config as a GGUF carries
    it, and ``changes``), saved with a word tokenizer into ``folder``."""
    make_config, model_cls = HF_MODELS[kind]
    config = make_config().to_dict()
    if kind in _FOR_GGUF or changes:
        config.pop("layer_types", None)  # derived again from the fields changed
        config.update({**_FOR_GGUF.get(kind, {}), **changes})
    config = type(make_config()).from_dict(config)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size)
    return hf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family's folder and transformers model, built once."""
    root = tmp_path_factory.mktemp("families")
    return {kind: (root / kind, _build(kind, root / kind)) for kind in FAMILIES}


def _as_stored(hf: transformers.PreTrainedModel, qtype: str) -> transformers.PreTrainedModel:
    """``hf`` with each matrix as the writer stores it in ``qtype``: quantized
    and dequantized by gguf-py where its rows divide into the type's blocks."""
    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    with torch.no_grad():
        for _, p in hf.named_parameters():
            if p.dim() == 2 and p.shape[-1] % block == 0 and qtype != "F32":
                data = p.detach().float().numpy()
                stored = data.astype(np.float16) if qtype == "F16" else quantize(data, qtype)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(stored, kind).astype(np.float32)).view(p.shape))
    return hf


def _hf_greedy(hf: transformers.PreTrainedModel, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _compressed(model: LlamaForCausalLM) -> bool:
    """Whether the model's projections live only in the kernels' layouts."""
    big_float = [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
    return model.projection_choice.quantization is not None and not big_float


@pytest.mark.parametrize(("kind", "qtype"), [(k, t) for k, types in GGUF_TYPES.items() for t in types])
def test_a_gguf_of_every_family_loads_as_transformers_computes_its_weights(built, tmp_path, kind, qtype):
    folder, hf = built[kind]
    _check_gguf(folder, hf, tmp_path, kind, qtype)


# The K-quants (the writer's own Q4_K and Q6_K) need rows of 256: models
# wide enough that every matrix's rows are (the attention's too: 4 heads of 64).
K_QUANT_TYPES = {"llama": "Q4_K", "qwen3": "Q6_K", "smollm3": "Q4_K"}
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.mark.parametrize(("kind", "qtype"), K_QUANT_TYPES.items())
def test_a_k_quant_gguf_loads_as_transformers_computes_its_weights(tmp_path, kind, qtype):
    hf = _build(kind, tmp_path / kind, **WIDE)
    assert all(p.shape[-1] % 256 == 0 for p in hf.parameters() if p.dim() == 2)
    _check_gguf(tmp_path / kind, hf, tmp_path, kind, qtype)
    stored = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / f"{kind}-{qtype}.gguf")).tensors if len(t.shape) == 2}
    assert stored == {qtype}


def _check_gguf(folder: Path, hf: transformers.PreTrainedModel, tmp_path: Path, kind: str, qtype: str) -> None:
    path = write_gguf(folder, tmp_path / f"{kind}-{qtype}.gguf", qtype, name=f"tiny-{kind}")
    reference = _as_stored(copy.deepcopy(hf), qtype)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    cache = tmp_path / "cache"
    float_model = load_model(str(path), quantization="none", cache_dir=cache)
    got = prompt_logits(float_model.model, PROMPT)
    assert (got - want).abs().max() <= 1e-4 * max(1.0, float(want.abs().max()))
    # 64 steps, except where Phi-3's longrope would pass its original context
    # (64 here): transformers' full recompute then rotates every key with the
    # long factors, while the engine keeps each cached key's rotation (per
    # position, as transformers' own cached generation does not either).
    steps = min(64, (reference.config.rope_parameters or {}).get("original_max_position_embeddings", 1 << 30) - 4)
    assert greedy_tokens(float_model.model, PROMPT[:4], steps) == _hf_greedy(reference, PROMPT[:4], steps)
    # Compressed: the file's own blocks (Q8_0, Q5_0 as int8 groups, Q4_0/Q4_1
    # as 4-bit groups, Q5_1 rounded to int8 groups): the kernels' arithmetic
    # (int8 activations on a 4-bit kernel) moves the logits a little; F16
    # matrices are rounded to 4 bits here, as test_quant bounds that.
    auto = load_model(str(path), quantization="auto", cache_dir=cache)
    assert _compressed(auto.model)
    bound = 0.25 if qtype == "F16" else 0.08
    assert (prompt_logits(auto.model, PROMPT) - want).abs().max() <= bound * want.abs().max()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_family_runs_on_compressed_weights(built, tmp_path, kind, scheme):
    """Round to nearest from the float checkpoint: the model holds only
    compressed projections (Phi-3's fused ones split by rows) and computes
    what the float model of the rounded weights does, but for the kernels'
    own arithmetic."""
    folder, _ = built[kind]
    if scheme == "int4" and kind == "qwen2":
        pytest.skip("qwen2's tiny hidden size (48) takes no 4-bit group of 32")
    cache = tmp_path / "cache"
    quant = load_model(str(folder), quantization=scheme, cache_dir=cache)
    assert _compressed(quant.model) and quant.projection_choice.quantization == scheme
    [entry] = list(cache.iterdir())
    stored = dict(rtn_cache.read(entry))
    fused = [n for n in stored if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]
    assert all(isinstance(stored[n], Int4Weight if scheme == "int4" else Int8Weight) for n in fused)
    assert (kind == "phi3") == bool(fused)
    rounded = [(n, t if isinstance(t, torch.Tensor) else t.dequantize()) for n, t in stored.items()]
    reference = LlamaForCausalLM(quant.model.config, dtype=torch.float32, device="cpu", cpu_paths=quant.cpu_paths)
    reference.load_weights(rounded)
    want, got = prompt_logits(reference, PROMPT), prompt_logits(quant.model, PROMPT)
    assert (got - want).abs().max() <= 0.08 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


def _rewrite(source: Path, path: Path, change) -> Path:
    """``source``'s GGUF with its tensors passed through ``change(name, tensor)``
    (None drops one), metadata as it is."""
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        data = change(t.name, np.array(t.data))
        if data is not None:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_missing_or_misshapen_tensor_is_refused_naming_it(built, tmp_path):
    """On both paths: the conversion (float) and the compressed reader."""
    folder, _ = built["phi3"]
    source = write_gguf(folder, tmp_path / "phi3.gguf", "Q8_0")
    good = load_model(str(source), quantization="auto", cache_dir=tmp_path / "c")
    choice = compressed.quantization_choice(
        good.cpu_paths, torch.device("cpu"), torch.float32, "auto", good.model.config, 32
    )
    missing = _rewrite(source, tmp_path / "missing.gguf", lambda n, d: None if n == "blk.1.ffn_down.weight" else d)
    # The fused qkv of layer 0 with its last 32 rows cut.
    short = _rewrite(source, tmp_path / "short.gguf", lambda n, d: d[:-32] if n == "blk.0.attn_qkv.weight" else d)
    for path, named in ((missing, r"layers\.1\.mlp\.down_proj\.weight"), (short, r"layers\.0\.self_attn\.qkv_proj\.weight")):
        with pytest.raises(ModelLoadError, match=rf"{path.name}: .*{named}"):
            load_model(str(path), quantization="none", cache_dir=tmp_path / "c")
        with pytest.raises(ModelLoadError, match=rf"{path.name}: .*{named}"):
            compressed.load_gguf_quantized(path, good.model.config, choice, good.cpu_paths)


_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def test_a_llama3_rotary_is_restored_from_its_table(tmp_path):
    """llama.cpp keeps a llama3 rotary only as ``rope_freqs``: the
    conversion recovers its parameters (test_model_equivalence's Llama,
    whose short original context puts frequencies in all three bands)."""
    hf = _build("llama", tmp_path / "llama", rope_parameters=_LLAMA3)
    _check_gguf(tmp_path / "llama", hf, tmp_path, "llama", "Q8_0")
    loaded = load_model(str(tmp_path / "llama-Q8_0.gguf"), quantization="none", cache_dir=tmp_path / "cache")
    scaling = loaded.model_config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("llama3", 8.0, 32)
    assert scaling.low_freq_factor == pytest.approx(1.0) and scaling.high_freq_factor == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("parameters", "theta", "dims"),
    [
        # Llama 3.1 and 3.2's own.
        ({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 5e5, 128),
        ({"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 5e5, 64),
        # No frequency between the bounds: any bounds in the gap give the table.
        ({"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 1.05, "original_max_position_embeddings": 100}, 1e4, 16),
    ],
)
def test_llama3_parameters_give_their_table_back(parameters, theta, dims):
    table = [float(np.float32(v)) for v in gguf_config.llama3_table(parameters, theta, dims)]
    found = gguf_config.llama3_parameters(table, theta, dims)
    assert found["factor"] == parameters["factor"]
    assert gguf_config.llama3_table(found, theta, dims) == pytest.approx(table, rel=1e-5)


def test_a_table_no_llama3_rotary_gives_is_refused():
    table = [1.0, 1.5, 3.0, 2.0, 8.0, 8.0, 8.0, 8.0]  # not monotonic
    with pytest.raises(ModelLoadError, match="rope_freqs is not a llama3 rotary's table"):
        gguf_config.llama3_parameters(table, 10000.0, 16)
