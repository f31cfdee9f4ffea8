"""What the native kernels' build needs (engine/kernels/native.py): a C++
compiler and ninja, each said by name where missing, before any build
starts. Needs no build of the library."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from trioserve.engine.kernels import native


def _tool(folder: Path, name: str) -> None:
    tool = folder / name
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)


@pytest.fixture
def bare(tmp_path, monkeypatch):
    """A PATH of one empty folder, and an interpreter with no ninja beside it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    return folder


def test_a_machine_with_both_tools_lacks_nothing(bare):
    _tool(bare, "c++")
    _tool(bare, "ninja")
    assert native.missing_tools({"PATH": str(bare)}) == []
    assert native.ninja_dir({"PATH": str(bare)}) == bare


def test_each_missing_tool_is_named_with_how_to_get_it(bare):
    missing = native.missing_tools({"PATH": str(bare)})
    assert len(missing) == 2
    assert missing[0].startswith("a C++ compiler ('c++' is not on PATH")
    assert missing[1].startswith("ninja (") and "pip install ninja" in missing[1]
    _tool(bare, "clang++")
    assert native.missing_tools({"PATH": str(bare), "CXX": "clang++"}) == [missing[1]]
    assert "'g++-13' is not on PATH" in native.missing_tools({"PATH": str(bare), "CXX": "g++-13"})[0]


def test_ninja_beside_the_interpreter_serves_a_venv_not_on_path(bare, tmp_path):
    """``.venv/bin/python -m trioserve.engine.kernels.native``, as
    scripts/setup.sh runs it, finds the ``ninja`` package's binary in .venv/bin."""
    _tool(bare, "c++")
    _tool(tmp_path, "ninja")  # beside sys.executable (the fixture's tmp_path / "python")
    assert native.ninja_dir({"PATH": str(bare)}) == tmp_path
    assert native.missing_tools({"PATH": str(bare)}) == []


def test_the_build_says_what_is_missing_before_compiling(bare, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(bare))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv(native.CACHE_ENV, str(bare.parent / "cache"))
    with pytest.raises(native.BuildToolMissing, match=r"needs a C\+\+ compiler .* and ninja \("):
        native.build()
    assert not (bare.parent / "cache").exists()
    assert native.main([]) == 1
    assert "BuildToolMissing: the native kernels' build needs a C++ compiler" in capsys.readouterr().err
