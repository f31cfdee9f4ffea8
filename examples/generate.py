"""Greedy generation from Python with the default model (no server, no trio).

    .venv/bin/python examples/generate.py "Why is the sky blue?"
"""

import sys

from trioserve.engine.config import EngineConfig
from trioserve.engine.core.generate import generate_greedy


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "Why is the sky blue?"
    messages = [{"role": "user", "content": question}]
    for piece in generate_greedy(EngineConfig(), messages, max_tokens=64):
        print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
