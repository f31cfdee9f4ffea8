"""Run a list of prompts through EngineCore in one continuous batch.

    .venv/bin/python examples/offline_batch.py

Requests join the batch together, finish at different steps, and each one's
text is printed when it ends.
"""

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.engine_core import EngineCore
from trioserve.engine.sampling.sampling_params import SamplingParams

PROMPTS = [
    "Name three planets of the solar system.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into French.",
]


def main() -> None:
    core = EngineCore.from_config(EngineConfig(kv_cache_memory=256 << 20))
    for i, question in enumerate(PROMPTS):
        core.add_request(f"q{i}", [{"role": "user", "content": question}], SamplingParams(temperature=0.0, max_tokens=48))
    texts: dict[str, str] = {}
    while core.has_unfinished():
        for output in core.step():
            texts[output.request_id] = texts.get(output.request_id, "") + output.text_delta
            if output.finished:
                index = int(output.request_id[1:])
                print(f"[{output.finish_reason.value}, {output.num_output_tokens} tokens] {PROMPTS[index]}")
                print(f"  {texts[output.request_id].strip()}\n")


if __name__ == "__main__":
    main()
