"""A compressed GGUF model built once and mapped at the next start
(engine/loading/model_snapshot.py): the same logits bit for bit and the
same greedy tokens on every family and layout, nothing built the second
time, the tensors over the kept file's pages; a damaged, stale or foreign
file is never used, and nothing in it runs."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gguf_families import PROMPT, WIDE, _build
from test_moe_loading import _FOR_GGUF as MOE_FOR_GGUF
from test_moe_loading import _WIDE as MOE_WIDE

from trioserve.engine.loading import compressed, model_snapshot
from trioserve.engine.loading.loader import LoadedModel, load_model
from trioserve.testing.gguf_writer import write_gguf
from trioserve.testing.quality import greedy_tokens, prompt_logits

pytestmark = pytest.mark.cpu_paths

# (family, matrices' type, config changes, experts' type): the 4-bit lanes
# (Q4_K, Q4_1), Q6_K and Q8_0 lanes, the fused and the shifted-norm
# layouts, and both mixtures' expert layouts (per-expert Q4_K; MXFP4).
CASES = {
    "llama-Q4_K": ("llama", "Q4_K", WIDE, None),
    "qwen3-Q6_K": ("qwen3", "Q6_K", WIDE, None),
    "gemma3-Q4_1": ("gemma3", "Q4_1", {}, None),
    "phi3-Q8_0": ("phi3", "Q8_0", {}, None),
    "qwen3-moe-Q4_K": ("qwen3-moe", "Q4_K", {**MOE_FOR_GGUF["qwen3-moe"], **MOE_WIDE["qwen3-moe"]}, None),
    "gpt-oss-MXFP4": ("gpt-oss", "Q8_0", {"swiglu_limit": 7.0}, "MXFP4"),
}


def _refuse_to_build(*args, **kwargs):
    raise AssertionError("the model was built again")


def _first_and_kept(path: Path, cache: Path) -> tuple[LoadedModel, Path]:
    first = load_model(str(path), quantization="auto", cache_dir=cache)
    writer = first.snapshot_writer
    assert writer is not None
    assert writer.wait(120)
    stats = writer.statistics()
    assert stats["done"] and stats["error"] is None
    kept = Path(str(stats["path"]))
    assert kept.is_file() and kept.parent.parent == first.path
    return first, kept


def _mapped(kept: Path) -> bool:
    return str(kept) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("case", CASES)
def test_a_second_start_maps_the_first_starts_build_and_answers_alike(tmp_path, monkeypatch, case):
    kind, qtype, changes, expert_qtype = CASES[case]
    folder = tmp_path / kind
    _build(kind, folder, **changes)
    path = write_gguf(folder, tmp_path / f"{case}.gguf", qtype, name=f"tiny-{kind}", expert_qtype=expert_qtype)
    first, kept = _first_and_kept(path, tmp_path / "cache")
    monkeypatch.setattr(compressed, "build_quantized", _refuse_to_build)
    second = load_model(str(path), quantization="auto", cache_dir=tmp_path / "cache")
    assert second.snapshot_writer is None
    assert _mapped(kept)
    assert second.model.projection_choice == first.model.projection_choice
    assert torch.equal(prompt_logits(second.model, PROMPT), prompt_logits(first.model, PROMPT))
    assert greedy_tokens(second.model, PROMPT[:4], 24) == greedy_tokens(first.model, PROMPT[:4], 24)


@pytest.fixture(scope="module")
def default_pair(tmp_path_factory) -> tuple[LoadedModel, LoadedModel]:
    """The default model as its first start builds it and as the next maps it."""
    cache = tmp_path_factory.mktemp("snapshot-cache")
    first, kept = _first_and_kept(_default_path(), cache)
    second = load_model(str(_default_path()), quantization="auto", cache_dir=cache)
    assert second.snapshot_writer is None and _mapped(kept)
    return first, second


def _default_path() -> Path:
    from trioserve.engine.loading.sources import resolve_source

    return resolve_source(None)[0]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=40))
def test_the_default_model_mapped_computes_every_prompt_as_built(default_pair, prompt):
    built, mapped = default_pair
    assert torch.equal(prompt_logits(mapped.model, prompt), prompt_logits(built.model, prompt))


def test_the_default_model_mapped_generates_as_built(default_pair):
    built, mapped = default_pair
    prompt = built.tokenizer.encode("The capital of France is")
    assert greedy_tokens(mapped.model, prompt, 32) == greedy_tokens(built.model, prompt, 32)


def _tiny_gguf(tmp_path: Path) -> Path:
    folder = tmp_path / "llama"
    _build("llama", folder, **WIDE)
    return write_gguf(folder, tmp_path / "tiny.gguf", "Q4_K", name="tiny-llama")


def test_a_damaged_snapshot_is_not_used_and_is_written_again(tmp_path, caplog):
    path = _tiny_gguf(tmp_path)
    first, kept = _first_and_kept(path, tmp_path / "cache")
    size = kept.stat().st_size
    with open(kept, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="trioserve.engine.loading.model_snapshot"):
        again, rewritten = _first_and_kept(path, tmp_path / "cache")
    assert "not using the kept build" in caplog.text and "shorter than its header" in caplog.text
    assert rewritten == kept and kept.stat().st_size == size
    assert torch.equal(prompt_logits(again.model, PROMPT), prompt_logits(first.model, PROMPT))


def test_a_changed_file_is_built_again(tmp_path, monkeypatch):
    path = _tiny_gguf(tmp_path)
    _first_and_kept(path, tmp_path / "cache")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    built = []
    real = compressed.build_quantized
    monkeypatch.setattr(compressed, "build_quantized", lambda *a, **k: built.append(1) or real(*a, **k))
    again = load_model(str(path), quantization="auto", cache_dir=tmp_path / "cache")
    assert built and again.snapshot_writer is not None and again.snapshot_writer.wait(120)


def test_a_new_build_replaces_the_old_one_in_its_entry(tmp_path, monkeypatch):
    """Another key (here, changed engine code) for the same file: one build kept, the newest."""
    path = _tiny_gguf(tmp_path)
    _, old = _first_and_kept(path, tmp_path / "cache")
    monkeypatch.setattr(model_snapshot, "engine_source_hash", lambda: "another version of the code")
    _, new = _first_and_kept(path, tmp_path / "cache")
    assert new != old and new.is_file() and not old.exists()
    assert sorted(new.parent.iterdir()) == [new]


def test_turned_off_nothing_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv(model_snapshot.OFF_ENV, "0")
    loaded = load_model(str(_tiny_gguf(tmp_path)), quantization="auto", cache_dir=tmp_path / "cache")
    assert loaded.snapshot_writer is None
    assert not list((tmp_path / "cache").rglob(f"*{model_snapshot.SUFFIX}"))


class _Runs:
    """What a hostile pickle would run on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_snapshot_naming_a_class_outside_the_project_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    snapshot = model_snapshot.Snapshot("k", pickle.dumps(_Runs(marker)), ())
    snapshot.write(tmp_path / "m.snapshot")
    with pytest.raises(model_snapshot.SnapshotError, match="not allowed"):
        model_snapshot.read(tmp_path / "m.snapshot", "k")
    assert not marker.exists()


def test_a_module_reached_through_an_allowed_one_is_refused(tmp_path):
    """``torch.serialization.os`` names the os module through an allowed package."""
    model_snapshot.Snapshot("k", b"ctorch.serialization\nos\n.", ()).write(tmp_path / "m.snapshot")
    with pytest.raises(model_snapshot.SnapshotError, match="not allowed"):
        model_snapshot.read(tmp_path / "m.snapshot", "k")


def test_a_snapshot_under_another_key_or_not_a_snapshot_is_refused(tmp_path):
    model_snapshot.Snapshot("k", pickle.dumps([1, 2]), ()).write(tmp_path / "m.snapshot")
    assert model_snapshot.read(tmp_path / "m.snapshot", "k") == [1, 2]
    with pytest.raises(model_snapshot.SnapshotError, match="another build"):
        model_snapshot.read(tmp_path / "m.snapshot", "other")
    (tmp_path / "x.snapshot").write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(model_snapshot.SnapshotError, match="not a snapshot"):
        model_snapshot.read(tmp_path / "x.snapshot", "k")
    (tmp_path / "empty.snapshot").write_bytes(b"")
    with pytest.raises(model_snapshot.SnapshotError):
        model_snapshot.read(tmp_path / "empty.snapshot", "k")


def test_tensors_sharing_a_storage_are_kept_once_and_still_share_it(tmp_path):
    table = torch.arange(4096, dtype=torch.float32)
    held = {"table": table, "head": table[1024:], "copy": table.clone()}
    snapshot = model_snapshot.take(held, "k")
    assert len(snapshot.storages) == 2
    snapshot.write(tmp_path / "m.snapshot")
    back = model_snapshot.read(tmp_path / "m.snapshot", "k")
    assert torch.equal(back["table"], table) and torch.equal(back["head"], table[1024:])
    assert back["head"].untyped_storage().data_ptr() == back["table"].untyped_storage().data_ptr()
    assert back["copy"].untyped_storage().data_ptr() != back["table"].untyped_storage().data_ptr()


def test_a_write_removes_what_a_killed_writer_left_but_not_a_live_ones(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".old.snapshot.{dead.pid}.1.tmp"
    live = tmp_path / f".old.snapshot.{os.getpid()}.1.tmp"
    for leftover in (stale, live):
        leftover.write_bytes(b"partial")
    model_snapshot.Snapshot("k", pickle.dumps(1), ()).write(tmp_path / "m.snapshot")
    assert not stale.exists() and live.exists()
    assert model_snapshot.read(tmp_path / "m.snapshot", "k") == 1
