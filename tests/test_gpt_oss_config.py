"""gpt-oss's config.json read into ``ModelConfig``, in transformers 4's
field names (the Hub's files) and 5's, and its rotary tables against
transformers' at the real model's sizes (yarn without truncation, past the
original 4096-token context)."""

from __future__ import annotations

import attrs
import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from trioserve.engine.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from trioserve.engine.kernels import native_decode
from trioserve.engine.layers.rotary import RotaryEmbedding

LAYERS = 24


def _hub_config() -> dict:
    """openai/gpt-oss-20b's config.json as the Hub has it (transformers 4.55's names)."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4,
        "num_experts_per_tok": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": [SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(LAYERS)],
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_hidden_layers": LAYERS,
        "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    }  # fmt: skip


def test_the_hub_config_reads_as_gpt_oss():
    c = ModelConfig.from_hf_config(_hub_config())
    assert c.architecture == "GptOssForCausalLM"
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2880, 64, 8, 64)
    assert c.attention_bias and c.o_bias and c.attention_sinks
    assert c.layer_window(0) == 128 and c.layer_window(1) is None and c.layer_window(LAYERS - 2) == 128
    assert (c.rope_theta, c.rope_scaling.rope_type, c.rope_scaling.factor) == (150000.0, "yarn", 32.0)
    assert not c.rope_scaling.truncate and c.rope_scaling.original_max_position_embeddings == 4096
    assert c.sliding_rope is None  # one table for both layer types
    assert (c.moe_routing, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("gpt_oss", 32, 4, 2880)
    assert (c.swiglu_alpha, c.swiglu_limit, c.moe_layers) == (1.702, 7.0, tuple(range(LAYERS)))
    assert not c.plain_attention  # sinks: attention runs in torch, not the native op
    refused = native_decode.unsupported(c)
    assert any(line.startswith("attention_sinks=True: ") for line in refused)


def test_transformers_5_names_read_the_same():
    hub = _hub_config()
    five = transformers.GptOssConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    five.architectures = ["GptOssForCausalLM"]
    saved = five.to_dict()
    assert "rope_parameters" in saved and "rope_scaling" not in saved
    assert ModelConfig.from_hf_config(saved) == ModelConfig.from_hf_config(hub)


def test_missing_fields_take_transformers_defaults():
    # Without rotary fields, layer_types or attention_bias, transformers'
    # GptOssConfig fills in yarn on a 150k base, alternating layers and biases.
    hub = _hub_config()
    for key in ("rope_scaling", "rope_theta", "layer_types", "attention_bias", "experts_per_token"):
        del hub[key]
    ours = ModelConfig.from_hf_config(hub)
    assert ours == ModelConfig.from_hf_config(_hub_config())
    theirs = transformers.GptOssConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert not theirs.rope_parameters["truncate"] and not ours.rope_scaling.truncate
    assert list(ours.layer_types) == theirs.layer_types


def test_an_explicit_null_rope_scaling_in_4_names_is_plain_rotary():
    # transformers 4 read a null rope_scaling as no scaling at all.
    hub = {**_hub_config(), "rope_scaling": None}
    c = ModelConfig.from_hf_config(hub)
    assert c.rope_scaling.rope_type == "default" and c.rope_theta == 150000.0


@pytest.mark.parametrize("truncate", [False, True])
def test_rotary_tables_match_transformers_past_the_original_context(truncate):
    hub = _hub_config()
    hub["rope_scaling"] = {**hub["rope_scaling"], "truncate": truncate}
    config = ModelConfig.from_hf_config(hub)
    theirs_config = transformers.GptOssConfig(**{k: v for k, v in hub.items() if k not in ("architectures", "model_type")})
    positions = torch.tensor([0, 1, 127, 4095, 4096, 50000, 131071])
    theirs = GptOssRotaryEmbedding(theirs_config)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(attrs.evolve(config, max_position_embeddings=131072))
    our_cos, our_sin = ours.cos_sin(positions)
    half = config.head_dim // 2
    # Our tables hold cos twice and sin negated on the first half (rotate-half's layout).
    assert torch.allclose(our_cos[:, 0, :half], cos[0], atol=1e-5)
    assert torch.allclose(our_cos[:, 0, half:], cos[0], atol=1e-5)
    assert torch.allclose(our_sin[:, 0, half:], sin[0], atol=1e-5)
    assert torch.allclose(our_sin[:, 0, :half], -sin[0], atol=1e-5)
