"""Every flag of every command says what it does, in a group named by its
concern: a new flag without help text, or outside a group, fails here."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from trioserve.web.cli import build_parser, command_named, package_version, parser_for
from trioserve.web.engine_options import GROUPS
from trioserve.web.serve_options import build_serve_parser

# argparse's own groups, the ones an option lands in when it names none.
UNNAMED_GROUPS = {"options", "optional arguments", "positional arguments"}


def walk(parser: argparse.ArgumentParser, name: str):
    """``(command, parser)`` for ``parser`` and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from walk(sub, f"{name} {sub_name}")


def every_parser():
    yield from walk(build_parser(), "trioserve")
    # What the environment variables of `hypercorn ... create_app()` are read with.
    yield "trioserve serve (standalone)", build_serve_parser()


def options(parser: argparse.ArgumentParser):
    """``(group title, action)`` for each option of ``parser`` but -h."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if not isinstance(action, argparse._HelpAction):
                yield group.title, action


def describe(action: argparse.Action) -> str:
    return "/".join(action.option_strings) or action.dest


COMMANDS = list(every_parser())


def test_every_command_is_walked():
    names = {name for name, _ in COMMANDS}
    assert {"trioserve generate", "trioserve serve", "trioserve worker", "trioserve bench serve"} <= names
    assert "trioserve bench offline" in names


@pytest.mark.parametrize(("name", "parser"), COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_option_has_help_in_a_named_group(name, parser):
    seen = list(options(parser))
    assert len(seen) == len([a for a in parser._actions if not isinstance(a, argparse._HelpAction)])
    for title, action in seen:
        assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, (
            f"{name} {describe(action)} has no help text"
        )
        assert title and title not in UNNAMED_GROUPS, f"{name} {describe(action)} is in no named group ({title!r})"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_engine_options_sit_in_the_groups_of_their_concern(command):
    parser = dict(COMMANDS)[f"trioserve {command}"]
    group_of = {describe(action): title for title, action in options(parser)}
    assert group_of["--model"] == "model"
    assert group_of["--generation-config"] == "model"
    assert group_of["--max-num-seqs"] == "engine"
    assert group_of["--no-batch-invariant"] == "engine"
    assert group_of["--tensor-parallel-size"] == "scale-out"
    assert set(group_of.values()) <= set(GROUPS) | {"generation"}


def test_serve_lists_the_concerns_in_order():
    parser = dict(COMMANDS)["trioserve serve"]
    titles = [group.title for group in parser._action_groups if group._group_actions and group.title in GROUPS]
    assert titles == list(GROUPS)


def test_no_batch_invariant_reaches_the_engine_config():
    from trioserve.web.engine_options import engine_config_from_args

    parser = dict(COMMANDS)["trioserve generate"]
    assert engine_config_from_args(parser.parse_args(["hi"])).batch_invariant is True
    assert engine_config_from_args(parser.parse_args(["hi", "--no-batch-invariant"])).batch_invariant is False


def test_version_prints_the_package_version():
    result = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"trioserve {package_version()}"
    assert package_version()[0].isdigit()


def test_version_without_an_install_is_pyprojects(monkeypatch):
    import tomllib
    from importlib import metadata
    from pathlib import Path

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert package_version() == pyproject["project"]["version"]


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["serve", "--port", "1"], "serve"),
        (["--log-level", "debug", "generate", "hi"], "generate"),
        (["--log-level", "DEBUG", "bench", "vs-llama"], "bench"),
        (["-h"], None),
        ([], None),
    ],
)
def test_the_command_is_read_past_the_top_level_options(argv, command):
    assert command_named(argv) == command


def test_the_built_in_commands_parse_without_the_installed_ones():
    """What main builds for ``serve``: every built-in command, no bench (nor its imports)."""
    names = {name for name, _ in walk(parser_for(["serve"]), "trioserve")}
    assert {f"trioserve {c}" for c in ("generate", "serve", "run-batch", "worker")} <= names
    assert not any(name.startswith("trioserve bench") for name in names)
    assert parser_for(["serve"]).parse_args(["serve"]).command == "serve"
    bench = {name for name, _ in walk(parser_for(["bench", "vs-llama"]), "trioserve")}
    assert "trioserve bench vs-llama" in bench


def test_serve_does_not_import_the_bench_and_bench_still_runs():
    code = (
        "import sys; from trioserve.web import cli; "
        "p = cli.parser_for(['serve']); "
        "print('trioserve.bench' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    help_text = subprocess.run(
        [sys.executable, "-m", "trioserve.web.cli", "bench", "-h"], capture_output=True, text=True, check=True
    ).stdout
    assert "vs-llama" in help_text
