"""Entry point of the `rapidfire` console script.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``, which
registers its arguments and sets ``func`` (a callable taking the parsed namespace and returning an exit
status). Modules keep heavy imports (torch, transformers) inside ``func`` so that ``rapidfire --help``
stays fast.

A user's mistake never ends in a traceback: :func:`main` turns the errors a subcommand raises for bad input
(``ConfigError``, ``ValueError``, ``OSError`` (a path that cannot be made, read or written: missing, a file
where a folder is needed, too long a name, no permission, a full disk), ``ImportError``, and ``SystemExit``
with a message) into one line on stderr, ``rapidfire COMMAND: error: ...``, and exit status 2. ``rapidfire --debug COMMAND``
re-raises instead, to show the traceback. Any other exception is a bug of ours and propagates.

Ctrl-C (``KeyboardInterrupt``) on any subcommand prints one line, ``rapidfire COMMAND: interrupted`` (with
where the checkpoint went, when training saved one on the way out), and exits with status 130 (128 + SIGINT, what a shell reports for a program stopped by Ctrl-C); ``--debug`` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

# subcommand modules, in the order `rapidfire --help` lists them
SUBCOMMANDS = ("demo", "plan", "sweep", "monitor", "bench", "env", "config_cmd")
EXIT_USAGE = 2  # a mistake in the command line or in a file it names (argparse's status for the same)
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as shells report it
# what a subcommand raises for bad input (ConfigError is a ValueError); anything else is a bug and propagates
USER_ERRORS = (ValueError, OSError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rapidfire",
        description="rapidfire_hf: fast PPO and faster TRL training on one GPU and beyond.",
    )
    from rapidfire_hf import __version__

    parser.add_argument("--version", action="version", version=f"rapidfire_hf {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback of an error instead of a one-line message (for bug reports)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if importlib.util.find_spec(f"rapidfire_hf.cli.{name}") is None:  # part not installed in this build
            continue
        importlib.import_module(f"rapidfire_hf.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _run(argv)
    except KeyboardInterrupt as err:
        if "--debug" in argv[: argv.index("--") if "--" in argv else len(argv)]:
            raise
        command = next((a for a in argv if not a.startswith("-")), "")
        said = " ".join(str(err).split())  # where training saved its checkpoint, if it did
        print(f"rapidfire{' ' + command if command else ''}: interrupted{': ' + said if said else ''}",
              file=sys.stderr, flush=True)  # fmt: skip
        return EXIT_INTERRUPTED


def _run(argv: list[str]) -> int:
    parser = build_parser()
    passthrough = []
    if "--" in argv:  # everything after `--` goes to the subcommand untouched (e.g. a benchmark script)
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if passthrough:
        if not hasattr(args, "extra"):
            parser.error(f"`rapidfire {args.command}` takes no arguments after `--`")
        args.extra = passthrough
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 1
    try:
        status = int(args.func(args) or 0)
        if sys.stdout is not None:
            sys.stdout.flush()  # here, not at exit: a reader that left is then seen below
        return status
    except BrokenPipeError:  # `rapidfire ... | head`: the reader left; not an error of ours
        return _reader_left()
    except SystemExit as err:
        if args.debug or err.code is None or isinstance(err.code, int):
            raise  # argparse's own exit (status 2, message printed), or an explicit status
        return _user_error(args.command, err.code)
    except USER_ERRORS as err:
        if args.debug:
            raise
        return _user_error(args.command, _describe(err))


def _describe(err: BaseException) -> str:
    """The message of a user error, with what to do where the exception alone does not say it."""
    from rapidfire_hf.config import ConfigError

    text = str(err).strip()
    if isinstance(err, ConfigError):
        return text  # names the key, the value and what is allowed
    if isinstance(err, ModuleNotFoundError):
        return f"{text or 'a module is missing'}: install it (pip install ...) or fix the module name"
    if isinstance(err, FileNotFoundError):
        return f"{text or 'no such file'}: check the path"
    if isinstance(err, OSError) and err.filename is not None and err.strerror:  # the path and what went wrong
        name = str(err.filename)
        name = name if len(name) <= 120 else f"{name[:60]}...{name[-40:]} ({len(name)} characters)"
        return f"{name}: {err.strerror} (check the path)"
    text = " ".join(text.split()) or type(err).__name__
    return f"{text} (rapidfire --debug ... shows where it was raised)"


def _user_error(command: str, message) -> int:
    print(f"rapidfire {command}: error: {_one_line(str(message))}", file=sys.stderr)
    return EXIT_USAGE


def _one_line(text: str) -> str:
    """A multi-line message (a config's list of problems, a YAML error with its caret) as one line."""
    parts = [ln.strip() for ln in text.splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
    out = ""
    for part in parts:
        out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


def _reader_left() -> int:
    """stdout's reader is gone (a closed pipe): exit 0 without Python's "Exception ignored" note, which
    would come from flushing the dead pipe at exit (hence /dev/null in its place)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout closed or not a file: nothing left to flush
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
