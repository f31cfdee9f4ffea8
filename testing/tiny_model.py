"""A tiny random-weight Llama with the default model's real tokenizer, and
engine configs sized for it: steps of a few milliseconds, real token ids.

The tokenizer is read from the default model's GGUF file once per process
(a few seconds) and the model is built once per device; both are cached
with ``functools.cache``, so every caller in a process shares them.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from trioserve.engine.config import EngineConfig, ModelConfig, RopeScaling
from trioserve.engine.text.fast_tokenizer import FastTokenizer
from trioserve.engine.layers.kv_cache import kv_bytes_per_block
from trioserve.engine.kernels.kv_dtype import DTYPES as KV_DTYPES
from trioserve.engine.loading.loader import LoadedModel
from trioserve.engine.loading.sources import default_model_path
from trioserve.engine.models.llama import LlamaForCausalLM

VOCAB_SIZE = 49152  # the default model's, so its tokenizer fits
BLOCK_SIZE = 16


@functools.cache
def tokenizer() -> FastTokenizer:
    """The default model's tokenizer (SmolLM2-135M), read from its GGUF file
    by transformers (as the GGUF conversion does) and loaded as a serving
    engine loads it: a ``FastTokenizer``."""
    return FastTokenizer.from_folder(hf_tokenizer_folder())


@functools.cache
def hf_tokenizer_folder() -> Path:
    """A folder holding the default model's tokenizer files, written by
    transformers from its GGUF file once per process (a few seconds) and
    removed at exit."""
    from transformers import AutoTokenizer

    path = default_model_path()
    folder = Path(tempfile.mkdtemp(prefix="trioserve-tokenizer-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))
    return folder


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """Save into ``folder`` a word-level tokenizer of ``vocab_size`` tokens,
    one word per id (``<unk>``, ``<s>``, ``</s>``, then ``w3``, ``w4``, ...), so
    every id decodes: for machines without the default model's file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(folder))


def tiny_model_config() -> ModelConfig:
    """2 layers, 64 wide, 4 query and 2 KV heads, the default model's vocabulary."""
    tok = tokenizer()
    return _tiny_config(tok.bos_token_id, (tok.eos_token_id,))


def _tiny_config(bos_token_id: int | None, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(),
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
    )


def tiny_loaded(device: str | torch.device = "cpu") -> LoadedModel:
    """The tiny model, float32 on ``device``, with seeded random weights
    whose logits are peaked enough that greedy choices do not hinge on float
    rounding. The weights are drawn on CPU, so they are the same on every
    device. Built once per device and shared."""
    return _tiny_loaded(torch.device(device))


def _tiny_weights(config: ModelConfig, device: torch.device) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm weights
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.eval()
    return model


def tiny_loaded_with(tokenizer: Any, device: str | torch.device = "cpu", *, path: Path | None = None) -> LoadedModel:
    """The tiny model's weights (``tiny_loaded``'s) on ``device`` with
    another ``tokenizer``, one of at most ``VOCAB_SIZE`` tokens: for a
    machine without the default model's file, such as a lent GPU machine.
    ``path`` is what ``LoadedModel.path`` says (default: the temp folder)."""
    config = _tiny_config(tokenizer.bos_token_id, (tokenizer.eos_token_id,))
    device = torch.device(device)
    return LoadedModel(
        model=_tiny_weights(config, device),
        model_config=config,
        tokenizer=tokenizer,
        name="tiny-random-llama",
        path=Path(tempfile.gettempdir()) if path is None else path,
        dtype=torch.float32,
        device=device,
    )


def tiny_worker_model() -> LoadedModel:
    """The tiny model's weights on CPU, without the tokenizer (a worker
    process runs steps only; the server has the tokenizer): what
    ``worker_model`` is for ``worker_mode="process"`` tests. Picklable by
    reference; the weights equal ``tiny_loaded()``'s."""
    config = _tiny_config(None, ())
    return LoadedModel(
        model=_tiny_weights(config, torch.device("cpu")),
        model_config=config,
        tokenizer=None,
        name="tiny-random-llama",
        path=default_model_path().parent,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


@functools.cache
def _tiny_loaded(device: torch.device) -> LoadedModel:
    return tiny_loaded_with(tokenizer(), device, path=default_model_path().parent)


def engine_config(*, num_blocks: int | None = None, **overrides: Any) -> EngineConfig:
    """A small engine config for the tiny model; ``num_blocks`` sizes the KV
    pool exactly (in the cache dtype of ``kv_cache_dtype``, float32 by
    default; not "auto", which depends on the machine), ``overrides`` set
    any other field."""
    fields: dict[str, Any] = dict(
        block_size=BLOCK_SIZE,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_queued_requests=64,
        # Tests build many engines; kernels are built as they are met.
        warm_up=False,
        # The tiny random model has near-ties between its top logits: a
        # 16-bit cache rounds keys and values computed with batch-dependent
        # float noise, and that can flip them, so tests comparing batchings
        # keep float32 ("auto" is asked for where it is under test).
        kv_cache_dtype="float32",
    )
    if num_blocks is not None:
        name = overrides.get("kv_cache_dtype", fields["kv_cache_dtype"])
        if name not in KV_DTYPES:
            raise ValueError(f"num_blocks sizes a pool of a given dtype, not kv_cache_dtype={name!r}")
        fields["kv_cache_dtype"] = name
        fields["kv_cache_memory"] = num_blocks * kv_bytes_per_block(tiny_model_config(), BLOCK_SIZE, KV_DTYPES[name])
    fields.update(overrides)
    return EngineConfig(**fields)
