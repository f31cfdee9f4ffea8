"""Token embeddings kept compressed (engine/kernels/embedding.py): a lookup
dequantizes exactly the rows the whole table dequantizes to, and a model
whose GGUF embeddings stay compressed computes the same logits as one given
them dequantized, without a float table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import ModelConfig, RopeScaling
from trioserve.engine.kernels.int8_native import Int8GroupNativeLinear
from trioserve.engine.loading import gguf_weights
from trioserve.engine.kernels import native
from trioserve.engine.kernels.choose import Kernel, KernelChoice
from trioserve.engine.kernels.embedding import CompressedEmbedding
from trioserve.engine.loading.compressed import build_quantized
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.testing.quality import prompt_logits

VOCAB, HIDDEN = 96, 64


def _gguf_table(kind: str, rows: int = VOCAB, cols: int = HIDDEN, seed: int = 0):
    """A ``kind`` table as the GGUF reader decodes it, and gguf's own float32 dequantization."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(data, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype))
    table = gguf_weights.decode_q8_0_blocks(blocks) if kind == "Q8_0" else gguf_weights.decode_q4(kind, blocks)
    return table, reference


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_lookup_dequantizes_exactly_the_rows_of_the_table(kind):
    table, reference = _gguf_table(kind)
    assert torch.equal(table.dequantize(), reference)
    embedding = CompressedEmbedding(table)
    ids = torch.tensor([[5, 0, 95, 5], [17, 17, 3, 94]])  # repeats, both ends of the vocabulary
    got = embedding(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 4, HIDDEN)
    assert torch.equal(got, F.embedding(ids, reference))
    assert torch.equal(embedding(torch.tensor([7])), reference[7:8])
    # int8 or one byte per 4-bit value, plus group scales: under a third of float32's bytes.
    assert embedding.nbytes < reference.nbytes / 3


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(),
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=None,
        eos_token_ids=(),
    )


def _tensors(config: ModelConfig, embed) -> list[tuple[str, object]]:
    gen = torch.Generator().manual_seed(7)
    shapes = {
        "self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
        "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128),
    }  # fmt: skip
    out: list[tuple[str, object]] = [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(HIDDEN))]
    for i in range(config.num_hidden_layers):
        for name, shape in shapes.items():
            out.append((f"model.layers.{i}.{name}.weight", torch.randn(shape, generator=gen) * 0.2))
        out.append((f"model.layers.{i}.input_layernorm.weight", torch.ones(HIDDEN)))
        out.append((f"model.layers.{i}.post_attention_layernorm.weight", torch.ones(HIDDEN)))
    return out


# The projections' kernel does not matter here (both models share it): the
# float reference, so the test runs on any CPU. It is int8, so the tied LM
# head runs on it too (engine/loading/compressed.py), requantized per channel from the
# same float values either way.
REFERENCE = KernelChoice(
    Kernel("reference", 8, "F.linear over the dequantized weights", lambda w, b: lambda x: F.linear(x, w.dequantize(), b)),
    "int8",
    32,
)


@pytest.mark.cpu_paths
def test_a_model_keeps_gguf_embeddings_compressed_and_computes_the_same_logits():
    config = _config()
    table, dequantized = _gguf_table("Q8_0")
    paths = CpuPaths.from_environment()
    compressed = build_quantized(_tensors(config, table), config, REFERENCE, source=Path("m.gguf"), cpu_paths=paths)
    floats = build_quantized(_tensors(config, dequantized), config, REFERENCE, source=Path("m.gguf"), cpu_paths=paths)
    # No float table: the embeddings are the compressed one, looked up row by row.
    assert compressed.embed_tokens.numel() == 0
    assert torch.equal(floats.embed_tokens, dequantized)
    ids = [3, 95, 0, 41, 41, 7, 60, 12, 88, 5]
    assert torch.equal(compressed.embed(torch.tensor(ids)), dequantized[ids])
    got, want = prompt_logits(compressed, ids, chunk=4), prompt_logits(floats, ids, chunk=4)
    head = compressed._projections().head
    if isinstance(head, Int8GroupNativeLinear):
        # Where the native kernels run, the tied head is the Q8_0 table itself
        # (engine/loading/compressed.py _shared_head); the float model's head requantized the
        # same values per channel, one rounding apart.
        assert head.weight is compressed._embedding.weight
        x = torch.randn(3, HIDDEN)
        if isinstance(head.weight, Q8Lanes) and head.isa == native.ISAS["avx2int8"]:
            # avx2int8 holds it as Q8_0 lanes blocks, which round rows to
            # int16 per group at any row count: the groups' int16 kernel's
            # bits, within the rounding of float32 rows.
            groups = head.weight.groups()
            assert torch.equal(head(x), native.ops().q8g_linear(x, groups.q, groups.scale, native.ISAS["avx2int8"]))
            assert torch.allclose(head(x), F.linear(x, dequantized), rtol=1e-3, atol=2e-3)
        elif isinstance(head.weight, Q8Lanes):
            # avx512vnni holds it so too; a prompt's logits keep float32 rows
            # (avx512bf16's kernels over the groups, bit for bit).
            groups = head.weight.groups()
            assert torch.equal(head(x), native.ops().q8g_linear(x, groups.q, groups.scale, native.ISAS["avx512bf16"]))
            assert torch.allclose(head(x), F.linear(x, dequantized), rtol=1e-4, atol=1e-4)
        else:
            assert torch.allclose(head(x), F.linear(x, dequantized), rtol=1e-4, atol=1e-4)
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    else:
        assert torch.equal(got, want)


def test_compressed_embeddings_of_the_wrong_shape_are_refused_naming_the_weight():
    from trioserve.engine.errors import ModelLoadError

    config = _config()
    table, _ = _gguf_table("Q4_1", rows=VOCAB - 32)
    with pytest.raises(ModelLoadError, match=r"'model\.embed_tokens\.weight': expected shape \(96, 64\), got \(64, 64\)"):
        build_quantized(_tensors(config, table), config, REFERENCE, source=Path("m.gguf"), cpu_paths=CpuPaths.from_environment())
