"""``POST /v1/embeddings`` through the ``openai`` client against real
loopback servers: the default model with ``--task embed`` (last-token
pooling, normalised), and tiny random sentence-transformers folders written
here (mean pooling with Matryoshka dimensions; CLS without normalising),
each vector checked against transformers' final hidden states pooled the
same way.

The servers prefill at most a few tokens a step, so the prompts are pooled
over several chunks (mean pooling adds each chunk's rows as they come).
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import httpx
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.testing.tiny_model import write_word_tokenizer
from trioserve.web.app import create_app
from trioserve.web.settings import ModelSpec

from server_fixtures import MODEL, server_config, server_in_thread

pytestmark = pytest.mark.slow

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map a text to a vector.",
    "Paris is the capital of France, and its largest city by far.",
)
# float32 weights on both sides, but other kernels and summation orders,
# and the default server's KV cache may hold 16 bits (kv_cache_dtype auto):
# its unit vectors are compared to 1e-3.
DEFAULT_TOLERANCE = 1e-3
# The tiny models run with a float32 KV cache: 1e-5 (a 16-bit one showed 8e-5).
TINY_TOLERANCE = 1e-5
TINY_VOCAB = 64
TINY = "tiny-st"


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


# -- the default model with --task embed ------------------------------------------


@pytest.fixture(scope="module")
def default_server(default_loaded):
    config = server_config(engine=dict(task="embed", max_num_batched_tokens=8, warm_up=False))
    with server_in_thread(create_app(config, loaded=default_loaded)) as running:
        yield running


@pytest.fixture(scope="module")
def default_client(default_server):
    return _client(default_server)


@pytest.fixture(scope="module")
def default_reference():
    """transformers' model on the default GGUF: its last token's final hidden state (after the final norm), normalised."""
    from transformers import AutoModelForCausalLM

    from trioserve.engine.loading.sources import default_model_path

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    def embed(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        return torch.nn.functional.normalize(hidden[-1], dim=0)

    return embed


def test_default_model_vectors_equal_transformers(default_server, default_client, default_reference):
    # The client asks for base64 unless told otherwise, and decodes it.
    result = default_client.embeddings.create(model=MODEL, input=list(TEXTS))
    assert result.object == "list" and result.model == MODEL
    assert [d.index for d in result.data] == [0, 1, 2]
    total = 0
    for text, data in zip(TEXTS, result.data):
        ids = httpx.post(f"{default_server.url}/tokenize", json={"prompt": text}).json()["tokens"]
        total += len(ids)
        expected = default_reference(ids)
        got = torch.tensor(data.embedding)
        assert got.shape == expected.shape
        assert torch.allclose(got, expected, atol=DEFAULT_TOLERANCE, rtol=0), (got - expected).abs().max()
    assert result.usage.prompt_tokens == result.usage.total_tokens == total


def test_base64_decodes_to_the_float_vector(default_server):
    body = {"model": MODEL, "input": TEXTS[0]}
    floats = httpx.post(f"{default_server.url}/v1/embeddings", json={**body, "encoding_format": "float"}, timeout=60)
    packed = httpx.post(f"{default_server.url}/v1/embeddings", json={**body, "encoding_format": "base64"}, timeout=60)
    assert floats.status_code == packed.status_code == 200, floats.text + packed.text
    vector = floats.json()["data"][0]["embedding"]
    raw = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == vector
    assert packed.json()["data"][0]["object"] == "embedding"


def test_the_prefix_cache_does_not_change_a_vector(default_server, default_client):
    # Last-token pooling may read the prefix cache: the second call's full
    # blocks are hits, and only its tail is computed.
    text = TEXTS[2] + " It lies on the Seine."
    cold = default_client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
    warm = default_client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
    if _invariant(default_server):
        assert warm == cold
    else:
        assert torch.allclose(torch.tensor(warm), torch.tensor(cold), atol=1e-5, rtol=0)


def test_an_embed_server_refuses_generation(default_server, default_client):
    with pytest.raises(openai.BadRequestError) as exc_info:
        default_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert _error(exc_info)["param"] == "model" and "--task embed" in _error(exc_info)["message"]
    with pytest.raises(openai.BadRequestError) as exc_info:
        default_client.completions.create(model=MODEL, prompt="hi")
    assert _error(exc_info)["param"] == "model"
    assert [m.id for m in default_client.models.list().data] == [MODEL]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": TEXTS[0], "dimensions": 8}, "dimensions"),  # the default model declares no Matryoshka
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[1, 2], "mixed", 3]}, "input"),
        ({"input": [[1, 10**9]]}, "input"),  # outside the vocabulary
        ({"input": TEXTS[0], "encoding_format": "int8"}, "encoding_format"),
        ({"input": TEXTS[0], "dimensions": 0}, "dimensions"),
    ],
)
def test_bad_fields_are_named(default_server, body, param):
    response = httpx.post(f"{default_server.url}/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- tiny sentence-transformers folders ---------------------------------------------


def _write_st_folder(folder: Path, *, arch: str, mode: str, normalize: bool, matryoshka: bool) -> None:
    """A tiny random model saved by transformers, with sentence-transformers'
    modules.json and 1_Pooling/config.json (and 2_Normalize when ``normalize``).
    Saved with its LM head: the loader takes ``*ForCausalLM`` checkpoints
    only, not bare ``*Model`` ones."""
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    if matryoshka:
        common["is_matryoshka"] = True
    torch.manual_seed(len(mode))
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8, tie_word_embeddings=True))
    model.save_pretrained(str(folder))
    write_word_tokenizer(folder, TINY_VOCAB)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **modes}))


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    mean = tmp_path_factory.mktemp("st-mean")
    _write_st_folder(mean, arch="llama", mode="mean_tokens", normalize=True, matryoshka=True)
    cls = tmp_path_factory.mktemp("st-cls")
    _write_st_folder(cls, arch="qwen3", mode="cls_token", normalize=False, matryoshka=False)
    return {"mean": mean, "cls": cls}


def _tiny_server(folder: Path, **engine):
    # No --task: a sentence-transformers folder is served as an embedding model.
    config = server_config(
        # A float32 KV cache (auto may store 16 bits): the tight tolerance then holds.
        engine=dict(max_num_batched_tokens=8, warm_up=False, kv_cache_dtype="float32", **engine),
        models=(ModelSpec(TINY, str(folder)),),
    )
    return server_in_thread(create_app(config))


@pytest.fixture(scope="module")
def mean_server(tiny_folders):
    with _tiny_server(tiny_folders["mean"]) as running:
        yield running


@pytest.fixture(scope="module")
def cls_server(tiny_folders):
    with _tiny_server(tiny_folders["cls"]) as running:
        yield running


def _hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of ``ids``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.inference_mode():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


PROMPTS = [[5, 9, 14, 3, 22, 41, 7, 8, 30, 31, 12, 60, 4, 19, 21, 33, 50, 51, 6], [11, 12, 13], [63, 3, 3, 40, 41, 42, 43, 44, 45]]


def test_mean_pooling_over_chunks_equals_transformers(mean_server, tiny_folders):
    client = _client(mean_server)
    name = TINY
    result = client.embeddings.create(model=name, input=PROMPTS, encoding_format="float")
    for ids, data in zip(PROMPTS, result.data):
        expected = torch.nn.functional.normalize(_hidden(tiny_folders["mean"], ids).mean(dim=0), dim=0)
        got = torch.tensor(data.embedding)
        assert torch.allclose(got, expected, atol=TINY_TOLERANCE, rtol=0), (got - expected).abs().max()
    assert result.usage.prompt_tokens == sum(len(ids) for ids in PROMPTS)
    # Matryoshka (config.json's is_matryoshka): the mean cut to 8, then normalised.
    cut = client.embeddings.create(model=name, input=[PROMPTS[0]], dimensions=8, encoding_format="float").data[0]
    expected = torch.nn.functional.normalize(_hidden(tiny_folders["mean"], PROMPTS[0]).mean(dim=0)[:8], dim=0)
    assert torch.allclose(torch.tensor(cut.embedding), expected, atol=TINY_TOLERANCE, rtol=0)
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.embeddings.create(model=name, input=[PROMPTS[0]], dimensions=33)
    assert _error(exc_info)["param"] == "dimensions"


def test_cls_pooling_equals_transformers(cls_server, tiny_folders):
    client = _client(cls_server)
    name = TINY
    result = client.embeddings.create(model=name, input=PROMPTS)
    for ids, data in zip(PROMPTS, result.data):
        expected = _hidden(tiny_folders["cls"], ids)[0]  # no 2_Normalize: as it is
        got = torch.tensor(data.embedding)
        assert torch.allclose(got, expected, atol=TINY_TOLERANCE, rtol=0), (got - expected).abs().max()


def _invariant(server) -> bool:
    """Whether the served model gives a token the same bits whatever shares its step (``/version``)."""
    report = httpx.get(f"{server.url}/version").json()["invariance"]
    return all(entry["invariant"] for entry in report.values())


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.lists(st.integers(3, TINY_VOCAB - 1), min_size=1, max_size=20),
    others=st.lists(st.lists(st.integers(3, TINY_VOCAB - 1), min_size=1, max_size=20), min_size=1, max_size=3),
    position=st.integers(0, 3),
)
def test_a_vector_does_not_depend_on_its_batch(mean_server, target, others, position):
    # Mean pooling sums each chunk's rows in float64, so how a batch splits
    # the prompt into chunks does not show in the float32 vector: where the
    # model is batch-invariant (/version) the vectors are bitwise equal;
    # where it is not (attention in torch, without the native build) they
    # differ by float32 rounding (measured: 3e-8).
    client = _client(mean_server)
    alone = client.embeddings.create(model=TINY, input=[target], encoding_format="float").data[0].embedding
    batch = [*others]
    batch.insert(min(position, len(batch)), target)
    result = client.embeddings.create(model=TINY, input=batch, encoding_format="float")
    together = result.data[batch.index(target)].embedding
    if _invariant(mean_server):
        assert together == alone
    else:
        assert torch.allclose(torch.tensor(together), torch.tensor(alone), atol=1e-6, rtol=0)


def test_a_generation_server_refuses_embeddings(tiny_folders):
    with _tiny_server(tiny_folders["cls"], task="generate") as server:
        client = _client(server)
        name = TINY
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.embeddings.create(model=name, input=[[5, 6, 7]])
        error = _error(exc_info)
        assert error["param"] == "model" and "not started with --task embed" in error["message"]
