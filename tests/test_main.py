"""Tests of flashlib/__main__.py, the command line itself: --version, a bare command prints the help,
every option documented with its default, usage on unknown arguments. The commands' work is tested with
their modules (tests/tools/test_selfcheck.py, which also shows `info` tries each backend; test_bench.py)."""
import argparse
import re

import pytest

from conftest import run_cli
import flashlib
from flashlib.__main__ import COMMANDS, build_parser


def _commands(parser) -> dict:
    """The subcommand parsers of ``parser``, by name."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _undocumented(parser) -> list[str]:
    """The arguments of ``parser`` with no help, and the options whose ``--help`` entry names no default
    (a required positional argument has none)."""
    entries = re.split(r"\n(?=  -)", parser.format_help().split("options:\n", 1)[1])
    bad = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        entry = " ".join(next((e for e in entries if e.split()[0].rstrip(",") == name), "").split())
        no_default = action.option_strings and "default:" not in entry
        if not action.help or action.help == argparse.SUPPRESS or no_default:
            bad.append(name)
    return bad


def test_version_prints_flashlib_and_its_version():
    out = run_cli("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"flashlib {flashlib.__version__}\n", "")


def test_a_bare_command_prints_the_help_and_exits_0():
    out = run_cli()
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.startswith("usage: python -m flashlib")
    for name in COMMANDS:
        assert re.search(rf"^\s+{re.escape(name)}\b", out.stdout, flags=re.M), f"{name} is not listed"
    assert "--version" in out.stdout


def test_every_option_of_every_command_has_a_help_and_a_default():
    commands = _commands(build_parser())
    assert set(commands) == set(COMMANDS)
    for name, parser in commands.items():
        assert parser.description, f"{name} has no description"
        assert _undocumented(parser) == [], f"`{name} --help` leaves options undocumented"


def test_the_documentation_check_catches_an_undocumented_option():
    parser = _commands(build_parser())["check"]
    parser.add_argument("--no-help", type=int, default=3)
    parser.add_argument("--mute", default=None, help="a value")
    parser.add_argument("silent")
    parser.add_argument("--fine", default=None, help="a value (default: none)")
    assert _undocumented(parser) == ["--no-help", "--mute", "silent"]


def test_help_shows_defaults():
    out = run_cli("bench", "--help")
    text = " ".join(out.stdout.split())
    assert out.returncode == 0
    assert "batch size B (default: 4)" in text and "(default: float16)" in text


@pytest.mark.parametrize("args", [("bogus",), ("bench", "--frob"), ("check", "--bogus")])
def test_unknown_arguments_print_usage_and_exit_2(args):
    out = run_cli(*args)
    assert out.returncode == 2 and "usage: python -m flashlib" in out.stderr

