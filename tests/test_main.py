"""Tests of flashlib/__main__.py, the command line itself: --version, a bare command prints the help,
every option documented with its default, usage on unknown arguments. The commands' work is tested with
their modules (tests/tools/test_selfcheck.py, which also shows `info` tries each backend; test_bench.py)."""
import argparse
import os
import re

import pytest

from conftest import ROOT, run_cli
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



# ---- every option checked on every device: argparse's usage error (exit code 2), never a traceback ----
# (argv, the option the message must name, a phrase of the message). The bench cases run on this machine
# whatever its device: before, a CPU took `bench --n -5 --batch 0` or `--heads 3 --kv-heads 2` and exited
# 0 having checked nothing; `check --backend nope` and `compile-report --arch sm_999x` ended in a
# traceback (exit code 1); `check-repo --expect 'not a repo'` suggested `make set-repo URL=... not a repo`.
BAD_OPTIONS = [
    (("check", "--backend", "nope"), "--backend", "must be a registered backend, one of "),
    (("check", "--backend", ""), "--backend", "must be a registered backend"),
    (("check", "--backend", "Reference"), "--backend", "got 'Reference'"),
    (("compile-report", "--arch", "sm_999x"), "--arch", "invalid choice: 'sm_999x'"),
    (("compile-report", "--arch", "sm_70"), "--arch", "invalid choice: 'sm_70'"),
    (("compile-report", "--arch", "80"), "--arch", "invalid choice"),
    (("compile-report", "--triton", "9"), "--triton", "full Triton release"),
    (("compile-report", "--triton", "latest"), "--triton", "full Triton release"),
    (("compile-report", "--triton", "2.0.0"), "--triton", "at least"),
    (("compile-report", "--dtype", "fp8"), "--dtype", "invalid choice: 'fp8'"),
    (("bench", "--n", "-5", "--batch", "0", "--head-dim", "1000"), "--n", "must be an int >= 1, got '-5'"),
    (("bench", "--n", "0"), "--n", "got '0'"),
    (("bench", "--n", "64", "x"), "--n", "got 'x'"),
    (("bench", "--n", "1.5"), "--n", "got '1.5'"),
    (("bench", "--batch", "0"), "--batch", "must be an int >= 1, got '0'"),
    (("bench", "--batch", "-1"), "--batch", "got '-1'"),
    (("bench", "--heads", "0"), "--heads", "got '0'"),
    (("bench", "--kv-heads", "0"), "--kv-heads", "got '0'"),
    (("bench", "--head-dim", "0"), "--head-dim", "must be an int from 1 to 256"),
    (("bench", "--head-dim", "1000"), "--head-dim", "got '1000'"),
    (("bench", "--head-dim", "257"), "--head-dim", "got '257'"),
    (("bench", "--head-dim", "nan"), "--head-dim", "got 'nan'"),
    (("bench", "--heads", "3", "--kv-heads", "2"), "--kv-heads", "must divide --heads=3"),
    (("bench", "--heads", "16", "--kv-heads", "32"), "--kv-heads", "must divide --heads=16"),
    (("bench", "--kv-heads", "3"), "--kv-heads", "must divide --heads=16"),     # the default H
    (("bench", "--dtype", "float64"), "--dtype", "invalid choice: 'float64'"),
    (("bench", "--only", "forward"), "--only", "invalid choice: 'forward'"),
    (("bench", "--save", "results.txt"), "--save", "expected FILE.json or an existing folder"),
    (("bench", "--save", "no-such-folder/x.json"), "--save", "its folder does not exist"),
    (("bench", "--generate", "--save", "x.json"), "--save", "--generate prints its measurement only"),
    (("bench", "--out", "no-such-folder/plot.png"), "--out", "a file in an existing folder"),
    (("bench", "--out", "notebooks"), "--out", "a file in an existing folder"),
    (("bench", "--out", "plot.docx"), "--out", "the plot's format must be one of"),
    (("set-repo", "http://github.com/a/b"), "url", "GitHub repository address"),
    (("set-repo", ""), "url", "GitHub repository address"),
    (("check-repo", "--expect", "not a repo"), "--expect", "must be a GitHub repository OWNER/REPO"),
    (("check-repo", "--expect", "a/b/c"), "--expect", "got 'a/b/c'"),
    (("check-repo", "--expect", "https://github.com/a/b"), "--expect", "OWNER/REPO"),
    (("check-repo", "--branch", ""), "--branch", "must be a git branch name"),
    (("check-repo", "--branch", "a b"), "--branch", "got 'a b'"),
    (("check-repo", "--branch=-x"), "--branch", "got '-x'"),
    (("check-repo", "--branch", "a..b"), "--branch", "got 'a..b'"),
    (("info", "--json", "extra"), "unrecognized arguments", "extra"),
]


@pytest.mark.parametrize("argv, option, phrase", BAD_OPTIONS, ids=[" ".join(c[0]) for c in BAD_OPTIONS])
def test_a_bad_option_is_argparse_s_usage_error_naming_it(argv, option, phrase, capsys, monkeypatch):
    from flashlib.__main__ import main
    monkeypatch.chdir(ROOT)                        # relative paths above: the repository root
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    command = f"python -m flashlib {argv[0]}" if option != "unrecognized arguments" else "python -m flashlib"
    assert err.startswith("usage: ") and f"{command}: error: " in err, err
    assert (f"argument {option}: " if option != "unrecognized arguments" else option) in err, err
    assert phrase in err, err


@pytest.mark.parametrize("argv", [("check", "--backend", "nope"), ("compile-report", "--arch", "sm_999x"),
                                  ("bench", "--heads", "3", "--kv-heads", "2")])
def test_the_command_line_exits_2_without_a_traceback(argv):
    out = run_cli(*argv, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"python -m flashlib {argv[0]}: error: argument {argv[-2]}" in out.stderr, out.stderr


def test_good_values_at_the_limits_parse():
    """The checks refuse only what is wrong: the smallest and largest accepted values parse."""
    parser = build_parser()
    args = parser.parse_args(["bench", "--n", "1", "7", "--batch", "1", "--heads", "3", "--kv-heads", "1",
                              "--head-dim", "256", "--out", "plot.svg"])
    assert (args.n, args.batch, args.heads, args.kv_heads, args.head_dim) == ([1, 7], 1, 3, 1, 256)
    assert parser.parse_args(["compile-report", "--arch", "sm_90", "--triton", "3.6.0"]).triton == "3.6.0"
    args = parser.parse_args(["check-repo", "--expect", "Jane-Doe/my.book", "--branch", "feature/x-1"])
    assert (args.expect, args.branch) == ("Jane-Doe/my.book", "feature/x-1")
    assert parser.parse_args(["check", "--backend", "reference"]).backend == ["reference"]


@pytest.mark.parametrize("argv", [("check-repo",), ("set-repo", "https://github.com/a/b")])
def test_outside_a_checkout_the_repository_commands_say_so_without_a_traceback(argv, tmp_path):
    """An installed flashlib has no _config.yml: before, `check-repo` ended in a FileNotFoundError
    traceback. The package is copied out of the checkout and run from there."""
    import shutil
    import subprocess
    import sys
    shutil.copytree(ROOT / "flashlib", tmp_path / "flashlib",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.cubin"))
    out = subprocess.run([sys.executable, "-m", "flashlib", *argv], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
    assert f"no _config.yml in {tmp_path}" in out.stderr, out.stderr
