"""A GGUF file's config and tokenizer (and, for a float model, its weights
dequantized) kept once in a Hugging Face checkpoint folder.

Every start needs the file's config.json and tokenizer files, which
transformers builds from the GGUF's metadata in seconds: the first start
writes them into ``<cache>/<stem>-<key>/`` and later starts read them. A
model whose weights are read compressed from the file itself (``--quantization
auto`` on a CPU, ``int8``, ``int4``: ``engine/loading/compressed.py`` maps
the file and decodes each tensor as the model is built) needs nothing more
(``ensure_converted(..., weights=False)``). A float model (``--quantization
none``, the transformers fallback, a GPU) needs the weights dequantized
too: ``model.safetensors`` is added to the entry the first time one is
loaded. The key hashes the file's identity (resolved path, size, mtime), so a
replaced file gets a fresh entry. A conversion writes into a temporary folder
renamed into place at the end (the weights file alone moved into an entry
that lacks it): an interrupted one never leaves a half cache.

Most files are read by transformers' GGUF reader (its config and tokenizer;
for the weights, its model, dequantized, then written out); those it cannot
make a model of (``gguf_config.native_kind``: SmolLM3, Mixtral, Qwen3-MoE,
gpt-oss) by trioserve's own reader (``gguf_weights``), with a config built
from the metadata (``gguf_config.native_config``). transformers' config of
the file, which it reads twice (for the config, then inside the
tokenizer's loading), is read from the header walked once
(``gguf_header_reader``), not through gguf-py's parse of the whole
vocabulary: the same files written, 8.1 CPU seconds down to 2.5 for a
Llama 3's.

The conversion runs in a child process: transformers' modeling code, which
it needs, imports torch's compiler stack (dynamo, inductor, triton, sympy),
about 240 MiB that would otherwise stay in a server started on a cold cache
for its whole life (docs/benchmarks.md, "Memory at ready").

An entry without weights for a file whose config ``gguf_config`` builds
and whose tokenizer is a byte-level BPE (``gguf_tokenizer``: Llama 3,
Qwen, SmolLM, gpt-oss) is written in this process instead, without
transformers (``describe_here``): no child importing torch and transformers
again, 5-8 CPU seconds of a first start (docs/performance.md, "Start-up:
where the time goes"). Sentencepiece vocabularies and the families it does
not describe keep the child.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trioserve.engine.loading import gguf_config
from trioserve.engine.loading.gguf_header_reader import config_from_header
from trioserve.engine.models.hf_fallback import resolve_model_config
from trioserve.engine.errors import ModelLoadError

logger = logging.getLogger(__name__)

CACHE_ENV = "TRIOSERVE_CACHE"
_TMP_PREFIX = ".tmp-"
# Architectures whose tokenizer transformers reads only from a copy of its
# keys under another architecture (_tokenizer_gguf).
_TOKENIZER_ONLY = ("smollm3", "gpt-oss")
# Where a converting child leaves its error's message for the parent.
_ERROR_FILE = ".conversion-error"
# The dequantized weights of an entry, present only once a float model was loaded.
WEIGHTS_FILE = "model.safetensors"
# The child's flag for an entry of config and tokenizer only.
_NO_WEIGHTS = "--no-weights"
# GGUF model_type -> the architecture name config.json carries (GGUF metadata
# has no ``architectures`` field).
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}  # fmt: skip


class Progress:
    """Progress of one long step: a tqdm bar on a terminal, log lines otherwise.

    ``advance(n, note)`` moves it on; ``close()`` logs the total time. Safe to
    call from several threads (tqdm locks; ``logging`` is thread-safe).
    """

    def __init__(self, desc: str, total: int, *, unit: str = "step", log: logging.Logger = logger) -> None:
        self.desc = desc
        self._log = log
        self.total = total
        self._start = time.perf_counter()
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", leave=False)
        elif unit == "B":
            log.info("%s: %.1f MB", desc, total / 1e6)
        else:
            log.info("%s: %d %ss", desc, total, unit)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note)
            self._bar.update(n)
        elif note:
            self._log.info("%s: %s", self.desc, note)

    def close(self) -> float:
        """Finish; return the seconds elapsed."""
        elapsed = time.perf_counter() - self._start
        if self._bar is not None:
            self._bar.close()
        self._log.info("%s: done in %.1f s", self.desc, elapsed)
        return elapsed


def cache_root(cache_dir: Path | None = None) -> Path:
    """The cache folder: ``cache_dir``, else ``$TRIOSERVE_CACHE``, else
    ``~/.cache/trioserve``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "trioserve"


def cache_key(gguf_path: Path) -> str:
    """A short hash of the file's identity: resolved path, size and mtime.

    Hashing the content would cost a full read of a possibly multi-GB file on
    every start; the identity changes whenever the file is replaced.
    """
    resolved = Path(gguf_path).resolve()
    st = resolved.stat()
    ident = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cached_checkpoint_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted checkpoint of ``gguf_path`` lives (it may not exist yet)."""
    resolved = Path(gguf_path).resolve()  # a link to a converted file finds its entry
    return cache_root(cache_dir) / f"{resolved.stem}-{cache_key(resolved)}"


def ensure_converted(gguf_path: Path, cache_dir: Path | None = None, *, weights: bool = True) -> Path:
    """Return the cached checkpoint folder of ``gguf_path``, converting first
    if there is none; with ``weights``, one holding the weights dequantized
    (``WEIGHTS_FILE``), else one holding at least the config and tokenizer
    (all a model whose weights are read compressed from the file needs).
    Raises ``ModelLoadError`` naming the file on failure."""
    gguf_path = Path(gguf_path)
    try:
        target = cached_checkpoint_dir(gguf_path, cache_dir)
    except OSError as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read file: {exc.strerror or exc}") from None
    if target.is_dir() and (not weights or (target / WEIGHTS_FILE).is_file()):
        logger.debug("using cached conversion %s", target)
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(f"{target.parent}: cannot create the cache folder: {exc.strerror or exc}") from None
    _remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", suffix=f"-{target.name}", dir=target.parent))
    try:
        if weights:
            convert_gguf(gguf_path, tmp)
        else:
            describe_gguf(gguf_path, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the files inside follow the umask
        _install(tmp, target)
    except OSError as exc:
        raise ModelLoadError(f"{target}: cannot write the converted checkpoint: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished conversion ``tmp`` into place as ``target``; where
    an entry is there already (another process's, or one without weights),
    move only the weights into it, if it lacks them, with the config
    transformers' model of the file gives (the same model; the config read
    alone lacks the ``dtype`` and ``quantization_config`` its loading adds)."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
        if (tmp / WEIGHTS_FILE).is_file() and not (target / WEIGHTS_FILE).is_file():
            os.replace(tmp / "config.json", target / "config.json")
            os.rename(tmp / WEIGHTS_FILE, target / WEIGHTS_FILE)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into ``out_dir`` (an existing, empty folder)
    as ``config.json``, ``model.safetensors`` and tokenizer files, in a
    child process (its progress on this process's stderr). Raises
    ``ModelLoadError`` with the child's message when it fails."""
    _run_child(gguf_path, out_dir, [])


def describe_gguf(gguf_path: Path, out_dir: Path) -> None:
    """``convert_gguf`` without the weights: ``config.json`` and the
    tokenizer files only. In this process where trioserve reads the file's
    config and tokenizer itself (``describe_here``), else in the child."""
    if not describe_here(gguf_path, out_dir):
        _run_child(gguf_path, out_dir, [_NO_WEIGHTS])


def describe_here(gguf_path: Path, out_dir: Path) -> bool:
    """Write ``describe_gguf``'s files without transformers, from the
    file's metadata (``gguf_config.native_config``,
    ``gguf_tokenizer.tokenizer_files``), and return True; return False,
    writing nothing, for a file whose architecture or tokenizer model
    neither builds. Raises ``ModelLoadError`` naming the file."""
    from trioserve.engine.loading import gguf_tokenizer
    from trioserve.engine.loading.gguf_file import GGUFFile

    file = GGUFFile(
        gguf_path, want_strings=lambda key: gguf_config.metadata_strings(key) or gguf_tokenizer.wants_strings(key)
    )
    metadata, tables = gguf_config.read_metadata(gguf_path, file)
    if not (gguf_config.describable(metadata) and gguf_tokenizer.reads(file.fields)):
        return False
    progress = Progress(f"reading the config and tokenizer of {gguf_path.name}", total=2)
    try:
        embedding = next(t for t in file.tensors if t.name == "token_embd.weight")
        hf_config = gguf_config.native_config(metadata, tables, vocab_size=int(embedding.dims[-1]))
        resolve_model_config(hf_config, source=str(gguf_path))  # as the child does: a refusal names the file
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        progress.advance(note="config written")
        tokenizer_json, tokenizer_config = gguf_tokenizer.tokenizer_files(file.fields)
        (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        (out_dir / "tokenizer_config.json").write_text(gguf_tokenizer.config_json(tokenizer_config), encoding="utf-8")
        progress.advance(note="tokenizer written")
    except StopIteration:
        raise ModelLoadError(f"{gguf_path}: incomplete GGUF model: no tensor 'token_embd.weight'") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None
    finally:
        progress.close()
    return True


def _run_child(gguf_path: Path, out_dir: Path, flags: list[str]) -> None:
    code = "import sys; from trioserve.engine.loading.gguf_cache import _child_main; sys.exit(_child_main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(out_dir), *flags], stdin=subprocess.DEVNULL)
    if done.returncode == 0:
        return
    error = out_dir / _ERROR_FILE
    message = error.read_text() if error.is_file() else f"{gguf_path}: converting ended with exit status {done.returncode}"
    raise ModelLoadError(message)


def _child_main(argv: list[str]) -> int:
    """The converting child: ``convert_here(argv[0], argv[1])`` (without
    the weights where ``argv[2]`` is ``_NO_WEIGHTS``); a failure's message
    goes to ``_ERROR_FILE`` in the output folder (exit status 1)."""
    gguf_path, out_dir = Path(argv[0]), Path(argv[1])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        convert_here(gguf_path, out_dir, weights=_NO_WEIGHTS not in argv[2:])
    except ModelLoadError as exc:
        (out_dir / _ERROR_FILE).write_text(str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - anything else still reaches the parent, named
        (out_dir / _ERROR_FILE).write_text(f"{gguf_path}: converting failed: {type(exc).__name__}: {exc}")
        raise
    return 0


def convert_here(gguf_path: Path, out_dir: Path, *, weights: bool = True) -> None:
    """``convert_gguf`` (``describe_gguf`` without ``weights``) in this
    process (what the child runs)."""
    metadata, tables = gguf_config.read_metadata(gguf_path)
    what = "converting" if weights else "reading the config and tokenizer of"
    progress = Progress(f"{what} {gguf_path.name}", total=4 if weights else 2)
    try:
        if gguf_config.native_kind(metadata) is not None:
            _convert_natively(gguf_path, out_dir, metadata, tables, progress, weights=weights)
        else:
            _convert_by_transformers(gguf_path, out_dir, metadata, tables, progress, weights=weights)
    finally:
        progress.close()


def _convert_by_transformers(
    gguf_path: Path,
    out_dir: Path,
    metadata: dict[str, Any],
    tables: dict[str, list[float]],
    progress: Progress,
    *,
    weights: bool,
) -> None:
    """``convert_here`` through transformers' model of the file (its config
    alone without ``weights``)."""
    model = None
    if weights:
        model = _read_gguf_model(gguf_path, metadata, tables)
        progress.advance(note="weights dequantized")
        config = model.config
    else:
        config = _guarded(gguf_path, lambda: _read_gguf_config(gguf_path, metadata, tables))
    hf_config = json.loads(config.to_json_string(use_diff=False))
    model_type = hf_config.get("model_type")
    if not hf_config.get("architectures") and model_type in _ARCH_BY_MODEL_TYPE:
        hf_config["architectures"] = [_ARCH_BY_MODEL_TYPE[model_type]]
    # Refuse an architecture that runs neither natively nor on the
    # transformers fallback before writing gigabytes.
    resolve_model_config(hf_config, source=str(gguf_path))
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    progress.advance(note="config written")
    if model is not None:
        _write_weights(model, out_dir / WEIGHTS_FILE, tied=bool(hf_config.get("tie_word_embeddings")))
        del model
        progress.advance(note="weights written")
    _write_tokenizer(gguf_path, out_dir)
    progress.advance(note="tokenizer written")


def _convert_natively(
    gguf_path: Path,
    out_dir: Path,
    metadata: dict[str, Any],
    tables: dict[str, list[float]],
    progress: Progress,
    *,
    weights: bool,
) -> None:
    """``convert_here`` for a ``gguf_config.native_kind`` file: its tensors
    through ``gguf_weights`` (dequantized, one at a time, under the Hub's
    names; skipped without ``weights``), its config from its metadata."""
    import torch
    from safetensors.torch import save_file
    from transformers import CONFIG_MAPPING

    from trioserve.engine.loading import gguf_weights
    from trioserve.engine.loading.gguf_file import GGUFFile
    from trioserve.engine.models import moe_weights
    from trioserve.engine.models.llama import LlamaForCausalLM

    try:
        embedding = next(t for t in GGUFFile(gguf_path).tensors if t.name == "token_embd.weight")
        hf = gguf_config.native_config(metadata, tables, vocab_size=int(embedding.dims[-1]))
        hf_config = json.loads(CONFIG_MAPPING[hf["model_type"]].from_dict(hf).to_json_string(use_diff=False))
    except StopIteration:
        raise ModelLoadError(f"{gguf_path}: incomplete GGUF model: no tensor 'token_embd.weight'") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None
    config = resolve_model_config(hf_config, source=str(gguf_path))
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
    progress.advance(note="config written")
    if weights:
        tensors = {
            name: (value if isinstance(value, torch.Tensor) else value.dequantize()).contiguous()
            for name, value in gguf_weights.read_tensors(
                gguf_path, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads
            )
        }
        if config.moe_routing == "gpt_oss":
            for i in config.moe_layers:
                try:
                    moe_weights.fuse_gpt_oss_experts(tensors, f"model.layers.{i}.", config.num_experts)
                except KeyError as exc:
                    raise ModelLoadError(f"{gguf_path}: incomplete GGUF model: no tensor for {exc}") from None
        # Refused here, naming the file, rather than by the loader, naming its cache.
        required = LlamaForCausalLM(config, dtype=torch.float32, device="meta").required_weight_names()
        missing = sorted(required - set(tensors))
        if missing:
            raise ModelLoadError(f"{gguf_path}: incomplete GGUF model: no tensor for {missing[:8]}")
        progress.advance(note="weights dequantized")
        save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        del tensors
        progress.advance(note="weights written")
    _write_tokenizer(gguf_path, out_dir)
    progress.advance(note="tokenizer written")


def _read_gguf_config(gguf_path: Path, metadata: dict[str, Any], tables: dict[str, list[float]]) -> Any:
    """The config transformers reads from the file, completed with what it
    drops (``gguf_config``): a Qwen3's head width decides its shapes."""
    from transformers import AutoConfig

    with config_from_header(gguf_path):
        read = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return type(read).from_dict(gguf_config.complete(read.to_dict(), metadata, tables))


def _guarded(gguf_path: Path, read: Any) -> Any:
    """``read()``, with transformers' and gguf's errors (anything from
    ValueError to KeyError) as a ``ModelLoadError`` naming the file."""
    try:
        return read()
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None


def _read_gguf_model(gguf_path: Path, metadata: dict[str, Any], tables: dict[str, list[float]]) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf
    from transformers.utils import logging as hf_logging

    # transformers draws tqdm bars (its own, and a plain one while
    # dequantizing); off a terminal they would fill a log with \r lines.
    quiet = not sys.stderr.isatty()
    bars_were_on = hf_logging.is_progress_bar_enabled()
    plain_tqdm = getattr(hf_gguf, "tqdm", None)
    if quiet:
        hf_logging.disable_progress_bar()
        if plain_tqdm is not None:
            hf_gguf.tqdm = functools.partial(plain_tqdm, disable=True)
    try:
        config = _read_gguf_config(gguf_path, metadata, tables)  # before the model is built
        model, info = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, config=config, output_loading_info=True,
            ignore_mismatched_sizes=True,  # refused below, naming the tensor
        )
    except Exception as exc:  # transformers and gguf raise anything from ValueError to KeyError
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF model: {type(exc).__name__}: {exc}") from None
    else:
        # transformers fills a weight the file lacks, or holds in another
        # shape, with random values; refuse instead.
        for name, *shapes in info.get("mismatched_keys") or ():
            raise ModelLoadError(
                f"{gguf_path}: weight {name!r}: the file's shape {tuple(shapes[0])} is not the config's {tuple(shapes[-1])}"
            )
        missing = sorted(set(info.get("missing_keys") or ()) - {"lm_head.weight"})
        if missing:
            raise ModelLoadError(f"{gguf_path}: incomplete GGUF model: no tensor for {missing[:8]}")
        return model
    finally:
        if quiet:
            if bars_were_on:
                hf_logging.enable_progress_bar()
            if plain_tqdm is not None:
                hf_gguf.tqdm = plain_tqdm


def _write_weights(model: Any, path: Path, *, tied: bool) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        # A tied lm_head shares the embedding's storage; safetensors refuses
        # shared tensors, and the loader ties it again from the config.
        if tied and name == "lm_head.weight":
            continue
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        with tempfile.TemporaryDirectory(dir=out_dir) as scratch:
            source = _tokenizer_gguf(gguf_path, Path(scratch))
            with config_from_header(source):  # its config, read again
                tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read the tokenizer: {type(exc).__name__}: {exc}") from None
    tokenizer.save_pretrained(str(out_dir))
    # transformers 5 writes the chat template to chat_template.jinja; keep it
    # in tokenizer_config.json too, where older tools look for it.
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    if tokenizer.chat_template and "chat_template" not in tok_config:
        tok_config["chat_template"] = tokenizer.chat_template
        config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def _tokenizer_gguf(gguf_path: Path, scratch: Path) -> Path:
    """``gguf_path``, or for an architecture of ``_TOKENIZER_ONLY`` a copy of
    its tokenizer keys alone in ``scratch`` under architecture "llama":
    transformers refuses such a file by its architecture before it looks at
    the tokenizer, which is llama.cpp's one format for all (the architecture
    picks a builder only for Gemma's and Phi-3's sentencepiece)."""
    import gguf

    from trioserve.engine.loading.gguf_file import GGUFFile

    if GGUFFile(gguf_path).architecture not in _TOKENIZER_ONLY:
        return gguf_path  # without parsing the vocabulary here: transformers does
    reader = gguf.GGUFReader(str(gguf_path))
    path = scratch / "tokenizer.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def _remove_stale_temps(target: Path) -> None:
    """Delete temporary folders left by killed conversions of ``target``."""
    for tmp in target.parent.glob(f"{_TMP_PREFIX}*-{target.name}"):
        pid_text = tmp.name[len(_TMP_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            shutil.rmtree(tmp, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
