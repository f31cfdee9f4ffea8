"""What ``pip install .`` installs: every subpackage and every file beside them.

pyproject.toml maps each top folder (``engine/``, ``web/``, ...) to a
subpackage of ``trioserve`` and lists the packages by hand, so a new folder
is easy to forget: an editable install still finds it, a real install does
not. These tests build the wheel from a copy of the project's files (a clean
copy: setuptools' ``build/`` folder would otherwise carry stale files into the
wheel and hide a missing package) and check it holds each of them.
scripts/check_wheel.sh, under CI, goes on to install it and run it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trioserve.engine.kernels import native

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
# "trioserve.engine" -> "engine": the folder each mapped package comes from.
PACKAGE_DIRS = SETUPTOOLS["package-dir"]


def project_files() -> list[str]:
    """The project's files, as git sees them: tracked, or new and not ignored
    (build outputs, caches and the virtual environment are ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return sorted({name for name in out.stdout.split("\0") if name and (ROOT / name).is_file()})


def installed_name(path: str) -> str | None:
    """Where a project file lands in the wheel, or None if outside every mapped folder."""
    for package, folder in PACKAGE_DIRS.items():
        if path.startswith(folder + "/"):
            return package.replace(".", "/") + path[len(folder) :]
    return None


def test_every_folder_with_an_init_is_listed_in_pyproject():
    # Fails before any build, naming the line to add.
    found = set()
    for package, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                rel = init.parent.relative_to(ROOT / folder)
                found.add(".".join((package, *rel.parts)))
    missing = sorted(found - set(SETUPTOOLS["packages"]))
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for name in project_files():
        if name in ("pyproject.toml", "README.md") or installed_name(name) is not None:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    # This environment's setuptools, no index: seconds, offline. The CI
    # script builds with pip's isolation from pyproject's build-system.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--no-index", "-w", str(tmp / "dist"), str(src)],
        check=True,
    )  # fmt: skip
    (built,) = (tmp / "dist").glob("trioserve-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def test_the_wheel_holds_every_file_of_every_mapped_folder(wheel):
    names = set(wheel.namelist())
    expected = {installed_name(name) for name in project_files()} - {None}
    missing = sorted(expected - names)
    assert not missing, f"left out of the wheel (packages or package-data in pyproject.toml): {missing}"


def test_the_wheel_holds_what_serving_needs(wheel):
    names = set(wheel.namelist())
    needed = {
        "trioserve/web/cli.py",
        "trioserve/engine/kernels/native.py",
        "trioserve/engine/kernels/csrc/linear.cpp",
        "trioserve/engine/kernels/csrc/decode.cpp",
        "trioserve/engine/kernels/csrc/kernels.h",
        "trioserve/web/static/chat.html",
        "trioserve/rpc/trioserve_pb2.py",
        "trioserve/rpc/trioserve_pb2_grpc.py",
        "trioserve/proto/trioserve.proto",
    }
    assert needed <= names, sorted(needed - names)
    assert {f"trioserve/engine/kernels/csrc/{name}" for name in native.SOURCES + native.HEADERS} <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "trioserve = trioserve.web.cli:main" in wheel.read(entry_points).decode()


def test_the_wheel_holds_no_build_outputs(wheel):
    stray = [n for n in wheel.namelist() if "__pycache__" in n or "/build/" in n or n.endswith((".so", ".o", ".pyc"))]
    assert not stray


def test_native_builds_go_to_a_per_user_cache(tmp_path, monkeypatch):
    # Never into the package: an installed tree may be read-only and shared.
    assert native.cache_root({}) == Path.home() / ".cache" / "trioserve" / "native"
    assert native.cache_root({native.CACHE_ENV: str(tmp_path)}) == tmp_path
    # $TRIOSERVE_CACHE (converted models) does not move the kernels.
    assert native.cache_root({"TRIOSERVE_CACHE": str(tmp_path)}) == native.cache_root({})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert native.library_path() == tmp_path / native.build_tag() / f"{native.LIBRARY_NAME}.so"
    assert not native.library_path().is_relative_to(native.SOURCE_DIR.parent)
