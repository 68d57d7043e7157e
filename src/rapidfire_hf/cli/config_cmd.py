"""``rapidfire config``: validate a config file, show a resolved config, list the presets.

Examples::

    rapidfire config validate config/advanced.yaml        # exit 0 and a summary, or exit 2 and the error
    rapidfire config show --preset aggressive --format json
    RAPIDFIRE_GRADIENT_PIPELINE_DEPTH=2 rapidfire config show --file config/advanced.yaml
    rapidfire config presets
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rapidfire_hf.cli.json_output import JsonStdout

EXIT_INVALID = 2
DESCRIPTION = "Validate a rapidfire_hf config file, show a resolved config, or list the presets."


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``rapidfire config`` and its ``validate``, ``show`` and ``presets`` subcommands."""
    parser = subparsers.add_parser(
        "config", help="validate or show a rapidfire_hf configuration", description=DESCRIPTION
    )
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION")

    validate = actions.add_parser("validate", help="check a YAML config file (exit 2 if it is invalid)")
    validate.add_argument("file", help="path to a YAML config file")
    validate.add_argument(
        "--with-env", action="store_true", help="also apply and check RAPIDFIRE_* environment overrides"
    )
    validate.set_defaults(func=validate_command)

    show = actions.add_parser("show", help="print the resolved config, environment overrides included")
    source = show.add_mutually_exclusive_group()
    source.add_argument("--preset", help="preset to show: conservative, balanced (default) or aggressive")
    source.add_argument("--file", help="YAML config file to show")
    show.add_argument(
        "--format", choices=("yaml", "json"), default="yaml", help="output format (default yaml)"
    )
    show.set_defaults(func=show_command)

    presets = actions.add_parser("presets", help="list the presets and what each is for")
    presets.set_defaults(func=presets_command)

    parser.set_defaults(func=lambda args: _print_help(parser))
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 1


def _fail(err: Exception) -> int:
    print(f"rapidfire config: error: {err}", file=sys.stderr)
    return EXIT_INVALID


def summarize(cfg) -> str:
    """One line per section describing a ``RapidFireConfig``."""
    g, m, p, log = cfg.gradient, cfg.memory, cfg.precision, cfg.logging
    pipeline = (
        f"pipeline on, depth {g.pipeline_depth}, overlap {g.overlap_factor:g}, verify every {g.sync_interval} step(s)"
        if g.pipeline
        else "pipeline off"
    )
    rules = "; ".join(f"{r.condition} -> {r.action}" for r in p.fallback) or "none"
    reports = ", ".join(log.report_to) or "none"
    return "\n".join(
        [
            f"  gradient:  {pipeline}",
            f"  memory:    {m.optimization.value}, compact above {m.compaction_threshold:g} fragmentation, "
            f"prefetch {m.prefetch_window}",
            f"  precision: {p.mode.value} from {p.initial.value}; {len(p.fallback)} fallback rule(s): {rules}",
            f"  logging:   {log.level.value}, every {log.log_every} step(s), report to {reports}",
        ]
    )


def validate_command(args: argparse.Namespace) -> int:
    """Load ``args.file``; print a summary and return 0, or print the error and return 2."""
    from rapidfire_hf.config import ConfigError, load_config

    try:
        cfg = load_config(Path(args.file), env=args.with_env)  # a Path: never taken for a preset name
    except ConfigError as err:
        return _fail(err)
    print(f"OK: {args.file} is a valid rapidfire_hf config")
    print(summarize(cfg))
    return 0


def show_command(args: argparse.Namespace) -> int:
    """Print the config resolved from ``--preset``/``--file`` plus environment overrides."""
    src = Path(args.file) if args.file else args.preset
    with JsonStdout(args.format == "json") as out:  # what libraries print while loading goes to stderr
        from rapidfire_hf.config import ConfigError, env_overrides, env_variables, load_config

        try:
            cfg = load_config(src)
            overridden = env_overrides()
        except ConfigError as err:
            return _fail(err)
        if args.format == "json":
            out.emit(cfg.to_dict())
            return 0
    names = {key: name for name, key in env_variables().items()}
    for section, values in overridden.items():
        for key in values:
            print(f"# {section}.{key} set by {names[(section, key)]}")
    print(cfg.to_yaml(), end="")
    return 0


def presets_command(args: argparse.Namespace) -> int:
    """List the preset names with their descriptions."""
    from rapidfire_hf.config import PRESET_DESCRIPTIONS

    width = max(map(len, PRESET_DESCRIPTIONS))
    for name, description in PRESET_DESCRIPTIONS.items():
        print(f"{name:<{width}}  {description}")
    return 0
