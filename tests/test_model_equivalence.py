"""Our paged-KV model against transformers, on tiny random-weight checkpoints.

Each test saves a tiny model of every family (Llama, Mistral, Qwen2,
Qwen3, Gemma 2 and 3, Phi-3, SmolLM3, with sliding windows, soft-caps, yarn
and longrope where the family has them; the mixtures of experts Qwen3-MoE,
Mixtral and gpt-oss, with its attention sinks, and gpt-oss's MXFP4
checkpoint too) with ``save_pretrained``,
loads it into our model, and runs several sequences through a small
continuous-batching loop: prompts split into chunks in different ways,
sequences starting at different steps so decode tokens share batches with
other sequences' prefill chunks, batch order shuffled, scattered block
tables over a cache full of stale values. Every logit we produce must match
transformers' full recompute of the same tokens within 1e-4.

Our model runs on TEST_DEVICE (TRIOSERVE_TEST_DEVICE, default CPU); the
transformers reference always runs on CPU in float32.

Which projection path runs on CPU depends on the CPU (oneDNN's packed
bfloat16 weights need AVX-512 or AVX-NE-CONVERT): every test here is marked
``cpu_paths``, and a test of a path the CPU lacks checks the fallback.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import attrs
import pytest
import safetensors.torch
import torch
import transformers
from conftest import ON_CUDA, TEST_DEVICE

from trioserve.engine.kernels.capability import CpuPaths
from trioserve.engine.config import ModelConfig
from trioserve.engine.errors import CpuCapabilityError, ModelLoadError
from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk
from trioserve.engine.layers.kv_cache import KVCache
from trioserve.engine.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.cpu_paths

NUM_DECODE_STEPS = 16
PROMPT_LENS = (11, 19, 26, 33, 4)
DELAYS = (0, 0, 2, 5, 9)  # forward steps before each sequence starts


def _llama_config():
    # Explicit head_dim != hidden / heads, tied embeddings, llama3 RoPE with
    # a short original context so all three frequency bands occur, and
    # attention_bias (q/k/v and o biases in Llama).
    return transformers.LlamaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )  # fmt: skip


def _mistral_config():
    return transformers.MistralConfig(
        vocab_size=89, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    )  # fmt: skip


def _qwen2_config():
    return transformers.Qwen2Config(
        vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
    )  # fmt: skip


# Small enough windows that the five prompts (4-33 tokens, 16 steps on) pass them.
WINDOW = 6
SMALL = dict(
    vocab_size=91, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _mistral_window_config():
    return transformers.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=WINDOW)


def _llama_yarn_config():
    return transformers.LlamaConfig(
        **SMALL, num_hidden_layers=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32},
    )  # fmt: skip


def _qwen3_config():
    # q/k norms; the second layer slides (use_sliding_window from max_window_layers on).
    return transformers.Qwen3Config(
        **SMALL, num_hidden_layers=2, head_dim=32, use_sliding_window=True, max_window_layers=1,
        sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )  # fmt: skip


def _gemma2_config():
    # Sliding and global layers alternate; both soft-caps set low enough to bite.
    return transformers.Gemma2Config(
        **{**SMALL, "tie_word_embeddings": True}, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
    )  # fmt: skip


def _gemma3_config():
    # Each layer type with its own rotary: a local base, and a scaled global one.
    return transformers.Gemma3TextConfig(
        **{**SMALL, "tie_word_embeddings": True}, num_hidden_layers=3, head_dim=32, sliding_window=WINDOW,
        query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}},
    )  # fmt: skip


def _phi3_config():
    # Fused qkv and gate_up tensors, rotary over half of each head with
    # longrope's per-frequency factors (within the original context, where
    # transformers and the engine both take the short ones).
    return transformers.Phi3Config(
        **SMALL, num_hidden_layers=2, partial_rotary_factor=0.5, original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [2.0, 3.0, 4.0, 8.0],
                         "original_max_position_embeddings": 64},
    )  # fmt: skip


def _smollm3_config():
    # Every second layer without rotary (NoPE).
    return transformers.SmolLM3Config(**SMALL, num_hidden_layers=4, no_rope_layer_interval=2)


def _qwen3_moe_config():
    # A dense layer then a sparse one (mlp_only_layers), top-2 of 4, renormalised.
    return transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
    )  # fmt: skip


def _mixtral_config():
    return transformers.MixtralConfig(**SMALL, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)


def _gpt_oss_config():
    # Attention sinks, q/k/v/o biases, sliding and full layers alternating,
    # yarn without truncating its ramp (gpt-oss's own), top-2 of 4 biased
    # experts whose SwiGLU clamp is low enough to bite.
    return transformers.GptOssConfig(
        **SMALL, num_hidden_layers=3, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32},
    )  # fmt: skip


HF_MODELS = {
    "llama": (_llama_config, transformers.LlamaForCausalLM),
    "mistral": (_mistral_config, transformers.MistralForCausalLM),
    "qwen2": (_qwen2_config, transformers.Qwen2ForCausalLM),
    "mistral-window": (_mistral_window_config, transformers.MistralForCausalLM),
    "llama-yarn": (_llama_yarn_config, transformers.LlamaForCausalLM),
    "qwen3": (_qwen3_config, transformers.Qwen3ForCausalLM),
    "gemma2": (_gemma2_config, transformers.Gemma2ForCausalLM),
    "gemma3": (_gemma3_config, transformers.Gemma3ForCausalLM),
    "phi3": (_phi3_config, transformers.Phi3ForCausalLM),
    "smollm3": (_smollm3_config, transformers.SmolLM3ForCausalLM),
    "qwen3-moe": (_qwen3_moe_config, transformers.Qwen3MoeForCausalLM),
    "mixtral": (_mixtral_config, transformers.MixtralForCausalLM),
    "gpt-oss": (_gpt_oss_config, transformers.GptOssForCausalLM),
}


def _save_tiny(kind: str, path) -> transformers.PreTrainedModel:
    """Build a random ``kind`` model, save it to ``path`` and return it."""
    make_config, model_cls = HF_MODELS[kind]
    torch.manual_seed(0)
    config = make_config()
    config._attn_implementation = "eager"
    hf = model_cls(config).eval()
    # transformers' init (std 0.02) gives near-uniform attention and tiny
    # logits, which would hide position or masking bugs: use unit-variance
    # activations and peaky attention instead.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            elif name.endswith("sinks"):
                # As large as the peaky scores, so a head's sink takes a real share.
                p.copy_(4 * torch.randn_like(p))
            else:
                gain = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0
                p.copy_(gain * torch.randn_like(p) / math.sqrt(p.shape[-1]))
    hf.save_pretrained(path)
    return hf


def _load_ours(path, *, threads: int = 1, pack_weights: bool | None = None) -> LlamaForCausalLM:
    config = ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    model = LlamaForCausalLM(config, device=TEST_DEVICE, pack_weights=pack_weights)
    items = list(safetensors.torch.load_file(path / "model.safetensors").items())
    with ThreadPoolExecutor(threads) as pool:
        parts = pool.map(model.load_weights, [items[i::threads] for i in range(threads)])
        loaded = set().union(*parts)
    assert loaded >= model.required_weight_names()
    return model


def _batch(chunks: list[SeqChunk], block_size: int) -> ForwardBatch:
    return ForwardBatch.build(chunks, block_size=block_size, device=TEST_DEVICE)


@attrs.define
class _Seq:
    tokens: list[int]
    prompt_len: int
    chunk_lens: list[int]
    delay: int
    block_table: list[int]
    computed: int = 0
    logits: dict[int, torch.Tensor] = attrs.Factory(dict)

    @property
    def done(self) -> bool:
        return len(self.tokens) == self.prompt_len + NUM_DECODE_STEPS + 1


def _split(length: int, how: str, rng: random.Random) -> list[int]:
    if how == "whole":
        return [length]
    if how == "ones":
        return [1] * length
    if how.startswith("fixed"):
        size = int(how[len("fixed") :])
        return [min(size, length - s) for s in range(0, length, size)]
    cuts = sorted(rng.sample(range(1, length), min(3, length - 1)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, length])]


def _run(model, *, vocab, block_size, splits, all_logits, seed) -> tuple[list[_Seq], int]:
    """Drive every sequence to completion; return them and the number of
    batches that mixed a decode token with a multi-token prefill chunk."""
    rng = random.Random(seed)
    config = model.config
    blocks_per_seq = [-(-(n + NUM_DECODE_STEPS + 1) // block_size) for n in PROMPT_LENS]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, out-of-order block tables
    kv = KVCache.allocate(config, num_blocks=num_blocks, block_size=block_size, dtype=torch.float32, device=TEST_DEVICE)
    # Stale finite garbage: reading a slot not written this sequence shows up.
    kv.key.normal_(0, 30)
    kv.value.normal_(0, 30)
    seqs = []
    for n, how, delay, nb in zip(PROMPT_LENS, splits, DELAYS, blocks_per_seq):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        table = [free.pop() for _ in range(nb)]
        seqs.append(_Seq(prompt, n, _split(n, how, rng), delay, table))
    mixed = 0
    step = 0
    while not all(s.done for s in seqs):
        work = []
        for s in seqs:
            if s.done or step < s.delay:
                continue
            if s.chunk_lens:
                n = s.chunk_lens.pop(0)
                end = s.computed + n
                num_logits = n if all_logits else int(end == s.prompt_len)
            else:
                n, num_logits = 1, 1
            toks = s.tokens[s.computed : s.computed + n]
            work.append((s, SeqChunk(toks, s.computed, s.block_table, num_logits)))
        rng.shuffle(work)
        batch = _batch([c for _, c in work], block_size)
        with torch.inference_mode():
            logits = model(batch, kv).cpu()
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(c.num_logits for _, c in work), vocab)
        decoding = any(s.computed >= s.prompt_len for s, _ in work)
        mixed += decoding and any(len(c.token_ids) > 1 for _, c in work)
        rows = iter(logits)
        for s, c in work:
            end = c.start_position + len(c.token_ids)
            for pos in range(end - c.num_logits, end):
                s.logits[pos] = next(rows)
            s.computed = end
            if end == len(s.tokens):  # every known token is in: sample greedily
                s.tokens.append(int(s.logits[end - 1].argmax()))
        step += 1
    return seqs, mixed


def _check_against_hf(hf, seqs: list[_Seq]) -> None:
    for s in seqs:
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([s.tokens[:-1]])).logits[0]
        assert ref.abs().max() > 1.0  # the logits carry signal, not noise around 0
        for pos, ours in s.logits.items():
            diff = (ours - ref[pos]).abs().max().item()
            assert diff < 1e-4, f"position {pos} of a {s.prompt_len}-token prompt: max |diff| {diff:.2e}"


SCHEMES = {
    # (block_size, how each of the five prompts is split, logits for every prompt token?)
    "all-logits": (5, ("whole", "fixed4", "random", "ones", "fixed3"), True),
    "last-logit": (7, ("random", "whole", "fixed6", "random", "whole"), False),
}


# Packed weights are CPU-only (oneDNN): on CUDA only the plain path runs.
CPU_ONLY = pytest.mark.skipif(ON_CUDA, reason="packed weights are CPU-only")
PACK_CHOICES = [pytest.param(True, id="packed", marks=CPU_ONLY), pytest.param(False, id="plain")]


@pytest.mark.parametrize("pack_weights", PACK_CHOICES)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_matches_transformers(kind, scheme, pack_weights, tmp_path):
    block_size, splits, all_logits = SCHEMES[scheme]
    assert all(n % block_size for n in PROMPT_LENS)
    hf = _save_tiny(kind, tmp_path)
    # Packed: oneDNN's reordered weights, the CPU default; plain: F.linear, as on CUDA.
    model = _load_ours(tmp_path, threads=3, pack_weights=pack_weights)
    assert model.pack_weights is pack_weights
    seqs, mixed = _run(
        model, vocab=hf.config.vocab_size, block_size=block_size, splits=splits, all_logits=all_logits, seed=7
    )
    assert mixed >= 3
    for s in seqs:
        assert len(s.logits) == (s.prompt_len if all_logits else 1) + NUM_DECODE_STEPS
    _check_against_hf(hf, seqs)


def _save_gpt_oss_mxfp4(path) -> transformers.PreTrainedModel:
    """The tiny gpt-oss with its experts in MXFP4, as the Hub's gpt-oss
    checkpoints hold them (``{name}_blocks`` and ``{name}_scales`` for each
    fused expert tensor, and a ``quantization_config``), and transformers'
    model of it. transformers cannot write MXFP4 on a CPU, so the experts'
    codes and scales are drawn at random and written here; transformers
    reads them back as it reads the Hub's, dequantized (on a CPU, without
    its Triton kernels)."""
    _save_tiny("gpt-oss", path)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, out = tensors.pop(name).shape  # [experts, in, out]
        codes = torch.randint(0, 256, (experts, out, fan_in // 32, 16), generator=gen, dtype=torch.int32)
        # 2^-7 .. 2^-4 a group: weights of about the float ones' size.
        exponents = torch.randint(120, 124, (experts, out, fan_in // 32), generator=gen, dtype=torch.int32)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = codes.to(torch.uint8), exponents.to(torch.uint8)
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))
    hf = transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    return hf.eval()


@pytest.mark.parametrize("pack_weights", PACK_CHOICES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_gpt_oss_mxfp4_checkpoint_matches_transformers(scheme, pack_weights, tmp_path):
    # The float path decodes the MXFP4 experts exactly into float experts.
    block_size, splits, all_logits = SCHEMES[scheme]
    hf = _save_gpt_oss_mxfp4(tmp_path)
    names = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    model = _load_ours(tmp_path, threads=3, pack_weights=pack_weights)
    seqs, _ = _run(model, vocab=hf.config.vocab_size, block_size=block_size, splits=splits, all_logits=all_logits, seed=7)
    _check_against_hf(hf, seqs)


def test_an_mxfp4_half_without_its_pair_is_missing_and_a_bad_pair_is_refused(tmp_path):
    _save_gpt_oss_mxfp4(tmp_path)
    config = ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj"
    model = LlamaForCausalLM(config, device=TEST_DEVICE)
    loaded = model.load_weights((n, t) for n, t in tensors.items() if n != f"{name}_scales")
    assert model.required_weight_names() - loaded == {name}
    assert model.load_weights([(f"{name}_scales", tensors[f"{name}_scales"])]) == {
        name, f"{name}_blocks", f"{name}_scales"
    }  # fmt: skip
    wrong = LlamaForCausalLM(config, device=TEST_DEVICE)
    with pytest.raises(ModelLoadError, match=r"down_proj_blocks'.*decodes to shape \(4, 64, 64\), expected \(4, 96, 64\)"):
        wrong.load_weights([(f"{name}_blocks", tensors[f"{name}_blocks"][:, :, :2]), (f"{name}_scales", tensors[f"{name}_scales"][:, :, :2])])


def _greedy(model, prompt: list[int], steps: int, block_size: int = 4) -> list[int]:
    """``steps`` greedy tokens after ``prompt``: one prefill, then one decode
    step a token over scattered blocks of the paged cache."""
    blocks = -(-(len(prompt) + steps) // block_size)
    table = list(range(blocks))
    random.Random(5).shuffle(table)
    kv = KVCache.allocate(model.config, num_blocks=blocks, block_size=block_size, dtype=torch.float32, device=TEST_DEVICE)
    tokens = list(prompt)
    chunk = SeqChunk(tokens, 0, table)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(model(_batch([chunk], block_size), kv)[-1].argmax()))
            chunk = SeqChunk(tokens[-1:], len(tokens) - 1, table)
    return tokens[len(prompt) :]


@pytest.mark.parametrize("checkpoint", ["float", "mxfp4"])
def test_gpt_oss_greedy_tokens_match_transformers(checkpoint, tmp_path):
    # 64 tokens take the sequence well past the window (6) and yarn's
    # original context (32): every layer type and rotary band is crossed.
    hf = _save_tiny("gpt-oss", tmp_path) if checkpoint == "float" else _save_gpt_oss_mxfp4(tmp_path)
    model = _load_ours(tmp_path)
    prompt = [5, 17, 42, 8, 63, 29, 71, 3, 50]
    ours = _greedy(model, prompt, 64)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(64):  # transformers' full recompute, token by token
            tokens.append(int(hf(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert ours == tokens[len(prompt) :]
    assert len(set(ours)) > 8  # a varied continuation, not one token repeated


def test_tied_model_accepts_redundant_lm_head_and_skips_rotary_buffers(tmp_path):
    _save_tiny("llama", tmp_path)
    model = _load_ours(tmp_path)
    assert "lm_head.weight" not in model.required_weight_names()
    embed = model.embed_tokens.clone()
    extra = [
        ("lm_head.weight", torch.zeros_like(embed)),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(16)),
    ]
    assert model.load_weights(extra) == {"lm_head.weight"}
    assert torch.equal(model.embed_tokens, embed)


def test_load_weights_rejects_unknown_name(tmp_path):
    _save_tiny("qwen2", tmp_path)
    model = _load_ours(tmp_path)
    for name in ("model.layers.0.self_attn.q_norm.weight", "model.layers.3.mlp.up_proj.weight"):
        with pytest.raises(ModelLoadError, match=f"unknown weight '{name}'"):
            model.load_weights([(name, torch.zeros(48))])


def test_load_weights_rejects_wrong_shape(tmp_path):
    _save_tiny("mistral", tmp_path)
    model = _load_ours(tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight'.*\(16, 64\).*\(16, 48\)"):
        model.load_weights([(name, torch.zeros(16, 48))])


def test_forward_batch_build():
    chunks = [
        SeqChunk(token_ids=[5, 6, 7], start_position=5, block_table=[7, 2, 9], num_logits=3),
        SeqChunk(token_ids=[8], start_position=0, block_table=[3], num_logits=1),
        SeqChunk(token_ids=[1, 2], start_position=3, block_table=[4, 6], num_logits=0),
    ]
    b = ForwardBatch.build(chunks, block_size=4, device=TEST_DEVICE)
    assert b.input_ids.device.type == torch.device(TEST_DEVICE).type
    assert b.input_ids.tolist() == [5, 6, 7, 8, 1, 2]
    assert b.positions.tolist() == [5, 6, 7, 0, 3, 4]
    # position p of a sequence lives in slot table[p // 4] * 4 + p % 4
    assert b.slot_mapping.tolist() == [9, 10, 11, 12, 19, 24]
    assert b.cu_query_lens.tolist() == [0, 3, 4, 6]
    assert b.context_lens.tolist() == [8, 1, 5]
    # tables are cut to the blocks the context needs, then padded with 0
    assert b.block_tables.tolist() == [[7, 2], [3, 0], [4, 6]]
    assert b.logits_indices.tolist() == [0, 1, 2, 3]
    assert (b.query_lens_cpu, b.context_lens_cpu) == ((3, 1, 2), (8, 1, 5))
    assert b.block_tables_cpu == ((7, 2), (3,), (4, 6))
    with pytest.raises(ValueError, match="block_table has 1 blocks, context of 8 tokens needs 2"):
        ForwardBatch.build([attrs.evolve(chunks[0], block_table=[7])], block_size=4, device=TEST_DEVICE)
    with pytest.raises(ValueError, match="num_logits"):
        ForwardBatch.build([attrs.evolve(chunks[1], num_logits=2)], block_size=4, device=TEST_DEVICE)


def test_batch_without_logits_still_fills_the_cache(tmp_path):
    hf = _save_tiny("mistral", tmp_path)
    model = _load_ours(tmp_path)
    kv = KVCache.allocate(model.config, num_blocks=4, block_size=3, dtype=torch.float32, device=TEST_DEVICE)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    with torch.inference_mode():
        first = model(_batch([SeqChunk(tokens[:5], 0, [2, 0, 3, 1], 0)], 3), kv)
        last = model(_batch([SeqChunk(tokens[5:], 5, [2, 0, 3, 1], 1)], 3), kv)
        ref = hf(input_ids=torch.tensor([tokens])).logits[0, -1]
    assert first.shape == (0, hf.config.vocab_size)
    assert (last[0].cpu() - ref).abs().max() < 1e-4


@CPU_ONLY
def test_reloading_weights_refreshes_the_packed_copies(tmp_path):
    _save_tiny("qwen2", tmp_path)
    model = _load_ours(tmp_path)
    assert model.pack_weights
    kv = KVCache.allocate(model.config, num_blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    batch = ForwardBatch.build([SeqChunk([5, 7, 11], 0, [1, 3])], block_size=4, device="cpu")
    name = "model.layers.1.mlp.down_proj.weight"
    with torch.inference_mode():
        before = model(batch, kv)
        doubled = 2 * model.layers[1].down_proj
        model.load_weights([(name, doubled)])
        after = model(batch, kv)
        plain = LlamaForCausalLM(model.config, pack_weights=False)
        plain.load_state_dict(model.state_dict())
        expected = plain(batch, kv)
    assert (after - before).abs().max() > 1e-2
    assert (after - expected).abs().max() < 1e-4


def test_pack_weights_needs_a_cpu_model():
    config = ModelConfig.from_hf_config(_qwen2_config().to_dict())
    with pytest.raises(ValueError, match="pack_weights needs a CPU float32 or bfloat16 model"):
        LlamaForCausalLM(config, dtype=torch.float16, pack_weights=True)
    assert not LlamaForCausalLM(config, device="meta").pack_weights


def _bfloat16_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """Logits of ``tokens`` (a 9-token prefill, then one decode step per token)."""
    kv = KVCache.allocate(model.config, num_blocks=4, block_size=5, dtype=torch.bfloat16, device=TEST_DEVICE)
    with torch.inference_mode():
        first = model(_batch([SeqChunk(tokens[:9], 0, [2, 0, 3], 9)], 5), kv)
        rest = [model(_batch([SeqChunk([t], 9 + i, [2, 0, 3], 1)], 5), kv) for i, t in enumerate(tokens[9:])]
    return torch.cat([first, *rest]).cpu()


BF16_TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]


def test_bfloat16_packed_and_plain_agree_and_track_float32(tmp_path, cpu_paths):
    hf = _save_tiny("llama", tmp_path)
    config = ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    weights = list(safetensors.torch.load_file(tmp_path / "model.safetensors").items())
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([BF16_TOKENS])).logits[0]
    scale = ref.abs().max()
    # The model as the engine builds it: packed where this CPU can, else plain.
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=TEST_DEVICE)
    model.load_weights(weights)
    chosen = _bfloat16_logits(model, BF16_TOKENS)
    assert chosen.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: about 1% of the logit range here.
    assert (chosen - ref).abs().max() < 0.02 * scale
    packs = not ON_CUDA and cpu_paths.available("onednn_packed_bfloat16")
    assert model.pack_weights is packs
    if packs:
        plain = LlamaForCausalLM(config, dtype=torch.bfloat16, device=TEST_DEVICE, pack_weights=False)
        plain.load_weights(weights)
        assert (chosen - _bfloat16_logits(plain, BF16_TOKENS)).abs().max() < 0.02 * scale
    elif not ON_CUDA:
        # This CPU (or the forced switch) lacks the packed path: the model
        # fell back to plain and says why; insisting on packing is one clear error.
        assert model.projection_choice.reason.startswith(cpu_paths.status("onednn_packed_bfloat16").reason)
        assert model.projection_choice.fallback
        assert "F.linear on the plain weights instead" in model.projection_choice.reason
        with pytest.raises(CpuCapabilityError, match="pack_weights=True, but oneDNN packed bfloat16 weights"):
            LlamaForCausalLM(config, dtype=torch.bfloat16, pack_weights=True)


@CPU_ONLY
def test_bfloat16_falls_back_to_plain_where_packing_is_off(tmp_path):
    # The same fallback on any CPU, through the switch: packed bfloat16 off
    # as on an AVX2-only CPU; float32 keeps its packed path.
    hf = _save_tiny("llama", tmp_path)
    config = ModelConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    weights = list(safetensors.torch.load_file(tmp_path / "model.safetensors").items())
    avx2 = CpuPaths.detect(assume="avx2")
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, cpu_paths=avx2)
    assert not model.pack_weights
    reason = model.projection_choice.reason
    assert reason.startswith("oneDNN packed bfloat16 weights: ") and "off by TRIOSERVE_CPU_ASSUME=avx2" in reason
    model.load_weights(weights)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([BF16_TOKENS])).logits[0]
    assert (_bfloat16_logits(model, BF16_TOKENS) - ref).abs().max() < 0.02 * ref.abs().max()
    with pytest.raises(CpuCapabilityError, match=r"pack_weights=True, but .*TRIOSERVE_CPU_ASSUME=avx2"):
        LlamaForCausalLM(config, dtype=torch.bfloat16, pack_weights=True, cpu_paths=avx2)
    # Moved to bfloat16 later, a packed float32 model unpacks rather than fail.
    moved = LlamaForCausalLM(config, cpu_paths=avx2)
    assert moved.pack_weights == avx2.available("onednn_packed_float32")
    moved.load_weights(weights)
    moved.to(torch.bfloat16)
    assert (_bfloat16_logits(moved, BF16_TOKENS) - ref).abs().max() < 0.02 * ref.abs().max()
    assert not moved._made.packed
