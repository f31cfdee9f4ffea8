"""The capability trials' results kept per machine and build
(engine/kernels/trial_cache.py): a second start reads them and runs no
trial, and finds what the first found; anything in the key that changes
(a library cap, the native switch) runs them again; the switch that turns
the cache off, and a folder that cannot be written, run them every time."""

from __future__ import annotations

from unittest import mock

import pytest

from trioserve.engine.kernels import capability, trial_cache
from trioserve.engine.kernels.capability import CpuPaths

SWITCHES = ("ONEDNN_MAX_CPU_ISA", "TRIOSERVE_NATIVE_KERNELS")


class Trials:
    """A stand-in for the trials: counts its runs, finds ``found``."""

    def __init__(self, found: dict[str, str | None]) -> None:
        self.found, self.runs = found, 0

    def __call__(self) -> dict[str, str | None]:
        self.runs += 1
        return dict(self.found)


def test_a_second_start_reads_the_first_ones_results(tmp_path):
    environ = {"TRIOSERVE_NATIVE_CACHE": str(tmp_path)}
    trials = Trials({"a": None, "b": "RuntimeError: no"})
    first = trial_cache.results(["a", "b"], trials, environ, SWITCHES)
    second = trial_cache.results(["a", "b"], trials, environ, SWITCHES)
    assert first == second == {"a": None, "b": "RuntimeError: no"} and trials.runs == 1
    assert len(list((tmp_path / trial_cache.FOLDER).glob("*.json"))) == 1


@pytest.mark.parametrize("changed", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"TRIOSERVE_NATIVE_KERNELS": "0"}])
def test_a_change_the_key_holds_runs_the_trials_again(tmp_path, changed):
    environ = {"TRIOSERVE_NATIVE_CACHE": str(tmp_path)}
    trials = Trials({"a": None})
    trial_cache.results(["a"], trials, environ, SWITCHES)
    trial_cache.results(["a"], trials, {**environ, **changed}, SWITCHES)
    trial_cache.results(["a", "c"], trials, environ, SWITCHES)  # another set of probes
    assert trials.runs == 3


def test_the_switch_and_an_unwritable_folder_run_the_trials_every_time(tmp_path):
    trials = Trials({"a": None})
    off = {"TRIOSERVE_NATIVE_CACHE": str(tmp_path), trial_cache.OFF_ENV: "0"}
    for _ in range(2):
        assert trial_cache.results(["a"], trials, off, SWITCHES) == {"a": None}
    assert trials.runs == 2 and not (tmp_path / trial_cache.FOLDER).exists()
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache's folder would be
    for _ in range(2):
        assert trial_cache.results(["a"], trials, {"TRIOSERVE_NATIVE_CACHE": str(blocked)}, SWITCHES) == {"a": None}
    assert trials.runs == 4


def test_cpu_paths_found_from_kept_results_are_those_the_trials_found(tmp_path):
    environ = {"TRIOSERVE_NATIVE_CACHE": str(tmp_path)}
    first = CpuPaths.from_environment(environ)
    with mock.patch.object(capability, "run_trial", side_effect=AssertionError("a trial ran")):
        again = CpuPaths.from_environment(environ)
        avx2 = CpuPaths.from_environment({**environ, "TRIOSERVE_CPU_ASSUME": "avx2"})  # the switch applies after
    assert again == first
    assert avx2.paths == CpuPaths.detect(assume="avx2", trials={p.name: p.trial_error for p in first.paths}).paths
