"""Prompt logprobs (``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``)
and batched prompts on ``/v1/completions``, against a real loopback server
on the default model, checked against transformers' model on the same GGUF.

The server prefills at most 32 tokens a step, so the longer prompts here
are scored over several chunks; a prefix-cache hit must not change them.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from trioserve.web.app import create_app
from trioserve.web.errors import InvalidRequest
from trioserve.web.protocol import ChatCompletionRequest

from server_fixtures import MODEL, parse_sse, server_config, server_in_thread

pytestmark = pytest.mark.slow

# Long enough to span several 32-token prefill chunks and 16-token blocks.
LONG = (
    "The history of the bicycle began in the early nineteenth century, when inventors in Germany and France "
    "built wooden machines pushed along by the rider's feet. Pedals, chains and pneumatic tyres came later, "
    "and by 1900 cycling was a popular pastime across Europe and America."
)
# float32 on both sides, but other kernels and summation orders: measured
# differences are within 5e-3, most under 1e-3.
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def server(default_loaded):
    config = server_config(engine=dict(max_num_batched_tokens=32))
    with server_in_thread(create_app(config, loaded=default_loaded)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def reference():
    """transformers' model on the default GGUF: log-softmax of its logits."""
    from transformers import AutoModelForCausalLM

    from trioserve.engine.loading.sources import default_model_path

    gguf = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()

    def logprobs(ids: list[int]) -> list[float]:
        """The logprob of each of ``ids[1:]`` given the ones before it."""
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        scores = torch.log_softmax(logits[:-1], dim=-1)
        return scores.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist()

    return logprobs


def tokenize(http: httpx.Client, text: str) -> list[int]:
    response = http.post("/tokenize", json={"prompt": text})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def complete(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def vllm_values(choice: dict, ids: list[int]) -> list[float]:
    """The prompt tokens' logprobs out of vLLM's ``prompt_logprobs``."""
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    return [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])]


def test_echo_logprobs_equal_transformers(server, reference, http):
    ids = tokenize(http, LONG)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        completion = client.completions.create(model=MODEL, prompt=LONG, echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = completion.choices[0]
    assert choice.text.startswith(LONG)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[: len(ids)]) == LONG
    assert logprobs.text_offset[: 3] == [0, len(logprobs.tokens[0]), len(logprobs.tokens[0]) + len(logprobs.tokens[1])]
    expected = reference(ids)
    ours = logprobs.token_logprobs[1 : len(ids)]
    assert max(abs(a - b) for a, b in zip(ours, expected)) < TOLERANCE
    # Each position's top entry holds the prompt token (OpenAI's shape) and
    # the most likely one, which is at least as likely.
    for token, value, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == value and max(top.values()) >= value


def test_max_tokens_zero_with_echo_returns_the_prompt_only(http):
    ids = tokenize(http, "Paris is the capital of France")
    body = complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)
    choice = body["choices"][0]
    assert choice["text"] == "Paris is the capital of France"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert all(not math.isnan(v) for v in choice["logprobs"]["token_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    # Without logprobs, echo puts the prompt first all the same.
    assert complete(http, prompt="Hello there", echo=True, max_tokens=0)["choices"][0]["text"] == "Hello there"


def test_a_batch_of_prompts_equals_each_prompt_alone(http):
    prompts = ["The capital of France is", "One, two, three,", "Water boils at"]
    alone = [complete(http, prompt=p, max_tokens=6, logprobs=2, n=2)["choices"] for p in prompts]
    batched = complete(http, prompt=prompts, max_tokens=6, logprobs=2, n=2)
    assert [c["index"] for c in batched["choices"]] == list(range(6))
    for i, choices in enumerate(alone):
        for choice in choices:
            together = batched["choices"][i * 2 + choice["index"]]
            assert together["text"] == choice["text"]
            assert together["logprobs"]["tokens"] == choice["logprobs"]["tokens"]
            assert together["logprobs"]["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)
    # Token-id prompts batch too, with echo and prompt logprobs.
    ids = [tokenize(http, p) for p in prompts]
    batched = complete(http, prompt=ids, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=0)
    for i, choice in enumerate(batched["choices"]):
        alone = complete(http, prompt=ids[i], max_tokens=1, echo=True, logprobs=1, prompt_logprobs=0)["choices"][0]
        assert choice["text"] == alone["text"]
        assert vllm_values(choice, ids[i]) == pytest.approx(vllm_values(alone, ids[i]), abs=1e-4)
    assert batched["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_prompt_logprobs_survive_chunked_prefill_and_a_prefix_cache_hit(http, reference):
    text = LONG + " Today there are more bicycles than cars in many cities."
    ids = tokenize(http, text)
    assert len(ids) > 2 * 32  # three chunks or more
    first = complete(http, prompt=text, max_tokens=1, prompt_logprobs=3)
    uncached = vllm_values(first["choices"][0], ids)
    assert max(abs(a - b) for a, b in zip(uncached, reference(ids))) < TOLERANCE
    entry = first["choices"][0]["prompt_logprobs"][5]
    ranks = sorted(v["rank"] for v in entry.values())
    assert ranks[:3] == [1, 2, 3] and len(entry) in (3, 4)
    # A plain request reuses the blocks the first one cached...
    plain = complete(http, prompt=text, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    # ... but one asking for prompt logprobs computes its whole prompt.
    again = complete(http, prompt=text, max_tokens=1, prompt_logprobs=3)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert vllm_values(again["choices"][0], ids) == pytest.approx(uncached, abs=1e-5)


def test_a_stream_carries_prompt_logprobs_in_its_first_chunk(http):
    ids = tokenize(http, "The capital of France is")
    whole = complete(http, prompt=ids, max_tokens=3, prompt_logprobs=1)["choices"][0]
    body = {"prompt": ids, "max_tokens": 3, "prompt_logprobs": 1, "temperature": 0, "stream": True}
    events = parse_sse(http.post("/v1/completions", json=body).content)
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    assert "prompt_logprobs" in chunks[0] and all("prompt_logprobs" not in c for c in chunks[1:])
    assert vllm_values(chunks[0], ids) == pytest.approx(vllm_values(whole, ids), abs=1e-5)
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_a_preempted_prompt_is_scored_once(default_loaded):
    """A request paused (preempted by recompute) after its first prompt
    chunk recomputes that chunk: its prompt logprobs come out once, each
    position once, equal to an uninterrupted run's."""
    from trioserve.engine.sampling.sampling_params import SamplingParams

    from conftest import make_core

    def run(*, pause: bool) -> list:
        core = make_core(default_loaded, max_num_batched_tokens=16)
        params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
        ids = core.add_request("r", LONG, params)
        outputs = core.step()
        if pause:
            assert core.pause("r")
            outputs += core.step()  # its blocks go back; nothing of it runs
            assert core.resume("r")
        while core.has_unfinished():
            outputs += core.step()
        scored = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        assert len(scored) == 1 and len(scored[0]) == len(ids) - 1
        assert [e.token_id for e in scored[0]] == ids[1:]
        return scored[0]

    paused, plain = run(pause=True), run(pause=False)
    assert [e.logprob for e in paused] == pytest.approx([e.logprob for e in plain], abs=1e-5)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "Hi", "echo": True, "stream": True}, "echo"),
        ({"prompt": "Hi", "echo": 1}, "echo"),
        ({"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "Hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": ["Hi", "there"], "stream": True}, "prompt"),
        ({"prompt": ["Hi", 3]}, "prompt"),
        ({"prompt": ["Hi", ""]}, "prompt"),
        # Refused by the engine after the first prompt was queued.
        ({"prompt": ["Hi", "word " * 600]}, "prompt"),
    ],
)
def test_bad_fields_are_refused_by_name(http, body, field):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


def test_prompt_logprobs_on_chat_is_refused_naming_the_field():
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
    with pytest.raises(InvalidRequest, match="prompt_logprobs is supported on /v1/completions only") as caught:
        ChatCompletionRequest.from_json(body)
    assert caught.value.param == "prompt_logprobs"
