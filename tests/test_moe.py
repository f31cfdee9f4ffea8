"""The mixture-of-experts block (engine/models/moe.py, moe_weights.py) and
the MXFP4 decoder (engine/kernels/mxfp4.py) against transformers' own
Qwen3-MoE, Mixtral and gpt-oss blocks, loaded through the names their
``save_pretrained`` writes."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from trioserve.engine.errors import ModelLoadError
from trioserve.engine.kernels import mxfp4
from trioserve.engine.kernels.choose import KERNELS, KernelChoice, choose_kernel
from trioserve.engine.kernels.q8_lanes import Q8Lanes
from trioserve.engine.kernels.rtn import quantize_int4, quantize_int8_groups, regroup_int8
from trioserve.engine.models.moe import ExpertLinears, SparseMoeBlock, gpt_oss_activation
from trioserve.engine.models.moe_weights import (
    ExpertCollector,
    moe_fields,
    required_weight_names,
    weight_targets,
)
from trioserve.engine.models.weights import copy_weights

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 6, 2
LAYER = "model.layers.0."
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _hf_model(family: str, top_k: int = TOP_K, norm_topk_prob: bool = True):
    """A one-layer transformers model of ``family`` with seeded random weights."""
    import transformers

    common = dict(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=32, num_experts_per_tok=top_k,
    )
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=EXPERTS, moe_intermediate_size=INTER, intermediate_size=48, norm_topk_prob=norm_topk_prob
        )
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=EXPERTS, intermediate_size=INTER)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.GptOssConfig(**common, num_local_experts=EXPERTS, intermediate_size=INTER)
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.model.layers[0].mlp.named_parameters():
            # Outputs of order 1, where 1e-5 is float32's rounding and no more.
            p.copy_(torch.randn(p.shape) * (1.0 if "router" in name or "gate.weight" in name else 0.1))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[object, dict[str, torch.Tensor], dict]]:
    """Per family: the transformers model, the block's tensors as its
    ``save_pretrained`` wrote them, and its config.json."""
    out = {}
    for family in FAMILIES:
        model = _hf_model(family)
        folder = tmp_path_factory.mktemp(family)
        model.save_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
        layer = {n: t for n, t in tensors.items() if n.startswith(LAYER) and ("mlp." in n or "block_sparse_moe." in n)}
        out[family] = (model, layer, json.loads((folder / "config.json").read_text()))
    return out


def _block(family: str, hf: dict, *, float_experts: bool = True) -> SparseMoeBlock:
    f = moe_fields(hf)
    return SparseMoeBlock(
        HIDDEN, f["moe_intermediate_size"], f["num_experts"], f["num_experts_per_tok"], f["moe_routing"],
        norm_topk_prob=f["norm_topk_prob"], swiglu_alpha=f["swiglu_alpha"], swiglu_limit=f["swiglu_limit"],
        float_experts=float_experts,
    )


def _float_block(family: str, tensors: dict[str, torch.Tensor], hf: dict) -> SparseMoeBlock:
    block = _block(family, hf)
    loaded = copy_weights(weight_targets(block, LAYER), tensors.items(), _config_stub(family))
    assert loaded == required_weight_names(block, LAYER) == set(tensors)
    return block


def _loaded(family: str, saved) -> tuple[SparseMoeBlock, object]:
    model, tensors, hf = saved[family]
    return _float_block(family, tensors, hf), model.model.layers[0].mlp


def _config_stub(family: str):
    class Stub:  # copy_weights reads only these two, for its messages and lm_head
        architecture = family
        tie_word_embeddings = False

    return Stub()


def _reference(mlp, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = mlp(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


def _x(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_block_equals_transformers_through_saved_names(saved, family, tokens, seed):
    block, mlp = _loaded(family, saved)
    x = _x(tokens, seed)
    want = _reference(mlp, x)
    for pack in (False, True):
        torch.testing.assert_close(block.experts(pack)(x), want, rtol=0, atol=1e-5)


def test_gpt_oss_activation_is_transformers_clamped_swiglu(saved):
    experts = saved["gpt_oss"][0].model.layers[0].mlp.experts
    gate_up = torch.linspace(-12, 12, 2 * 480).view(-1, 2 * INTER)  # past the clamps at +-7
    gate_up = torch.cat([gate_up, gate_up.flip(0)], dim=1)
    assert torch.equal(gpt_oss_activation(gate_up, 1.702, 7.0), experts._apply_gate(gate_up))


def test_save_pretrained_writes_the_names_the_blocks_require(saved):
    # Per expert for Qwen3-MoE and Mixtral (block_sparse_moe.), fused for gpt-oss.
    assert f"{LAYER}mlp.experts.5.gate_proj.weight" in saved["qwen3_moe"][1]
    assert f"{LAYER}block_sparse_moe.experts.5.w3.weight" in saved["mixtral"][1]
    assert tuple(saved["gpt_oss"][1][f"{LAYER}mlp.experts.gate_up_proj"].shape) == (EXPERTS, HIDDEN, 2 * INTER)


@pytest.mark.parametrize(
    ("family", "top_k", "norm"), [("qwen3_moe", EXPERTS, True), ("qwen3_moe", 3, False), ("gpt_oss", EXPERTS, False)]
)
def test_top_k_of_every_expert_unnormalised_and_a_single_token(family, top_k, norm):
    model = _hf_model(family, top_k=top_k, norm_topk_prob=norm)
    hf = model.config.to_dict()
    block = _block(family, hf)
    mlp = model.model.layers[0].mlp
    names = {}
    for name, p in mlp.named_parameters():  # transformers' fused in-memory names, as Hub names
        names.update(_hub_names(family, name, p.detach()))
    copy_weights(weight_targets(block, LAYER), names.items(), _config_stub(family))
    for tokens in (1, 7):
        x = _x(tokens, tokens)
        torch.testing.assert_close(block(x), _reference(mlp, x), rtol=0, atol=1e-5)


def _hub_names(family: str, name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    p_ = f"{LAYER}mlp."
    if family == "gpt_oss" or not name.startswith("experts."):
        return {f"{p_}{name}": p}
    part = name.removeprefix("experts.")
    if part == "down_proj":
        return {f"{p_}experts.{e}.down_proj.weight": p[e] for e in range(len(p))}
    return {
        **{f"{p_}experts.{e}.gate_proj.weight": p[e, :INTER] for e in range(len(p))},
        **{f"{p_}experts.{e}.up_proj.weight": p[e, INTER:] for e in range(len(p))},
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_an_expert_without_tokens_and_the_grouping(saved, family):
    block, _ = _loaded(family, saved)
    run = block.experts(pack=False)
    x = _x(5, 1)
    weights, index = run.route(x)
    index = torch.where(index == 0, torch.ones_like(index), index)  # expert 0 gets no token
    index[:, 1] = torch.where(index[:, 1] == index[:, 0], (index[:, 0] + 1) % EXPERTS, index[:, 1])
    index[:, 1] = torch.where(index[:, 1] == 0, 2 + (index[:, 0] == 2), index[:, 1])
    assert not (index == 0).any() and (index[:, 0] != index[:, 1]).all()
    got = run.combine(x, weights, index)
    for t in range(5):  # each token alone through its two experts, summed
        want = sum(weights[t, j] * run._expert(run.experts[int(index[t, j])], x[t : t + 1])[0] for j in range(TOP_K))
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_step_reads_each_routed_expert_once_and_no_other(saved, family, tokens, seed):
    # What a step reads: an expert's matrices once for all the tokens routed
    # to it (one call each, over all its rows), and nothing of the experts
    # no token routes to (a one-stream step: k experts of them).
    block, _ = _loaded(family, saved)
    run = block.experts(pack=False)
    calls: list[tuple[int, str, int]] = []

    def counted(e: int, part: str, linear):
        def call(x: torch.Tensor) -> torch.Tensor:
            calls.append((e, part, x.shape[0]))
            return linear(x)

        return call

    counting = attrs.evolve(run, experts=tuple(
        ExpertLinears(counted(e, "gate_up", ex.gate_up), counted(e, "down", ex.down)) for e, ex in enumerate(run.experts)
    ))  # fmt: skip
    x = _x(tokens, seed)
    _, index = run.route(x)
    routed = torch.bincount(index.reshape(-1), minlength=EXPERTS).tolist()
    torch.testing.assert_close(counting(x), run(x), rtol=0, atol=0)
    want = sorted((e, part, n) for e, n in enumerate(routed) if n for part in ("gate_up", "down"))
    assert sorted(calls) == want
    assert tokens > 1 or len(calls) == 2 * TOP_K


@pytest.mark.parametrize("family", FAMILIES)
@SETTINGS
@given(tokens=st.integers(2, 40), row=st.integers(0, 39), seed=st.integers(0, 2**16))
def test_a_token_gets_the_same_bits_whatever_shares_its_step(saved, family, tokens, row, seed):
    # oneDNN's packed float32 GEMM gives a row the same bits at every row
    # count (onednn.MIN_ROWS), and routing, gather and sum are per row.
    block, _ = _loaded(family, saved)
    run = block.experts(pack=True)
    x = _x(tokens, seed)
    row %= tokens
    assert torch.equal(run(x)[row], run(x[row : row + 1])[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_path_keeps_a_token_within_rounding_of_itself_alone(saved, family):
    # F.linear (MKL) sums a row in another order at another row count, so
    # only close: the reason a CPU model packs (models/invariance.py).
    block, _ = _loaded(family, saved)
    run = block.experts(pack=False)
    x = _x(33, 3)
    alone = torch.cat([run(x[t : t + 1]) for t in range(33)])
    torch.testing.assert_close(run(x), alone, rtol=0, atol=1e-5)


def _scalar_int4() -> KernelChoice:
    # Float32 activations at every row count: the dequantized weights' product up to summation order.
    return KernelChoice(next(k for k in KERNELS if k.name == "quant_int4_native_scalar"), "int4", 32)


def _compressed(family: str, saved, choice: KernelChoice, batch_invariant: bool = True) -> SparseMoeBlock:
    _, tensors, hf = saved[family]
    block = _block(family, hf, float_experts=False)
    collector = ExpertCollector(block, LAYER, choice, batch_invariant)
    rest = {}
    for name, t in tensors.items():
        if collector.accepts(name):
            collector.add(name, t)
        else:
            rest[name] = t
    copy_weights(weight_targets(block, LAYER), rest.items(), _config_stub(family))
    assert set(rest) == required_weight_names(block, LAYER)
    block.set_compressed(collector.build())
    return block


def _dequantized_float(family: str, saved) -> SparseMoeBlock:
    """The float block over the 4-bit weights' dequantized values (biases kept)."""
    block, _ = _loaded(family, saved)
    with torch.no_grad():
        for e in range(EXPERTS):
            block.gate_up[e] = quantize_int4(block.gate_up[e], 32).dequantize()
            block.down[e] = quantize_int4(block.down[e], 32).dequantize()
    return block


@pytest.mark.cpu_paths
@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_experts_equal_their_dequantized_weights(saved, isas, family):
    x = _x(37, 5)
    got = _compressed(family, saved, _scalar_int4())(x)
    torch.testing.assert_close(got, _dequantized_float(family, saved)(x), rtol=0, atol=1e-4)


@pytest.mark.cpu_paths
@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_experts_on_the_chosen_kernel_stay_near_float(saved, isas, cpu_paths, family):
    float_block, _ = _loaded(family, saved)
    choice = choose_kernel(cpu_paths, "int4", [(2 * INTER, HIDDEN), (HIDDEN, INTER)], 32)
    x = _x(37, 6)
    got = _compressed(family, saved, choice)(x)

    def rms(t: torch.Tensor) -> float:
        return float(t.pow(2).mean().sqrt())

    # 4-bit groups of 32 of Gaussian weights: a step of about a quarter of
    # their spread, some 8% of a product in rounding, twice over (gate_up,
    # then down: 15% measured); the chosen kernel adds its activations'
    # rounding (int8 in groups of 32 on VNNI: ~1%). A wrong expert or
    # weight would be off by the output's own size.
    want = float_block(x)
    assert rms(got - want) < 0.25 * rms(want)
    dequantized = _dequantized_float(family, saved)(x)
    assert rms(got - dequantized) < 0.02 * rms(dequantized)


@pytest.mark.cpu_paths
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@SETTINGS
@given(tokens=st.integers(2, 40), row=st.integers(0, 39))
def test_compressed_experts_are_batch_invariant_on_row_invariant_kernels(saved, isas, cpu_paths, family, tokens, row):
    choice = choose_kernel(cpu_paths, "int4", [(2 * INTER, HIDDEN), (HIDDEN, INTER)], 32, batch_invariant=True)
    block = _compressed(family, saved, choice)
    run = block.experts(pack=True)  # the float router on oneDNN
    x, row = _x(tokens, row), row % tokens
    assert torch.equal(run(x)[row], run(x[row : row + 1])[0])


@pytest.mark.cpu_paths
def test_int8_group_experts_stream_as_lanes_blocks_on_vnni(saved, isas):
    # A Q4_K_M file's Q6_K experts (int8 groups of 16, rounded into 32s) on
    # avx512vnni are held as its kernels read them fastest, and compute the
    # groups' values.
    if "avx512vnni" not in isas:
        pytest.skip("no avx512vnni here")
    _, tensors, hf = saved["qwen3_moe"]
    choice = KernelChoice(next(k for k in KERNELS if k.name == "quant_int4_native_avx512vnni"), "auto", 32)
    block = _block("qwen3_moe", hf, float_experts=False)
    collector = ExpertCollector(block, LAYER, choice)
    rest = {}
    for name, t in tensors.items():
        if collector.accepts(name):
            collector.add(name, quantize_int8_groups(t, 16))
        else:
            rest[name] = t
    copy_weights(weight_targets(block, LAYER), rest.items(), _config_stub("qwen3_moe"))
    block.set_compressed(collector.build())
    run = block.experts(pack=False)
    assert all(isinstance(lin.weight, Q8Lanes) for e in run.experts for lin in (e.gate_up, e.down))
    reference, _ = _loaded("qwen3_moe", saved)
    with torch.no_grad():
        for e in range(EXPERTS):
            for held in (reference.gate_up, reference.down):
                held[e] = regroup_int8(quantize_int8_groups(held[e], 16), 32).dequantize()
    x = _x(9, 4)
    want = reference(x)
    # int8 activations in groups of 32: about 1% of a product.
    assert float((run(x) - want).pow(2).mean().sqrt()) < 0.02 * float(want.pow(2).mean().sqrt())


def _random_mxfp4(experts: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    # Every exponent but 0xFF (NaN) turns up, subnormal 2^-127 and 2^-128 included.
    scales = torch.randint(0, 255, (experts, out, inp // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    n = min(255, scales.numel())
    scales.view(-1)[:n] = torch.arange(n, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_checkpoint_decoder_is_exactly_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(3, 96, 64, 0)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    for e in range(3):
        got = mxfp4.decode_hf(blocks[e], scales[e], "experts.gate_up_proj_blocks")
        assert got.q.abs().max() <= 12 and got.group_size == 32
        assert torch.equal(got.dequantize(), want[e].T)


def test_mxfp4_gguf_decoder_is_exactly_ggufs_dequantization():
    import gguf

    gen = np.random.default_rng(0)
    data = gen.integers(0, 256, size=(40, 3 * 17), dtype=np.uint8)
    data[:, ::17] = gen.integers(0, 250, size=(40, 3), dtype=np.uint8)  # 12 x 2^122 at most: finite
    data[0, 0], data[1, 0] = 0, 1  # the subnormal halves
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4)
    got = mxfp4.decode_gguf(data, "blk.0.ffn_gate_exps.weight").dequantize()
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(want)))


def test_mxfp4_refuses_a_nan_scale_by_name():
    blocks, scales = _random_mxfp4(1, 4, 32, 1)
    scales[0, 2, 0] = 255
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.experts.down_proj_blocks'.*0xFF"):
        mxfp4.decode_hf(blocks[0], scales[0], "model.layers.0.mlp.experts.down_proj_blocks")


@pytest.mark.cpu_paths
def test_gpt_oss_mxfp4_experts_run_compressed_as_their_dequantized_values(saved, isas):
    _, tensors, hf = saved["gpt_oss"]
    p = f"{LAYER}mlp.experts."
    gate_up = _random_mxfp4(EXPERTS, 2 * INTER, HIDDEN, 2)
    down = _random_mxfp4(EXPERTS, HIDDEN, INTER, 3)
    # Scales near 1/8, so the products stay in the clamps' working range.
    gate_up[1].fill_(124), down[1].fill_(124)
    mx = {f"{p}gate_up_proj_blocks": gate_up[0], f"{p}gate_up_proj_scales": gate_up[1],
          f"{p}down_proj_blocks": down[0], f"{p}down_proj_scales": down[1]}
    mx_tensors = {n: t for n, t in tensors.items() if n not in (f"{p}gate_up_proj", f"{p}down_proj")} | mx
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dense = {n: t for n, t in tensors.items()} | {
        f"{p}gate_up_proj": convert_moe_packed_tensors(*gate_up, dtype=torch.float32),
        f"{p}down_proj": convert_moe_packed_tensors(*down, dtype=torch.float32),
    }
    block = _compressed("gpt_oss", {"gpt_oss": (None, mx_tensors, hf)}, _scalar_int4())
    float_block = _float_block("gpt_oss", dense, hf)
    x = _x(29, 8)
    torch.testing.assert_close(block(x), float_block(x), rtol=0, atol=1e-4)


def test_refusals_name_the_tensor(saved, cpu_paths):
    _, tensors, hf = saved["mixtral"]
    block = _block("mixtral", hf)
    targets = weight_targets(block, LAYER)
    with pytest.raises(ModelLoadError, match=r"unknown weight 'model.layers.0.block_sparse_moe.experts.6.w1.weight'"):
        copy_weights(targets, [(f"{LAYER}block_sparse_moe.experts.6.w1.weight", torch.zeros(INTER, HIDDEN))], _config_stub("mixtral"))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.block_sparse_moe.experts.2.w2.weight': expected shape \(64, 32\)"):
        copy_weights(targets, [(f"{LAYER}block_sparse_moe.experts.2.w2.weight", torch.zeros(INTER, HIDDEN))], _config_stub("mixtral"))
    compressed = _block("mixtral", hf, float_experts=False)
    collector = ExpertCollector(compressed, LAYER, _scalar_int4())
    with pytest.raises(ModelLoadError, match=r"unknown weight 'model.layers.0.block_sparse_moe.experts.1.w4.weight'"):
        collector.add(f"{LAYER}block_sparse_moe.experts.1.w4.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.block_sparse_moe.experts.1.w1.weight': expected shape \(32, 64\)"):
        collector.add(f"{LAYER}block_sparse_moe.experts.1.w1.weight", torch.zeros(HIDDEN, INTER))
    for name, t in tensors.items():
        if collector.accepts(name) and name != f"{LAYER}block_sparse_moe.experts.4.w2.weight":
            collector.add(name, t)
    assert collector.missing() == [f"{LAYER}block_sparse_moe.experts.4.w2.weight"]
    with pytest.raises(ModelLoadError, match=r"missing expert weights \['model.layers.0.block_sparse_moe.experts.4.w2.weight'\]"):
        collector.build()


def test_gpt_oss_collector_names_what_is_missing(saved):
    _, _, hf = saved["gpt_oss"]
    collector = ExpertCollector(_block("gpt_oss", hf, float_experts=False), LAYER, _scalar_int4())
    p = f"{LAYER}mlp.experts."
    assert collector.missing() == [f"{p}gate_up_proj_bias", f"{p}down_proj_bias", f"{p}gate_up_proj_blocks",
                                   f"{p}gate_up_proj_scales", f"{p}down_proj_blocks", f"{p}down_proj_scales"]
    with pytest.raises(ModelLoadError, match=r"'model.layers.0.mlp.experts.down_proj_scales': expected shape \(6, 64, 1\)"):
        collector.add(f"{p}down_proj_scales", torch.zeros(EXPERTS, HIDDEN, 2, dtype=torch.uint8))


def test_moe_fields_read_each_familys_config(saved):
    qwen = moe_fields(saved["qwen3_moe"][2])
    assert qwen == {
        "moe_routing": "qwen3_moe", "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": INTER,
        "norm_topk_prob": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "moe_layers": (0,),
    }
    hub = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 128, "num_experts_per_tok": 8,
           "moe_intermediate_size": 768, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    assert moe_fields(hub)["moe_layers"] == (1, 5) and moe_fields(hub)["norm_topk_prob"] is False
    mixtral = moe_fields(saved["mixtral"][2])
    assert (mixtral["moe_routing"], mixtral["num_experts"], mixtral["norm_topk_prob"]) == ("mixtral", EXPERTS, True)
    oss = moe_fields(saved["gpt_oss"][2])
    assert (oss["moe_routing"], oss["moe_intermediate_size"], oss["swiglu_limit"]) == ("gpt_oss", INTER, 7.0)
    assert moe_fields({"model_type": "llama"}) == {}
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9 must be in 1..8"):
        moe_fields({"model_type": "mixtral", "num_hidden_layers": 1, "num_local_experts": 8, "num_experts_per_tok": 9,
                    "intermediate_size": 4})
