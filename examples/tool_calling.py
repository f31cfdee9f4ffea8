"""Tool calling against a running ``trioserve serve`` (the default model
works): the model calls a tool (``tool_choice="required"`` makes it call
one, constrained so the call always parses), the program runs it, and the
result goes back as a ``tool`` message for the answer. The first request
streams, and the openai client assembles the streamed call.

    .venv/bin/trioserve serve &
    .venv/bin/python examples/tool_calling.py

Set ``TRIOSERVE_URL`` (default http://127.0.0.1:8000) and, if the server
was started with ``--api-key``, ``TRIOSERVE_API_KEY``.
"""

import json
import os

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    }
]


def get_weather(city: str, unit: str) -> str:
    return f"18 degrees {unit} and sunny in {city}"


def main() -> None:
    client = OpenAI(
        base_url=os.environ.get("TRIOSERVE_URL", "http://127.0.0.1:8000") + "/v1",
        api_key=os.environ.get("TRIOSERVE_API_KEY", "unused"),
    )
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    with client.chat.completions.stream(
        model=model, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    ) as stream:
        completion = stream.get_final_completion()
    message = completion.choices[0].message
    print("finish_reason:", completion.choices[0].finish_reason)
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in message.tool_calls]})
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        print(f"call {call.id}: {call.function.name}({arguments})")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": get_weather(**arguments)})

    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=60, temperature=0)
    print("answer:", answer.choices[0].message.content)


if __name__ == "__main__":
    main()
