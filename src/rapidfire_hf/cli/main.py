"""Entry point of the `rapidfire` console script.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``, which
registers its arguments and sets ``func`` (a callable taking the parsed namespace and returning an exit
status). Modules keep heavy imports (torch, transformers) inside ``func`` so that ``rapidfire --help``
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# subcommand modules, in the order `rapidfire --help` lists them
SUBCOMMANDS = ("demo", "plan", "sweep", "monitor", "bench", "env", "config_cmd")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rapidfire",
        description="rapidfire_hf: fast PPO and faster TRL training on one GPU and beyond.",
    )
    from rapidfire_hf import __version__

    parser.add_argument("--version", action="version", version=f"rapidfire_hf {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        if importlib.util.find_spec(f"rapidfire_hf.cli.{name}") is None:  # part not installed in this build
            continue
        importlib.import_module(f"rapidfire_hf.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
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
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `rapidfire ... | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
