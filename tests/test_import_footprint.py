"""What a serving process imports: converting a GGUF on a cold cache runs in
a child process (engine/loading/gguf_cache.py), so transformers' modeling code and
the torch compiler stack it pulls in (dynamo, inductor, triton, sympy:
about 240 MiB) never load into the process that then serves; nor does
transformers at all, since the tokenizer is a ``FastTokenizer``
(engine/text/fast_tokenizer.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Loaded by transformers' modeling code (the conversion), never by serving.
CONVERSION_ONLY = ("transformers.models.llama.modeling_llama", "torch._dynamo", "torch._inductor", "sympy")

COLD_START = textwrap.dedent(
    """
    import json, sys
    from trioserve.engine.loading.loader import load_model

    loaded = load_model(None, quantization="auto", cache_dir=sys.argv[1])
    print(json.dumps({
        "path": str(loaded.path),
        "imported": [m for m in sys.argv[2:] if m in sys.modules],
        "tokenizer": "transformers" in sys.modules,
    }))
    """
)


@pytest.mark.slow
def test_a_cold_start_converts_in_a_child_and_imports_no_modeling_code(tmp_path):
    cache = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-c", COLD_START, str(cache), *CONVERSION_ONLY],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.splitlines()[-1])
    (entry,) = cache.iterdir()
    assert result["path"] == str(entry)
    names = {p.name for p in entry.iterdir()}
    assert {"config.json", "tokenizer.json"} <= names
    assert "model.safetensors" not in names  # compressed weights load from the GGUF: no float copy cached
    assert result["imported"] == []
    assert not result["tokenizer"]  # the tokenizer is a FastTokenizer: transformers only in the child
