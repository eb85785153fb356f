"""The command line describes itself: every subcommand and option has help text, and ``--version`` answers."""

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

import shared_prefix_logps
from shared_prefix_logps import cli
from shared_prefix_logps.bench import demo


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
        [sys.executable, "-m", "shared_prefix_logps.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("shared-prefix-logps ")


#: CPU seconds a `--help` may take in a fresh process (the interpreter's start included; about 0.1 s without torch,
#: where importing torch and transformers alone took 5).
HELP_CPU_SECONDS = 1.0

_HELP_PROBE = """
import runpy, sys
sys.argv = ["shared-prefix-logps", *sys.argv[1:]]
try:
    runpy.run_module("shared_prefix_logps.cli", run_name="__main__")
except SystemExit:
    pass
print("loaded:", ",".join(sorted(m for m in ("torch", "transformers") if m in sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["plan", "--help"], ["demo", "--help"]])
def test_help_answers_without_loading_torch(argv):
    """Every subcommand's `--help` in a fresh process: torch and transformers stay unloaded (the commands that run
    import them), and the process takes well under a second of CPU time (CPU, not wall time: the machine may be
    loaded)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", _HELP_PROBE, *argv], capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr
    assert "usage: shared-prefix-logps" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "loaded:", out.stderr
    assert cpu < HELP_CPU_SECONDS, f"{argv}: {cpu:.2f} CPU seconds"
