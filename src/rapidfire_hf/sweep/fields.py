"""What a trial may set, how it may be named, and the states it can be in.

Plain Python on purpose (no torch, no transformers): ``rapidfire sweep ctl`` checks its arguments with
these tables and answers in a fraction of a second.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

# PPOConfig fields a trial may override, with the kind of value each takes. Everything else is shared:
# the decode (response_length, temperature, top_k/top_p, stop token), the prompt width and the precision
# are one batched pass for all. The table is PPOConfig's: each field says ``sweep=True`` where it is declared
# (rapidfire_hf.ppo.field_facts.FIELD_KINDS, the kind read from its annotation). ``ctl`` needs it without torch
# or transformers, so it is kept as trial_fields.json beside this file, written by
# ``python -m rapidfire_hf.sweep.fields`` and checked equal to PPOConfig's by tests/ppo/test_field_facts.py.
TRIAL_FIELDS_FILE = Path(__file__).with_name("trial_fields.json")
FIELD_KINDS: dict[str, str] = json.loads(TRIAL_FIELDS_FILE.read_text(encoding="utf-8"))
PER_TRIAL_FIELDS = frozenset(FIELD_KINDS)
# the fields that only set how long a trial runs: a resumed trial may change them (to extend a sweep)
LENGTH_FIELDS = frozenset({"max_steps", "total_episodes", "num_train_epochs"})

# "damaged": none of the trial's checkpoints could be resumed (sweep/checkpoint.py says which file)
STATES = ("running", "stopped", "finished", "early_stopped", "diverged", "damaged")
NAME_LIMIT = 128  # characters; a name is a folder name, and checkpoint paths add ~40 more
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+-]*$")


def check_trial_name(name) -> None:
    """Trial names become folder names: letters, digits and ``. _ = + -``, at most ``NAME_LIMIT`` long.

    Raises:
        ValueError: naming the problem.
    """
    if not isinstance(name, str):
        raise ValueError(f"trial name {name!r} must be a string (in YAML, quote it: '{name}')")
    if not _NAME.match(name):
        shown = repr(name) if len(repr(name)) <= 80 else repr(name)[:77] + "..."
        raise ValueError(
            f"trial name {shown} is not allowed: use letters, digits and . _ = + -, starting with a letter "
            "or digit (it names a folder)"
        )
    if len(name) > NAME_LIMIT:
        raise ValueError(
            f"trial name {name[:40]}... is {len(name)} characters long: at most {NAME_LIMIT} (it names a folder)"
        )


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def value_problem(key: str, value) -> str | None:
    """Why ``value`` cannot be trial field ``key`` (its kind is wrong), or None. The full check (ranges,
    choices) is PPOConfig's; this one needs no import and catches the type mistakes of a command line."""
    kind = FIELD_KINDS[key]
    if kind.endswith("?"):
        if value is None:
            return None
        kind = kind[:-1]
    ok = {
        "float": _is_number(value),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "dict": isinstance(value, dict),
        "floats": isinstance(value, list) and all(_is_number(v) for v in value),
    }[kind]
    if ok:
        return None
    wanted = {
        "float": "a finite number",
        "int": "an integer",
        "bool": "true or false",
        "str": "a string",
        "dict": "a mapping such as {num_cycles: 2}",
        "floats": "a list of numbers such as [1.0, 0.5]",
    }[kind]
    return f"{key} takes {wanted}{' or null' if FIELD_KINDS[key].endswith('?') else ''}, got {value!r}"


def write_trial_fields(path: Path = TRIAL_FIELDS_FILE) -> dict[str, str]:
    """Write PPOConfig's per-trial fields (``rapidfire_hf.ppo.field_facts.FIELD_KINDS``) to ``path``."""
    from rapidfire_hf.ppo.field_facts import FIELD_KINDS as declared

    path.write_text(json.dumps(declared, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return declared


if __name__ == "__main__":
    print(f"{len(write_trial_fields())} per-trial fields written to {TRIAL_FIELDS_FILE}")
