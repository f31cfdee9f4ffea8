"""LoRA adapters (engine/lora, web/lora_api.py): greedy tokens equal PEFT's
merged model for each adapter, requests for different adapters share a
batch and each gets what it gets alone, the prefix cache is keyed by
adapter, compressed base weights run with adapters, and a real server
loads, serves, lists and unloads them at run time, refusing what does not fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from safetensors.torch import save_file

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.lora import LoraConfig, LoraError, LoraInUse, LoraModule, LoraNotFound
from trioserve.engine.lora.adapter import LoraDelta
from trioserve.engine.lora.batch import LoraBatch
from trioserve.engine.lora.projections import LoraProjections, lora_delta, wrap_layers
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.models.llama import LlamaForCausalLM
from trioserve.engine.sampling.sampling_params import SamplingParams
from trioserve.testing.tiny_model import engine_config, tiny_model_config, tokenizer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

GREEDY = dict(temperature=0.0, ignore_eos=True)
NUM_TOKENS = 24
PROMPTS = {
    "p0": [5 + (7 * j) % 900 for j in range(40)],  # 2 full blocks and a tail
    "p1": [11 + (13 * j) % 700 for j in range(9)],
}


def _init(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Seeded weights peaked enough that greedy choices do not hinge on rounding."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name or p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=generator) * scale)
            else:
                p.fill_(1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny random Llama in transformers and in the engine (same
    weights), two PEFT adapters saved by PEFT, and their merged models."""
    config = tiny_model_config()
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=True, attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    _init(hf, 1234, 0.5)
    folders, merged = {}, {}
    adapters = {
        # Every module we serve, plain scaling.
        "all": peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(_MODULES), init_lora_weights=False),
        # Some modules, one layer, rsLoRA scaling.
        "some": peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "up_proj", "down_proj"],
                                layers_to_transform=[1], use_rslora=True, init_lora_weights=False),
    }  # fmt: skip
    root = tmp_path_factory.mktemp("lora")
    for seed, (name, lora_config) in enumerate(adapters.items()):
        model = peft.get_peft_model(copy.deepcopy(hf), lora_config)
        generator = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "lora_" in param_name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        model.save_pretrained(str(root / name))
        folders[name] = root / name
        merged[name] = model.merge_and_unload().eval()
    ours = LlamaForCausalLM(config, dtype=torch.float32, device="cpu")
    ours.load_weights(hf.state_dict().items())
    loaded = LoadedModel(model=ours, model_config=config, tokenizer=tokenizer(), name="tiny-random-llama",
                         path=root, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    return dict(hf=hf, merged=merged, folders=folders, loaded=loaded, root=root)


_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _core(tiny: dict, **lora) -> EngineCore:
    modules = [LoraModule(name, str(path)) for name, path in tiny["folders"].items()]
    config = engine_config(num_blocks=64, lora=LoraConfig(modules, **lora))
    return EngineCore(tiny["loaded"], config)


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _run(
    core: EngineCore, requests: dict[str, tuple[list[int], str | None]], num_tokens: int = NUM_TOKENS
) -> dict[str, list[int]]:
    """Admit ``requests`` (id -> prompt, adapter) together and step until
    all finish; their greedy tokens."""
    for rid, (prompt, adapter) in requests.items():
        core.add_request(rid, prompt, SamplingParams(max_tokens=num_tokens, **GREEDY), lora=adapter)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    while core.has_unfinished():
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def alone(tiny) -> dict[tuple[str, str | None], list[int]]:
    """Each prompt under each adapter and the base, run one at a time."""
    core = _core(tiny)
    got = {}
    for pid, prompt in PROMPTS.items():
        for adapter in (None, "all", "some"):
            got[(pid, adapter)] = _run(core, {"r": (prompt, adapter)})["r"]
    return got


def test_greedy_tokens_equal_peft_merged_model_for_each_adapter(tiny, alone):
    for pid, prompt in PROMPTS.items():
        assert alone[(pid, None)] == _hf_greedy(tiny["hf"], prompt)
        for adapter in ("all", "some"):
            assert alone[(pid, adapter)] == _hf_greedy(tiny["merged"][adapter], prompt), (pid, adapter)
        # The adapters change what is generated: the test compares something.
        assert len({tuple(alone[(pid, a)]) for a in (None, "all", "some")}) == 3


@hypothesis.settings(max_examples=3, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(mix=st.lists(st.tuples(st.sampled_from(sorted(PROMPTS)), st.sampled_from([None, "all", "some"])),
                               min_size=2, max_size=6))  # fmt: skip
def test_requests_for_different_adapters_in_one_batch_get_what_they_get_alone(tiny, alone, mix):
    core = _core(tiny)
    requests = {f"r{i}": (PROMPTS[pid], adapter) for i, (pid, adapter) in enumerate(mix)}
    got = _run(core, requests)
    assert got == {f"r{i}": alone[key] for i, key in enumerate(mix)}


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(rows=st.integers(1, 40), pick=st.data())
def test_a_rows_delta_has_the_same_bits_whatever_rows_come_with_it(rows, pick):
    generator = torch.Generator().manual_seed(rows)
    delta = LoraDelta("qkv", 0, torch.randn(8, 96, generator=generator), torch.randn(48, 8, generator=generator), 0.7)
    x = torch.randn(rows, 96, generator=generator)
    i = pick.draw(st.integers(0, rows - 1))
    together = lora_delta(x, delta)
    assert torch.equal(together[i : i + 1], lora_delta(x[i : i + 1], delta))
    # Against the plain product in float32: its sums of ~10 and ~30 differ
    # from the delta's in rounding by up to a few 1e-5 (1.5e-5 seen on a
    # Xeon with AVX-512, at 8 rows).
    torch.testing.assert_close(together, 0.7 * (x @ delta.a.T) @ delta.b.T, rtol=1e-4, atol=1e-4)


def test_prefix_cache_is_keyed_by_adapter(tiny):
    core = _core(tiny)
    prompt = PROMPTS["p0"]  # two full blocks a later request could reuse

    def cached(adapter: str | None) -> int:
        before = core.block_manager.statistics().prefix_cache_hits
        _run(core, {"r": (prompt, adapter)}, num_tokens=2)
        return core.block_manager.statistics().prefix_cache_hits - before

    # Each lookup comes right after a run whose blocks are still cached (a
    # CPU pool reuses written blocks first, so older ones may be gone).
    assert cached("all") == 0
    assert cached("all") == 32  # the same adapter again: its two full blocks
    assert cached("some") == 0  # same tokens, another adapter: no hit
    assert cached(None) == 0  # nor the base
    assert cached(None) == 32
    assert cached("some") == 0


def test_a_reloaded_adapter_under_the_same_name_never_hits_the_old_blocks(tiny, alone):
    core = _core(tiny)
    prompt = PROMPTS["p0"]
    _run(core, {"r": (prompt, "all")}, num_tokens=2)
    core.unload_lora("all")
    core.load_lora(core.read_lora("all", str(tiny["folders"]["some"])))  # other weights, same name
    before = core.block_manager.statistics().prefix_cache_hits
    got = _run(core, {"r": (prompt, "all")})["r"]
    assert core.block_manager.statistics().prefix_cache_hits == before
    assert got == alone[("p0", "some")]  # PEFT's merged model's (the first test)


def test_load_and_unload_between_steps_and_the_refusals(tiny):
    core = _core(tiny, max_loras=3)
    core.add_request("busy", PROMPTS["p1"], SamplingParams(max_tokens=4, **GREEDY), lora="some")
    core.step()
    with pytest.raises(LoraInUse, match="'some' serves 1 running request") as info:
        core.unload_lora("some")
    assert info.value.field == "lora_name"
    while core.has_unfinished():
        core.step()
    core.unload_lora("some")
    with pytest.raises(LoraNotFound) as missing:
        core.add_request("gone", PROMPTS["p1"], lora="some")
    assert missing.value.field == "model"
    with pytest.raises(LoraNotFound):
        core.unload_lora("some")
    core.load_lora(core.read_lora("one", str(tiny["folders"]["some"])))
    core.load_lora(core.read_lora("two", str(tiny["folders"]["some"])))
    with pytest.raises(LoraError, match="max_loras reached") as full:
        core.load_lora(core.read_lora("three", str(tiny["folders"]["some"])))
    assert full.value.field == "lora_name"
    core.unload_lora("two")
    with pytest.raises(LoraError, match="already loaded"):
        core.load_lora(core.read_lora("one", str(tiny["folders"]["all"])))


def _write_adapter(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "bias": "none", **config}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def _lora_tensors(layers: range, modules: dict[str, tuple[int, int]], rank: int, seed: int, scale: float = 0.05):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for module, (fan_in, out) in modules.items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * scale
    return tensors


@pytest.mark.parametrize(
    "config, tensors, match",
    [
        (dict(r=64, lora_alpha=8, target_modules=["q_proj"]), {}, "rank 64 is over --max-lora-rank"),
        (dict(r=4, target_modules=["embed_tokens"]), {}, "target module 'embed_tokens' does not fit"),
        (dict(r=4, target_modules=["lm_head"]), {}, "target module 'lm_head' does not fit"),
        (dict(r=4, target_modules=["q_proj"], bias="all"), {}, "only adapters without biases"),
        (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]), {}, "modules_to_save"),
        (dict(r=4, target_modules=["q_proj"]), "q_wide", r"q_proj of layer 0 has A \[4, 65\]"),
        (dict(r=4, target_modules=["q_proj"]), "layer_9", "layer 9 of q_proj: the base model has 2 layers"),
    ],
)  # fmt: skip
def test_an_adapter_that_does_not_fit_is_refused_naming_the_module(tiny, tmp_path, config, tensors, match):
    core = _core(tiny)
    if tensors == "q_wide":
        tensors = _lora_tensors(range(1), {"q_proj": (65, 64)}, 4, 0)
    elif tensors == "layer_9":
        tensors = _lora_tensors(range(9, 10), {"q_proj": (64, 64)}, 4, 0)
    folder = _write_adapter(tmp_path / "bad", config, tensors or _lora_tensors(range(1), {"q_proj": (64, 64)}, 4, 0))
    with pytest.raises(LoraError, match=match) as info:
        core.read_lora("bad", str(folder))
    assert info.value.field == "lora_path"
    assert "'bad'" in str(info.value)
    with pytest.raises(LoraError, match="no adapter_config.json"):
        core.read_lora("bad", str(tmp_path))
    # The engine goes on serving.
    assert _run(core, {"r": (PROMPTS["p1"], "all")}, num_tokens=2)["r"]


# -- the default model: compressed base weights, and a real server --------------

KEY = "sesame"


def _default_shape(config) -> dict[str, tuple[int, int]]:
    """q_proj, v_proj, o_proj and down_proj of the default model: (in, out)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q), "v_proj": (hidden, kv), "o_proj": (q, hidden), "down_proj": (inter, hidden)}


def _default_adapter(folder: Path, config, seed: int, scale: float = 0.03, **fields) -> Path:
    shape = _default_shape(config)
    tensors = _lora_tensors(range(config.num_hidden_layers), shape, 8, seed, scale=scale)
    return _write_adapter(folder, dict(r=8, lora_alpha=16, target_modules=sorted(shape), **fields), tensors)


@pytest.fixture(scope="module")
def compressed_default():
    """The default model as ``trioserve serve`` loads it: Q4_1 kept compressed."""
    from trioserve.engine.loading.loader import load_model

    loaded = load_model(None, quantization="auto")
    if loaded.projection_choice.quantization is None:
        pytest.skip(f"no compressed path on this machine: {loaded.projection_choice}")
    return loaded


@pytest.mark.slow
def test_compressed_base_weights_run_with_an_adapter(compressed_default, default_loaded, tmp_path):
    from trioserve.engine.kernels.projections import QuantizedProjections

    config = compressed_default.model_config
    folder = _default_adapter(tmp_path / "a", config, seed=5)
    lora = LoraConfig([LoraModule("a", str(folder))])
    compressed = EngineCore(compressed_default, EngineConfig(kv_cache_memory=64 << 20, warm_up=False, lora=lora))
    invariance = compressed.projection_choice.invariance
    assert not invariance.invariant and "LoRA" in invariance.reason

    # One layer's projections: the compressed base's output plus exactly the
    # adapter's delta (a torch reference) on the adapter's rows, untouched elsewhere.
    base = compressed_default.model._projections().layers[0]
    assert isinstance(base, QuantizedProjections)
    adapter = compressed.lora.get("a")
    wrapped = wrap_layers(LoraBatch.build([None, adapter, None], [2, 3, 1], "cpu"), [base])[0]
    assert isinstance(wrapped, LoraProjections)
    x = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain, added = base.qkv(x), wrapped.qkv(x)
    (q,) = [d for d in adapter.layers[0] if d.start == 0 and d.projection == "qkv"]
    reference = q.scaling * (x[2:5] @ q.a.T) @ q.b.T
    assert torch.equal(added[[0, 1, 5]], plain[[0, 1, 5]])
    torch.testing.assert_close(added[2:5, : q.b.shape[0]] - plain[2:5, : q.b.shape[0]], reference, rtol=1e-4, atol=1e-4)

    # The whole model: through the compressed weights, the next token's
    # logits stray from the float model's of the same weights (dequantized:
    # the rounding of activations) with the adapter as they do without
    # (measured on avx512vnni: 39 against 19 in norm; on an AVX2-only CPU,
    # whose prompts round activations to int16 per row: 104 against 109; a
    # random adapter pushes activations where rounding costs more, so up to
    # 3x is allowed), while the adapter moves them more than that (200 in
    # norm: 1.9x the AVX2 stray; were the adapter lost on the compressed
    # path, its stray would be about the effect itself); and the greedy
    # choice with the adapter is the float model's.
    floating = EngineCore(default_loaded, EngineConfig(kv_cache_memory=64 << 20, warm_up=False, lora=lora))
    prompt = compressed.tokenize("The capital of France is")
    logits = {
        (name, adapter_name): _next_logits(core, prompt, adapter_name)
        for name, core in (("compressed", compressed), ("float", floating))
        for adapter_name in (None, "a")
    }
    stray = {a: float((logits[("compressed", a)] - logits[("float", a)]).norm()) for a in (None, "a")}
    effect = float((logits[("float", "a")] - logits[("float", None)]).norm())
    assert stray["a"] < 3 * stray[None], stray
    assert effect > 1.5 * stray["a"], (effect, stray)
    assert int(logits[("compressed", "a")].argmax()) == int(logits[("float", "a")].argmax())


def _next_logits(core: EngineCore, prompt: list[int], adapter: str | None) -> torch.Tensor:
    """The logits after ``prompt`` under ``adapter``, from one forward as the runner builds it."""
    import attrs

    from trioserve.engine.layers.forward_batch import ForwardBatch, SeqChunk

    blocks = list(range(-(-len(prompt) // core.config.block_size)))
    batch = ForwardBatch.build([SeqChunk(prompt, 0, blocks)], block_size=core.config.block_size, device="cpu")
    lora = LoraBatch.build([None if adapter is None else core.lora.get(adapter)], [len(prompt)], "cpu")
    with torch.inference_mode():
        return core.runner.model(attrs.evolve(batch, lora=lora), core.kv_cache)[0]


@pytest.fixture(scope="module")
def lora_server(default_loaded, tmp_path_factory):
    """A real server on the default model, behind an API key, serving adapter
    ``sql`` from the start (``--lora-modules``), at most two loaded at once."""
    from server_fixtures import server_config, server_in_thread

    from trioserve.web.app import create_app

    root = tmp_path_factory.mktemp("adapters")
    config = default_loaded.model_config
    # Strong enough to change the first few greedy tokens.
    folders = {name: _default_adapter(root / name, config, seed, 0.08) for seed, name in enumerate(("sql", "later", "third"))}
    folders["bad_rank"] = _write_adapter(root / "bad_rank", dict(r=32, target_modules=["q_proj"]), {})
    folders["bad_module"] = _write_adapter(root / "bad_module", dict(r=8, target_modules=["q_proj", "embed_tokens"]), {})
    lora = LoraConfig([LoraModule("sql", str(folders["sql"]))], max_loras=2)
    app = create_app(server_config(api_key=KEY, engine=dict(lora=lora)), loaded=default_loaded)
    with server_in_thread(app) as running:
        yield running, folders


@pytest.mark.slow
def test_a_server_serves_lists_loads_and_unloads_adapters_and_refuses_what_does_not_fit(lora_server):
    import httpx
    import openai

    from server_fixtures import MODEL

    server, folders = lora_server
    headers = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    http = httpx.Client(base_url=server.url, headers=headers, timeout=60)

    def listed() -> dict[str, dict]:
        return {m.id: m.model_dump() for m in client.models.list().data}

    def load(**body) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", json=body)

    def refused(response: httpx.Response, status: int, param: str, match: str) -> None:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and match in error["message"], error

    def complete(model: str, max_tokens: int = 6, prompt: str = "SELECT name FROM") -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert reply.model == model
        return reply.choices[0].text

    with client, http:
        models = listed()
        assert models["sql"]["parent"] == MODEL and models["sql"]["root"] == str(folders["sql"])
        base, sql = complete(MODEL), complete("sql")
        assert base != sql  # the adapter runs
        assert complete("sql") == sql  # and the same way each time
        chat = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "sql" and chat.choices[0].message.content

        # Behind the API key like the rest.
        assert httpx.post(server.url + "/v1/load_lora_adapter", json={}).status_code == 401

        # A stream on the base model runs on while adapters come and go.
        stream = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=0, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        assert load(lora_name="later", lora_path=str(folders["later"])).status_code == 200
        assert listed()["later"]["parent"] == MODEL
        assert complete("later")
        refused(load(lora_name="third", lora_path=str(folders["third"])), 400, "lora_name", "max_loras reached")
        refused(load(lora_name="x", lora_path=str(folders["bad_rank"])), 400, "lora_path", "rank 32 is over --max-lora-rank")
        refused(load(lora_name="x", lora_path=str(folders["bad_module"])), 400, "lora_path", "'embed_tokens' does not fit")
        refused(load(lora_name="x", lora_path=str(folders["sql"]) + "-missing"), 400, "lora_path", "is not a folder")
        refused(load(lora_path=str(folders["third"])), 400, "lora_name", "lora_name is required")
        refused(load(lora_name=MODEL, lora_path=str(folders["third"])), 400, "lora_name", "is taken")
        refused(http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "lora_name", "'nope'")
        text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert text == complete(MODEL, 12, "Once upon")  # the stream was not disturbed

        # An adapter running a request is not unloaded under it.
        busy = iter(client.completions.create(model="later", prompt="Hello", max_tokens=40, temperature=0, stream=True))
        next(busy)
        refused(http.post("/v1/unload_lora_adapter", json={"lora_name": "later"}), 409, "lora_name", "running request")
        list(busy)
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "later"}).status_code == 200
        assert "later" not in listed()
        with pytest.raises(openai.NotFoundError):
            complete("later")
        with pytest.raises(openai.NotFoundError):
            complete("unknown-model")
        assert complete("sql") == sql


def test_the_flags_reach_the_engine_config():
    from trioserve.web.serve_options import build_serve_parser, server_config_from_args

    parser = build_serve_parser()
    assert server_config_from_args(parser.parse_args([])).engine.lora is None
    args = parser.parse_args(
        ["--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}',
         "--lora-modules", "more=/a/more", "--max-loras", "5", "--max-lora-rank", "32"]
    )  # fmt: skip
    lora = server_config_from_args(args).engine.lora
    assert lora == LoraConfig(
        [LoraModule("sql", "/a/sql"), LoraModule("chat", "/a/chat", "base"), LoraModule("more", "/a/more")],
        max_loras=5, max_lora_rank=32,
    )  # fmt: skip
    assert server_config_from_args(parser.parse_args(["--enable-lora"])).engine.lora == LoraConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])


def test_the_registry_forgets_ended_requests_as_it_goes():
    from trioserve.engine.lora import LoraRef, LoraRegistry

    registry, ref, running = LoraRegistry(1, 8), LoraRef("a", "0"), {"r999"}
    for i in range(1000):
        registry.use(f"r{i}", ref, running.__contains__)
    assert len(registry._users) < 200  # pruned as it doubled: ended requests do not pile up
    with pytest.raises(LoraInUse, match="r999"):
        registry.check_unused("a", running.__contains__)
    registry.check_unused("a", set().__contains__)
    assert not registry._users
