"""The command line, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_prints_a_greedy_continuation_of_the_chat_prompt():
    # Not France: on int8 activations (the batch-invariant default) the
    # default model's answer there is a near-tie that goes to "L'Étoile"
    # (docs/architecture.md, "Same request, same answer").
    result = run_cli("generate", "--chat", "--max-tokens", "12", "What is the capital of Germany?")
    assert result.returncode == 0, result.stderr
    assert "Berlin" in result.stdout


def test_a_missing_model_path_is_one_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    result = run_cli("generate", "--model", str(missing), "hello")
    assert result.returncode == 2
    assert str(missing) in result.stderr
    assert "Traceback" not in result.stderr


def test_a_malformed_model_spec_is_one_clear_error():
    result = run_cli("serve", "--model", "=x", "--port", "0")
    assert result.returncode == 2
    assert "NAME=PATH" in result.stderr and "'=x'" in result.stderr
    assert "Traceback" not in result.stderr
