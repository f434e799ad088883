"""``python -m flashlib <command>``: the library's command line.

Commands live in :data:`COMMANDS` (name -> (help, add_arguments, run)); adding one is one entry:
``COMMANDS["info"] = ("print the environment", add_info_arguments, run_info)`` where
``run(args) -> int`` is the exit code. A bare ``python -m flashlib`` prints the help (exit code 0);
``--version`` prints ``flashlib <version>``; unknown commands or options print the usage (exit code 2).
Every option has a help string, and ``COMMAND --help`` shows each option's default.

Every option is checked on every device before a command does any work: a bad value, an unknown name or
options that contradict each other end in argparse's usage message naming the option, exit code 2,
never a traceback (argparse ``type`` functions check one value; a command's ``run`` checks the
combinations and calls ``args.usage_error(message)``, its parser's ``error``).

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import argparse
import json
import sys


def _triton_release(text: str) -> str:
    """``--triton``: a full Triton release like 3.6.0 (what compile_report's ``triton=`` takes)."""
    from .tools import triton_versions
    try:
        triton_versions.folder(text)                 # checks the version (and only computes a path)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_report_arguments(parser) -> None:
    from .tools.compile_report import ARCHS
    parser.add_argument("--arch", action="append", default=None, metavar="SM", choices=ARCHS,
                        help=f"architecture, one of {', '.join(ARCHS)} (repeatable; default: all of them)")
    parser.add_argument("--no-cache", action="store_true", help="compile afresh, ignoring the disk cache")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--triton", default=None, metavar="VERSION", type=_triton_release,
                        help="compile the Triton rows with this Triton release, e.g. 3.6.0 (Colab's), "
                             "installed beside this one on first use (default: the installed triton)")
    parser.add_argument("--dtype", action="append", default=None, choices=("fp16", "bf16", "fp32"),
                        help="the inputs' dtype of the Triton rows (repeatable; default: fp16 fp32)")


def _run_report(args) -> int:
    from .tools.compile_report import ARCHS, REPORT_DTYPES, compile_report, format_report, summary
    try:
        rows = compile_report(tuple(dict.fromkeys(args.arch or ARCHS)), cache=not args.no_cache,
                              triton=args.triton, dtypes=tuple(dict.fromkeys(args.dtype or REPORT_DTYPES)))
    except (ValueError, TypeError) as e:             # the options are checked: a last line of defence
        args.usage_error(str(e))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_report(rows))
        print()
        print(summary(rows))
    return 0 if all(r["ok"] for r in rows) else 1


def _add_bench_arguments(parser) -> None:
    from .tools.bench import add_arguments
    add_arguments(parser)


def _run_bench(args) -> int:
    from .tools.bench import _check_arguments, main
    try:
        _check_arguments(args)                       # before bench decides whether there is a GPU
    except ValueError as e:
        args.usage_error(str(e))
    return main(args)


def _add_info_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print as JSON instead of a table")


def _run_info(args) -> int:
    from .tools.selfcheck import format_info, info
    d = info()
    print(json.dumps(d, indent=1) if args.json else format_info(d))
    return 0


def _backend_name(text: str) -> str:
    """``--backend``: a registered backend's name (read when the option is parsed: tests register more)."""
    from .backends import BACKENDS
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"must be a registered backend, one of {', '.join(sorted(BACKENDS))}, "
                                         f"got {text!r}")
    return text


def _add_check_arguments(parser) -> None:
    parser.add_argument("--backend", action="append", default=None, metavar="NAME", type=_backend_name,
                        help="check only this backend (repeatable; default: every registered one)")


def _run_check(args) -> int:
    from .tools.selfcheck import CHECK_HEAD, check, exit_code, format_check, format_row
    print(CHECK_HEAD, "-" * len(CHECK_HEAD), sep="\n", flush=True)
    backends = None if args.backend is None else list(dict.fromkeys(args.backend))   # each once
    rows = check(backends, on_row=lambda r: print(format_row(r), flush=True))   # each row when done
    print(format_check(rows, head=False))
    return exit_code(rows)


def _repository_url(text: str) -> str:
    """``set-repo URL``: a GitHub repository address (flashlib.tools.publish.validate_url)."""
    from .tools.publish import validate_url
    try:
        validate_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _owner_repo(text: str) -> str:
    """``check-repo --expect``: OWNER/REPO, whose address validate_url accepts."""
    from .tools.publish import validate_url
    try:
        validate_url(f"https://github.com/{text}")
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a GitHub repository OWNER/REPO, like someone/flashbook, "
                                         f"got {text!r}") from None
    return text


def _branch_name(text: str) -> str:
    """``check-repo --branch``: a name git accepts for a branch (git check-ref-format's rules)."""
    bad = (not text or text.startswith(("-", "/", ".")) or text.endswith(("/", ".", ".lock"))
           or any(part in text for part in ("..", "//", "@{", "/.")) or text == "@"
           or any(c.isspace() or ord(c) < 32 or c in "~^:?*[\\\x7f" for c in text))
    if bad:
        raise argparse.ArgumentTypeError(f"must be a git branch name, like main, got {text!r}")
    return text


def _add_set_repo_arguments(parser) -> None:
    parser.add_argument("url", type=_repository_url,
                        help="the repository's address, https://github.com/OWNER/REPO")


def _run_set_repo(args) -> int:
    from .tools.publish import check, set_repo
    try:
        changed = set_repo(args.url)
    except (ValueError, FileNotFoundError) as e:
        print(e, file=sys.stderr)
        return 2
    print(f"repository address set to {args.url}; changed: {', '.join(changed) or 'nothing (already set)'}")
    problems = check()
    print(*problems, sep="\n", file=sys.stderr)
    return 1 if problems else 0


def _add_check_repo_arguments(parser) -> None:
    parser.add_argument("--expect", metavar="OWNER/REPO", default=None, type=_owner_repo,
                        help="the repository publishing the book: refuse the placeholder and any other address "
                             "(default: only check that every use agrees with _config.yml)")
    parser.add_argument("--branch", default=None, type=_branch_name,
                        help="its default branch, which the Colab links must open (default: not checked)")


def _run_check_repo(args) -> int:
    from .tools.publish import PLACEHOLDER, check, colab_links, repo_url
    try:
        problems = check(expect=args.expect, branch=args.branch)
    except FileNotFoundError as e:                   # an installed flashlib: no book to check
        print(f"check-repo: {e}", file=sys.stderr)
        return 1
    if problems:
        print("The book cannot be published as it is:", *problems, sep="\n  ", file=sys.stderr)
        return 1
    url = repo_url()
    shown = "the book's Colab buttons open:" if url != PLACEHOLDER else \
        "the Colab links (the book shows no button until `make set-repo URL=...` has run):"
    print(f"repository: {url}; every chapter's setup cell, the README and the intro agree; {shown}")
    print(*colab_links().values(), sep="\n")
    return 0


COMMANDS = {
    "info": ("versions, the device, and which backends can run here (and why not)",
             _add_info_arguments, _run_info),
    "check": ("run every available backend against the float64 oracle on this device: pass/fail table",
              _add_check_arguments, _run_check),
    "bench": ("time the Triton kernels vs each torch SDPA backend and naive attention (GPU; --save FILE.json "
              "keeps every measurement; --serving: varlen vs padded SDPA, paged vs dense decode, cascade "
              "vs plain decode; on CPU: compile report)",
              _add_bench_arguments, _run_bench),
    "compile-report": ("compile every kernel for sm_75..sm_90 and print registers/spills/smem/tensor cores",
                       _add_report_arguments, _run_report),
    "set-repo": ("make URL the book's repository: rewrite _config.yml, every chapter's setup cell and the README",
                 _add_set_repo_arguments, _run_set_repo),
    "check-repo": ("check that the Colab links, setup cells and README agree with _config.yml's repository",
                   _add_check_repo_arguments, _run_check_repo),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` to each option's help, unless the help already says its default in
    words; an option whose default is None must (``(default: None)`` would tell the reader nothing)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(prog="python -m flashlib", description="flashlib's command line",
                                     epilog="`python -m flashlib COMMAND --help` shows a command's options")
    parser.add_argument("--version", action="version", version=f"flashlib {__version__}",
                        help="print flashlib's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="command", title="commands")
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        add_arguments(p)
        p.set_defaults(run=run, usage_error=p.error)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:            # a bare `python -m flashlib`: the help, not an error
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
