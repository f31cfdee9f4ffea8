"""lm-evaluation-harness against the server: its ``local-completions``
model scores a small local multiple-choice task (tests/data/lm_eval, no
dataset hub) through ``echo`` with ``logprobs`` and batched token-id
prompts, and must get the accuracy, and the same per-choice
loglikelihoods, as the harness's own ``hf`` model on transformers' model of
the same GGUF file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trioserve.web.app import create_app

from server_fixtures import MODEL, server_config, server_in_thread

pytestmark = pytest.mark.slow

TASK = Path(__file__).parent / "data" / "lm_eval" / "tiny_mc.yaml"


def task_config() -> dict:
    """The task's YAML with its data file made absolute (lm-eval reads it
    relative to the working directory)."""
    config = yaml.safe_load(TASK.read_text())
    files = config["dataset_kwargs"]["data_files"]
    files["test"] = str(TASK.parent / files["test"])
    return config


def evaluate(model: str, model_args: dict) -> tuple[float, list[list[float]]]:
    """The task's accuracy and each item's per-choice loglikelihoods."""
    import lm_eval
    from lm_eval.api.task import ConfigurableTask

    task = ConfigurableTask(config=task_config())
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True)
    name = task.config.task
    accuracy = results["results"][name]["acc,none"]
    samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
    return accuracy, [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_local_completions_equals_hf(default_loaded, tmp_path, monkeypatch):
    import transformers

    from trioserve.engine.loading.sources import default_model_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    gguf = default_model_path()
    # lm-eval's API models load a tokenizer folder: the GGUF's own, saved out.
    tokenizer_dir = tmp_path / "tokenizer"
    transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tokenizer_dir)

    with server_in_thread(create_app(server_config(), loaded=default_loaded)) as server:
        served_accuracy, served = evaluate(
            "local-completions",
            {
                "base_url": server.url + "/v1/completions",
                "model": MODEL,
                "tokenizer": str(tokenizer_dir),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                # Batches of prompts in one request (OpenAI's batch form).
                "batch_size": 4,
                "max_retries": 1,
            },
        )
    hf_accuracy, expected = evaluate(
        "hf",
        {
            "pretrained": str(gguf.parent),
            "gguf_file": gguf.name,
            "tokenizer": str(tokenizer_dir),
            "dtype": "float32",
            "device": "cpu",
            "batch_size": 4,
        },
    )
    assert len(served) == len(expected) == 8
    for ours, theirs in zip(served, expected):
        assert ours == pytest.approx(theirs, abs=2e-2)
    assert served_accuracy == hf_accuracy
    # The task is easy enough that the model gets some right: scoring works.
    assert hf_accuracy > 0.25
