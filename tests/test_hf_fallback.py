"""The transformers fallback (engine/models/hf_fallback.py) against
transformers itself, on tiny random checkpoints of architectures without a
native family: OLMo, GPT-NeoX, Starcoder2 (tied embeddings, biases, a
sliding window), OLMo 3 (sliding and full layers) and Granite (its own
attention scale and multipliers); and Gemma 2 forced onto the fallback for
its soft-capped scores.

Logits through the paged cache match transformers' full recompute in the
continuous-batching loop of test_model_equivalence.py; greedy tokens
through the real engine match ``generate``, with prefix-cache hits; aborts
and deadlines free every KV block; bad checkpoints and architectures that
run neither way are refused naming the tensor or the architecture; the
load log and ``/v1/models`` say the model runs on the fallback.
"""

from __future__ import annotations

import json
import logging
import math

import httpx
import pytest
import safetensors.torch
import torch
import transformers
import trio
import trio.testing
from conftest import make_core
from server_fixtures import serving
from test_engine_core import run_all
from test_model_equivalence import NUM_DECODE_STEPS, SCHEMES, _check_against_hf, _run

from trioserve.actors import open_engine
from trioserve.engine.config import EngineConfig
from trioserve.engine.core.sequence import FinishReason
from trioserve.engine.errors import ModelLoadError
from trioserve.engine.loading.hf_fallback_weights import load_fallback
from trioserve.engine.loading.loader import load_model
from trioserve.engine.loading.sources import read_model_config
from trioserve.engine.models.hf_fallback import (
    TransformersForCausalLM,
    fallback_model_config,
    implementation,
    is_fallback,
    resolve_model_config,
)
from trioserve.engine.parallel.tp_runner import start_tensor_parallel
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import write_word_tokenizer
from trioserve.web.app import create_app
from trioserve.web.settings import ModelSpec, ServerConfig

VOCAB = 61
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
HF_MODELS = {
    "olmo": lambda: transformers.OlmoConfig(**SIZES, num_key_value_heads=2, max_position_embeddings=1024),
    # Fused q/k/v, partial rotary, a parallel residual; no GQA.
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SIZES, rotary_pct=0.5, max_position_embeddings=1024),
    # Tied embeddings, biases, a sliding window of 8 on every layer.
    "starcoder2": lambda: transformers.Starcoder2Config(
        **SIZES, num_key_value_heads=2, sliding_window=8, max_position_embeddings=128, tie_word_embeddings=True
    ),
    # q/k norms, sliding and full layers.
    "olmo3": lambda: transformers.Olmo3Config(
        **SIZES, num_key_value_heads=2, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
    ),  # fmt: skip
    # Its own attention scale (attention_multiplier) and residual/logit multipliers.
    "granite": lambda: transformers.GraniteConfig(
        **SIZES, num_key_value_heads=1, attention_multiplier=0.3, residual_multiplier=0.7,
        embedding_multiplier=2.0, logits_scaling=1.5, max_position_embeddings=256,
    ),  # fmt: skip
}
GREEDY = dict(temperature=0.0, ignore_eos=True)
# Small blocks, so that a 20-token prompt fills blocks the prefix cache keeps.
ENGINE = dict(block_size=4, kv_cache_dtype="float32", max_num_batched_tokens=16, max_num_seqs=8)


def _save(kind: str, path) -> transformers.PreTrainedModel:
    """A seeded random ``kind`` model with a word-level tokenizer, saved to
    ``path``; returned as transformers runs it (eager attention, float32)."""
    torch.manual_seed(0)
    config = HF_MODELS[kind]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # transformers' init (std 0.02) gives near-uniform attention and tiny
    # logits that would hide position or masking bugs: unit-variance
    # activations and peaked attention instead.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(1.5 * torch.randn_like(p) / math.sqrt(p.shape[1]))
    model.save_pretrained(path)
    write_word_tokenizer(path, VOCAB)
    return model


def _load_ours(path) -> TransformersForCausalLM:
    return load_fallback(path, read_model_config(path), dtype=torch.float32, device=torch.device("cpu"))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", HF_MODELS)
def test_logits_through_the_paged_cache_match_transformers(kind, scheme, tmp_path):
    block_size, splits, all_logits = SCHEMES[scheme]
    hf = _save(kind, tmp_path)
    model = _load_ours(tmp_path)
    assert is_fallback(model.config) and model.config.architecture == type(hf).__name__
    seqs, mixed = _run(model, vocab=VOCAB, block_size=block_size, splits=splits, all_logits=all_logits, seed=7)
    assert mixed >= 3  # decode tokens shared steps with other sequences' prompt chunks
    for s in seqs:
        assert len(s.logits) == (s.prompt_len if all_logits else 1) + NUM_DECODE_STEPS
    _check_against_hf(hf, seqs)


def test_soft_capped_scores_and_windows_run_on_the_fallback_too(tmp_path):
    # Gemma 2 is native, but through the fallback it shows the attention
    # function computing softcap, query_pre_attn_scalar and sliding windows.
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**SIZES, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                       attn_logit_softcapping=3.0, final_logit_softcapping=20.0,
                                       query_pre_attn_scalar=12, max_position_embeddings=256)  # fmt: skip
    config._attn_implementation = "eager"
    hf = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1.0 / math.sqrt(p.shape[-1]) * 2))
    hf.save_pretrained(tmp_path)
    hf_json = json.loads((tmp_path / "config.json").read_text())
    model = load_fallback(tmp_path, fallback_model_config(hf_json), dtype=torch.float32, device=torch.device("cpu"))
    block_size, splits, all_logits = SCHEMES["all-logits"]
    seqs, _ = _run(model, vocab=VOCAB, block_size=block_size, splits=splits, all_logits=all_logits, seed=3)
    _check_against_hf(hf, seqs)


def _generate(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens; EOS is an ordinary token, as under
    ``ignore_eos`` (min_new_tokens would forbid it instead)."""
    hf.generation_config.eos_token_id = None  # a None argument would fall back to it
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["olmo", "gpt_neox"])
def test_engine_greedy_tokens_equal_generate_with_prefix_cache_hits(kind, tmp_path):
    hf = _save(kind, tmp_path)
    loaded = load_model(str(tmp_path))
    assert isinstance(loaded.model, TransformersForCausalLM)
    prompts = {f"r{i}": [3 + (7 * i + 5 * j) % (VOCAB - 3) for j in range(20 + 3 * i)] for i in range(3)}
    expected = {rid: _generate(hf, prompt, 64) for rid, prompt in prompts.items()}
    core = make_core(loaded, **ENGINE)
    for rid, prompt in prompts.items():  # together: chunked prompts mix with decodes
        core.add_request(rid, prompt, SamplingParams(max_tokens=64, **GREEDY))
    together = run_all(core)
    assert {rid: together[(rid, 0)]["tokens"] for rid in prompts} == expected
    # Again, alone: the prompt's full blocks come from the prefix cache.
    hits = core.block_manager.statistics().prefix_cache_hits
    core.add_request("again", prompts["r2"], SamplingParams(max_tokens=64, **GREEDY))
    again = run_all(core)[("again", 0)]
    assert again["num_cached_tokens"] >= 16
    assert core.block_manager.statistics().prefix_cache_hits > hits
    assert again["tokens"] == expected["r2"]


def test_abort_frees_every_block(tmp_path):
    _save("olmo", tmp_path)
    core = make_core(load_model(str(tmp_path)), **ENGINE)
    free_before = core.block_manager.statistics().num_free_blocks
    core.add_request("long", list(range(3, 30)), SamplingParams(max_tokens=200, **GREEDY))
    core.add_request("other", list(range(5, 12)), SamplingParams(max_tokens=8, **GREEDY))
    for _ in range(4):
        core.step()
    assert core.block_manager.statistics().num_free_blocks < free_before
    assert core.abort("long")
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.request_id == "long"] == [("long", FinishReason.ABORT)]
    assert list(core.scheduler.block_holders()) == ["other"]
    assert run_all(core)[("other", 0)]["finish"] is FinishReason.LENGTH
    assert core.block_manager.statistics().num_free_blocks == free_before
    core.block_manager.check_invariants({})


async def test_deadline_ends_a_request_and_frees_its_blocks_while_others_finish(tmp_path):
    hf = _save("olmo", tmp_path)
    loaded = load_model(str(tmp_path))
    config = EngineConfig(model=str(tmp_path), kv_cache_memory=16 << 20, warm_up=False, **ENGINE)
    short = list(range(3, 15))
    async with open_engine(config, loaded=loaded) as engine:

        async def long_request() -> FinishReason | None:
            # ~1000 steps of a few ms each: the 0.3 s deadline ends it first.
            last = None
            params = SamplingParams(max_tokens=1000, **GREEDY)
            async for out in engine.generate(list(range(3, 20)), params, timeout=0.3):
                last = out.finish_reason
            return last

        results = {}
        async with trio.open_nursery() as nursery:
            async def run_long() -> None:
                results["long"] = await long_request()

            nursery.start_soon(run_long)
            tokens = []
            async for out in engine.generate(short, SamplingParams(max_tokens=24, **GREEDY)):
                tokens.extend(out.new_token_ids)
        assert results["long"] is FinishReason.DEADLINE
        assert tokens == _generate(hf, short, 24)
        # The long reader ended itself at its deadline and sent the abort,
        # which the scheduler applies at a step boundary, maybe after a
        # step still in its thread. A later request passes that boundary,
        # and is served as before.
        after = []
        async for out in engine.generate(short, SamplingParams(max_tokens=4, **GREEDY)):
            after.extend(out.new_token_ids)
        assert after == tokens[:4]
        await trio.testing.wait_all_tasks_blocked()  # the released blocks go back between steps
        kv = engine.statistics().allocator.kv
        assert kv.num_free_blocks == kv.num_blocks


def _weights(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(path / "model.safetensors")


def _rewrite(path, weights: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_tensor_is_refused_naming_it(tmp_path):
    _save("olmo", tmp_path)
    weights = _weights(tmp_path)
    del weights["model.layers.1.self_attn.k_proj.weight"]
    _rewrite(tmp_path, weights)
    with pytest.raises(ModelLoadError, match=r"missing .*'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(str(tmp_path))


def test_an_extra_tensor_is_refused_naming_it(tmp_path):
    _save("gpt_neox", tmp_path)
    weights = _weights(tmp_path)
    weights["gpt_neox.layers.2.mlp.dense_h_to_4h.weight"] = torch.zeros(64, 32)  # a third layer the config lacks
    _rewrite(tmp_path, weights)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'gpt_neox\.layers\.2\.mlp\.dense_h_to_4h\.weight'"):
        load_model(str(tmp_path))


def test_a_wrong_shape_is_refused_naming_the_tensor_and_both_shapes(tmp_path):
    _save("granite", tmp_path)
    weights = _weights(tmp_path)
    weights["model.layers.0.mlp.up_proj.weight"] = torch.zeros(48, 32)
    _rewrite(tmp_path, weights)
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(48, 32\).*\(64, 32\)"):
        load_model(str(tmp_path))


def test_a_tied_checkpoint_with_a_redundant_head_loads(tmp_path):
    hf = _save("starcoder2", tmp_path)
    weights = _weights(tmp_path)
    assert "lm_head.weight" not in weights
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    _rewrite(tmp_path, weights)
    model = _load_ours(tmp_path)
    embed = model.hf_model.get_input_embeddings().weight
    assert model.hf_model.get_output_embeddings().weight is embed
    assert torch.equal(embed, hf.get_input_embeddings().weight)


def _write_config(path, hf: dict) -> None:
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize(
    ("hf", "why"),
    [
        ({"architectures": ["BertModel"], "model_type": "bert"}, "no causal-LM class named BertModel"),
        ({"architectures": ["NotARealModelForCausalLM"], "model_type": "nope"}, "no causal-LM class named NotARealModelForCausalLM"),
        ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "does not route its attention through the attention interface"),
        ({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "is_encoder_decoder": True}, "encoder-decoder"),
    ],
)  # fmt: skip
def test_an_architecture_that_runs_neither_way_is_refused_naming_it(hf, why, tmp_path):
    _write_config(tmp_path, hf)
    with pytest.raises(ModelLoadError) as raised:
        read_model_config(tmp_path)
    message = str(raised.value)
    assert f"unsupported architecture {hf['architectures'][0]}" in message
    assert "natively supported: LlamaForCausalLM" in message and "transformers fallback" in message
    assert why in message


def test_a_bidirectional_causal_lm_class_is_refused_at_its_probe_step(tmp_path):
    # BertLMHeadModel is in transformers' causal-LM mapping and uses the
    # attention interface, but without is_decoder it attends both ways.
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)  # fmt: skip
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"BertLMHeadModel cannot run on the transformers fallback: ValueError: layer 0: bidirectional"):
        _load_ours(tmp_path)


def test_native_architectures_stay_native_and_others_fall_back():
    native = resolve_model_config(transformers.LlamaConfig(**SIZES).to_dict() | {"architectures": ["LlamaForCausalLM"]})
    assert not is_fallback(native) and implementation(native) == "native"
    olmo = resolve_model_config(HF_MODELS["olmo"]().to_dict() | {"architectures": ["OlmoForCausalLM"]})
    assert is_fallback(olmo) and implementation(olmo) == "transformers"
    assert (olmo.num_hidden_layers, olmo.num_key_value_heads, olmo.head_dim, olmo.vocab_size) == (2, 2, 8, VOCAB)
    assert olmo.eos_token_ids == (2,)


def test_features_only_native_families_have_are_refused_naming_the_option(tmp_path):
    _save("olmo", tmp_path)
    with pytest.raises(ModelLoadError, match=r"OlmoForCausalLM runs on the transformers fallback.*quantization='int8'"):
        load_model(str(tmp_path), quantization="int8")
    with pytest.raises(ModelLoadError, match=r"does not support tensor parallelism \(tensor_parallel_size=2"):
        start_tensor_parallel(EngineConfig(model=str(tmp_path), tensor_parallel_size=2))
    assert load_model(str(tmp_path), quantization="auto").model.projection_choice.quantization is None


async def test_the_log_and_v1_models_say_it_runs_on_the_fallback(tmp_path, caplog):
    _save("olmo", tmp_path)
    engine = EngineConfig(kv_cache_memory=16 << 20, warm_up=False, **ENGINE)
    config = ServerConfig(engine=engine, models=(ModelSpec("tiny-olmo", str(tmp_path)),), shutdown_timeout=5.0)
    with caplog.at_level(logging.WARNING, logger="trioserve"):
        async with serving(create_app(config)) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
            models = (await http.get("/v1/models")).json()["data"]
            completion = await http.post(
                "/v1/completions", json={"model": "tiny-olmo", "prompt": "w3 w4 w5", "max_tokens": 4, "temperature": 0}
            )
    assert [(m["id"], m["implementation"]) for m in models] == [("tiny-olmo", "transformers")]
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("runs on the transformers fallback" in w and "slower" in w for w in warnings), warnings


def test_a_model_with_layers_that_do_not_attend_is_refused_at_its_probe_step(tmp_path):
    # LFM2's convolution layers keep state the paged KV cache does not hold.
    config = transformers.Lfm2Config(**SIZES | {"num_hidden_layers": 3}, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention", "conv"], max_position_embeddings=64)  # fmt: skip
    transformers.Lfm2ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"Lfm2ForCausalLM cannot run .* as \[1\], not once each of its 3 \(num_hidden_layers\)"):
        _load_ours(tmp_path)
