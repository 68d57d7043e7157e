"""Issue 44: the config's option enums become plain strings in one place, ``rapidfire_hf.config.schema.to_plain``.
The enums stay on the config object (``cfg.memory.optimization.value`` reads as before); the code that takes a
setting as either the enum or a string converts it with this one function, never with its own helper."""

from __future__ import annotations

import re
from enum import Enum
from pathlib import Path

import pytest

from rapidfire_hf.config import RapidFireConfig, schema, to_plain

SRC = Path(schema.__file__).resolve().parents[1]

# files that may not import the config (a lower or the same layer of tests/test_import_contract.py) and so
# keep a conversion of their own, each for a reason
OWN_CONVERSION = {
    "checkpoint/identity.py": "a JSON value of any setting for the run's fingerprint (any enum, also transformers')",
}


def _option_enums():
    return [
        v
        for v in vars(schema).values()
        if isinstance(v, type) and issubclass(v, Enum) and v.__module__ == schema.__name__
    ]


@pytest.mark.parametrize("enum", _option_enums(), ids=lambda e: e.__name__)
def test_every_option_enum_becomes_its_plain_string(enum):
    for member in enum:
        plain = to_plain(member)
        assert type(plain) is str and plain == member.value
        assert to_plain(member.value) == member.value  # a string stays as given
    assert to_plain(list(enum)) == [m.value for m in enum]


def test_a_config_reads_as_plain_strings_and_keeps_its_enums():
    cfg = RapidFireConfig(memory={"optimization": "aggressive"})
    assert cfg.memory.optimization.value == "aggressive" and isinstance(cfg.memory.optimization, Enum)
    assert type(to_plain(cfg.memory.optimization)) is str
    assert type(cfg.to_dict()["memory"]["optimization"]) is str
    assert to_plain(None) is None and to_plain(3) == 3


def test_no_module_turns_an_enum_into_a_string_on_its_own():
    """No ``getattr(x, "value", x)`` and no ``_plain`` helper outside the config package (the duplicates of
    memory/checkpointing.py and memory/callback.py are gone), but for the files listed with a reason."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("config/") or rel in OWN_CONVERSION:
            continue
        text = path.read_text()
        patterns = [r'getattr\([^()]*,\s*"value"'] + ([r"def _plain\b"] if rel.startswith("memory/") else [])
        for pattern in patterns:
            found += [f"{rel}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert not found, "convert config enums with rapidfire_hf.config.schema.to_plain: " + "; ".join(found)
    for rel in OWN_CONVERSION:
        assert (SRC / rel).is_file(), f"{rel} is listed but gone: drop it from OWN_CONVERSION"
