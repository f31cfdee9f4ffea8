"""Same request, same answer over HTTP (issue 39): the same greedy chat
request to a real ``trioserve serve`` on loopback gets the same tokens and
logprobs cold, with its prompt in the prefix cache, batched among other
requests, and after a restart into another server whose model step runs
in a worker process (and, in process, across data-parallel replicas)."""

from __future__ import annotations

import httpx
import pytest
import trio

from trioserve.actors import open_engine
from trioserve.bench.process import serving_process
from trioserve.engine.config import EngineConfig
from trioserve.engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
OTHERS = [
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Say hello in Spanish.",
    "Summarise: the quick brown fox jumps over the lazy dog. " * 6,
    "What is two plus two?",
    "List the days of the week.",
    "Why is the sky blue?",
]


def _body(content: str) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 2,
    }


async def _ask(http: httpx.AsyncClient, content: str) -> tuple[str, list]:
    response = await http.post("/v1/chat/completions", json=_body(content))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"], choice["logprobs"]["content"]


async def _batched(http: httpx.AsyncClient) -> tuple[str, list]:
    """QUESTION sent among the others at once; its answer."""
    answers: dict[str, tuple[str, list]] = {}

    async def ask(content: str) -> None:
        answers[content] = await _ask(http, content)

    async with trio.open_nursery() as nursery:
        for content in [*OTHERS[:4], QUESTION, *OTHERS[4:]]:
            nursery.start_soon(ask, content)
    return answers[QUESTION]


async def test_the_same_greedy_request_gets_the_same_answer_cold_warm_batched_and_after_a_restart():
    answers = []
    with serving_process(["--max-num-batched-tokens", "64"]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            version = (await http.get("/version")).json()
            (choice,) = version["cpu"]["models"].values()
            assert choice["invariance"]["invariant"], choice
            assert version["invariance"] == {"SmolLM2-135M-Instruct": choice["invariance"]}
            answers.append(await _ask(http, QUESTION))  # cold
            answers.append(await _ask(http, QUESTION))  # its prompt in the prefix cache
            answers.append(await _batched(http))  # among eight, the long one chunked
    # A restart into another process, the model step in a worker process.
    with serving_process(["--worker-mode", "process"]) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            answers.append(await _ask(http, QUESTION))
            answers.append(await _batched(http))
    text, logprobs = answers[0]
    assert text and len(logprobs) > 1
    for i, answer in enumerate(answers[1:], 1):
        assert answer == answers[0], (i, answer[0], text)


async def test_data_parallel_replicas_give_a_request_the_same_tokens():
    """Two replicas in one process, each with its own model and KV pool: a
    request gets the same tokens and logprobs from either, alone or batched."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    prompt = [{"role": "user", "content": QUESTION}]
    # max_num_seqs 4: the router follows prefix affinity only within 2
    # requests of the least loaded replica, so both replicas serve some.
    config = EngineConfig(data_parallel_size=2, max_num_seqs=4, kv_cache_memory=64 << 20, warm_up=False)
    results: list[tuple[tuple[int, ...], tuple]] = []

    async def run(engine) -> None:
        tokens, logprobs = [], []
        async for output in engine.generate(prompt, params):
            tokens += output.new_token_ids
            logprobs += output.logprobs
        results.append((tuple(tokens), tuple(logprobs)))

    async with open_engine(config) as engine:
        async with trio.open_nursery() as nursery:
            for _ in range(8):  # past the router's affinity slack: both replicas serve some
                nursery.start_soon(run, engine)
        steps = [replica.executor.statistics().num_steps for replica in engine.replicas]
    assert all(steps), steps
    assert len(results) == 8 and all(r == results[0] for r in results)
