"""Talk to a running ``trioserve serve`` with the official openai client.

    .venv/bin/trioserve serve &                     # or: make serve
    .venv/bin/python examples/openai_client.py "Why is the sky blue?"

Set ``TRIOSERVE_URL`` (default http://127.0.0.1:8000) and, if the server
was started with ``--api-key``, ``TRIOSERVE_API_KEY``.
"""

import os
import sys

from openai import OpenAI


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"
    client = OpenAI(
        base_url=os.environ.get("TRIOSERVE_URL", "http://127.0.0.1:8000") + "/v1",
        api_key=os.environ.get("TRIOSERVE_API_KEY", "unused"),
    )
    model = client.models.list().data[0].id

    # Streamed chat: print each piece as it arrives. vLLM's extras and the
    # request deadline go in extra_body.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_completion_tokens=128,
        temperature=0.7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 40, "timeout": 60},
    )
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
            if chunk.choices[0].finish_reason:
                print(f"\n[finish_reason: {chunk.choices[0].finish_reason}]")
        elif chunk.usage is not None:
            print(f"[usage: {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

    # A plain completion: two seeded samples, with the top-2 logprobs of each token.
    completion = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, n=2, seed=1, logprobs=2, stop=["\n"]
    )
    for choice in completion.choices:
        print(f"[{choice.index}] {choice.text!r} ({choice.finish_reason})")
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
            print(f"    {token!r}: {top}")


if __name__ == "__main__":
    main()
