"""Structured output against a running ``trioserve serve`` (the default model
works): a Pydantic model through the openai client's ``parse``, a JSON schema
through ``response_format``, and vLLM's ``structured_outputs`` (choice,
regex) through ``extra_body``.

    .venv/bin/trioserve serve &
    .venv/bin/python examples/structured_output.py

Set ``TRIOSERVE_URL`` (default http://127.0.0.1:8000) and, if the server
was started with ``--api-key``, ``TRIOSERVE_API_KEY``.
"""

import json
import os

from openai import OpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=100_000_000)  # bounded: a small model may run on with digits


def main() -> None:
    client = OpenAI(
        base_url=os.environ.get("TRIOSERVE_URL", "http://127.0.0.1:8000") + "/v1",
        api_key=os.environ.get("TRIOSERVE_API_KEY", "unused"),
    )
    model = client.models.list().data[0].id
    ask = [{"role": "user", "content": "Describe Paris."}]

    # 1. A Pydantic model: the client sends its JSON schema and parses the answer.
    completion = client.chat.completions.parse(model=model, messages=ask, response_format=City, max_tokens=120, temperature=0)
    print("parse():", repr(completion.choices[0].message.parsed))

    # 2. A JSON schema of your own (strings bounded, so a small model ends them).
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "sights": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3}},
        "required": ["city", "sights"],
    }
    completion = client.chat.completions.create(
        model=model,
        messages=ask,
        response_format={"type": "json_schema", "json_schema": {"name": "sights", "schema": schema, "strict": True}},
        max_tokens=100,
        temperature=0,
    )
    print("json_schema:", json.loads(completion.choices[0].message.content))

    # 3. vLLM's structured_outputs: one of a few strings, or a regex.
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        max_tokens=4,
    )
    print("choice:", completion.choices[0].message.content)
    completion = client.completions.create(
        model=model, prompt="A phone number:", extra_body={"structured_outputs": {"regex": r"\d{3}-\d{3}-\d{4}"}}, max_tokens=16
    )
    print("regex:", completion.choices[0].text)


if __name__ == "__main__":
    main()
