"""``scripts/nginx_lb.sh``: two servers behind nginx on loopback, streams
through it, and every process it started gone afterwards, also when a step
fails. Needs nginx: on CI (``CI=true``) scripts/setup.sh installs it, so a
missing nginx fails there instead of skipping."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "nginx_lb.sh"


def nginx_path() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)


def require_nginx() -> str:
    path = nginx_path()
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nginx is missing: scripts/setup.sh installs it (apt-get install -y nginx)")
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    return path


def run_script(timeout: float = 1500, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def started_pids(output: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"\(pid (\d+)\)", output)]


def assert_gone(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"process {pid} started by the script is still running")


def test_without_nginx_the_script_says_what_to_install():
    result = run_script(timeout=60, NGINX="/nonexistent/nginx")
    assert result.returncode == 3
    assert "apt-get install -y nginx" in result.stderr
    assert not started_pids(result.stdout)


@pytest.mark.slow
def test_two_servers_behind_nginx_serve_streams_and_stop():
    require_nginx()
    result = run_script(REQUESTS="6")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: 6 streams through nginx" in result.stdout
    assert len(re.findall(r"finish_reason=(stop|length)", result.stdout)) == 6
    pids = started_pids(result.stdout)
    assert len(pids) == 3  # two servers and nginx
    assert_gone(pids)


@pytest.mark.slow
def test_a_failure_midway_still_stops_every_process(tmp_path):
    # The servers cannot be ready within a second (loading the model alone
    # takes longer), so the script fails while both are starting; its trap
    # must stop them. No real nginx is needed to get that far.
    fake = tmp_path / "nginx"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    result = run_script(NGINX=str(fake), STARTUP_TIMEOUT="1")
    assert result.returncode == 1
    assert "did not become ready in 1 s" in result.stderr
    pids = started_pids(result.stdout)
    assert len(pids) == 2  # both servers started, nginx never did
    assert_gone(pids)
