"""The command line describes itself: every subcommand and option has help text, and ``--version`` answers."""

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

import shared_prefix_logps
from shared_prefix_logps.bench import cli, demo


def _options(parser: argparse.ArgumentParser):
    """(parser prog, action) for every option and positional of ``parser`` and of its subcommands, recursively."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser.prog, action


def _parsers():
    return {"shared-prefix-logps": cli.build_parser(), "shared-prefix-logps demo": demo.build_parser()}


@pytest.mark.parametrize("name", ["shared-prefix-logps", "shared-prefix-logps demo"])
def test_every_option_has_help(name):
    options = list(_options(_parsers()[name]))
    assert len(options) > 10 if name == "shared-prefix-logps" else len(options) >= 8
    missing = [f"{prog} {action.option_strings or action.dest}" for prog, action in options if not action.help]
    assert not missing, f"options without help text: {missing}"


def test_every_subcommand_has_help():
    (subparsers,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(subparsers.choices) == {"bench", "demo", "plan"}
    helps = {choice.dest: choice.help for choice in subparsers._choices_actions}
    assert all(helps.get(name) for name in subparsers.choices), helps


@pytest.mark.parametrize("subcommand", ["bench", "plan"])
def test_subcommand_help_lists_every_option(subcommand, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([subcommand, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    (subparsers,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subparsers.choices[subcommand]._actions:
        for option in action.option_strings:
            assert option in text
        if action.help and action.help != argparse.SUPPRESS:
            assert action.help.split("%(")[0].split()[0] in text


def test_demo_help_goes_to_the_demo(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--completion-len" in text and "--threads" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    try:
        expected = importlib.metadata.version("shared-prefix-logps")
    except importlib.metadata.PackageNotFoundError:
        expected = shared_prefix_logps.__version__
    assert capsys.readouterr().out.strip() == f"shared-prefix-logps {expected}"


def test_version_falls_back_to_the_package(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.package_version() == shared_prefix_logps.__version__


def test_version_from_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-m", "shared_prefix_logps.bench.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("shared-prefix-logps ")
