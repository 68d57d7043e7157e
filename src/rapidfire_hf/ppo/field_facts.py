"""The per-field tables of PPOConfig, derived from the facts each field declares (``facts(...)`` in its metadata,
:class:`rapidfire_hf.ppo.config.FieldFacts`; ``INHERITED_FACTS`` for the TrainingArguments fields it inherits).

- :data:`UPDATE_SETTINGS` / :data:`OPTIMIZER_SETTINGS`: the settings a resume compares (:func:`update_settings`,
  :func:`compare_settings`; shared by PPOTrainer and every PPOSweep trial);
- :data:`FIELD_KINDS`: the fields a sweep trial may set, with the kind of value each takes (its annotation);
- :data:`CARD_FIELDS`: the model card's rows;
- :data:`PPO_ROWS`: the settings contract, one row per field (:mod:`rapidfire_hf.config.contract`).

A field is named once, where PPOConfig declares it.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import fields
from typing import Any

from rapidfire_hf.checkpoint.identity import plain_value
from rapidfire_hf.config.contract import Use, field_rows
from rapidfire_hf.ppo.config import INHERITED_FACTS, FieldFacts, PPOConfig, declared_facts


def all_facts(cls: type = PPOConfig) -> dict[str, FieldFacts]:
    """Every field's facts, in the order of ``fields(cls)``: those it declares, else ``INHERITED_FACTS``'s."""
    found = {}
    for f in fields(cls):
        own = declared_facts(f)
        if own is not None:
            found[f.name] = own
        elif f.name in INHERITED_FACTS:
            found[f.name] = INHERITED_FACTS[f.name]
    return found


def value_kind(annotation: Any) -> str:
    """The sweep's kind of value (``rapidfire_hf.sweep.fields.value_problem``) for a field's annotation:
    ``float``, ``int``, ``bool``, ``str`` (an Enum of strings too), ``dict``, ``floats`` (a list of floats); a
    ``?`` suffix where None is allowed. The first member of a union decides (``dict | str | None``: ``dict?``)."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    optional = type(None) in members
    first = next(m for m in members if m is not type(None))
    if typing.get_origin(first) is list and typing.get_args(first) == (float,):
        kind = "floats"
    elif isinstance(first, type) and issubclass(first, enum.Enum):
        kind = "str"
    else:
        kind = {float: "float", int: "int", bool: "bool", str: "str", dict: "dict"}[first]
    return kind + ("?" if optional else "")


def sweep_kinds(cls: type = PPOConfig) -> dict[str, str]:
    """The fields a sweep trial may set (``sweep=True``), each with its kind of value (:func:`value_kind`)."""
    hints = typing.get_type_hints(cls)
    kinds = {}
    for name, f in all_facts(cls).items():
        if f.sweep:
            try:
                kinds[name] = value_kind(hints[name])
            except (KeyError, StopIteration):
                raise TypeError(f"PPOConfig.{name} is marked sweep=True, but its annotation "
                                f"{hints[name]!r} is not a kind a trial value can be checked for") from None  # fmt: skip
    return kinds


_FACTS = all_facts()
# field -> what another value changes on resume (a resume with another value is refused, saying so)
UPDATE_SETTINGS: dict[str, str] = {name: f.resume for name, f in _FACTS.items() if f.resume}
# a restored optimizer carries these (its param_groups): on resume the checkpoint's value is kept
OPTIMIZER_SETTINGS: tuple[str, ...] = tuple(name for name, f in _FACTS.items() if f.optimizer_state)
# the fields a sweep trial may set -> the kind of value each takes
FIELD_KINDS: dict[str, str] = sweep_kinds()
# the model card's rows, in order
CARD_FIELDS: tuple[str, ...] = tuple(
    sorted((n for n, f in _FACTS.items() if f.card), key=lambda n: _FACTS[n].card)
)
# field -> entry point -> what it does with the field
PPO_ROWS: dict[str, dict[str, Use]] = field_rows(PPOConfig)


def update_settings(args) -> dict:
    """The values of :data:`UPDATE_SETTINGS` and :data:`OPTIMIZER_SETTINGS` in ``args`` (a PPOConfig)."""
    keys = [*UPDATE_SETTINGS, *OPTIMIZER_SETTINGS]
    return {k: plain_value(getattr(args, k)) for k in keys if hasattr(args, k)}


def compare_settings(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """``(refused, kept)``: one line per update setting that differs (the resume must be refused) and one
    per optimizer setting that differs (the checkpoint's value is kept). Keys absent from either side are
    not compared."""
    refused, kept = [], []
    for key, why in UPDATE_SETTINGS.items():
        if key in saved and key in now and saved[key] != now[key]:
            refused.append(
                f"{key}: saved {saved[key]!r}, this run {now[key]!r}; it sets {why}, so the resumed run would "
                f"not continue the saved one. Resume with {key}={saved[key]!r}"
            )
    for key in OPTIMIZER_SETTINGS:
        if key in saved and key in now and saved[key] != now[key]:
            kept.append(
                f"{key}: this run sets {now[key]!r}, the checkpoint was saved with {saved[key]!r}; the "
                f"checkpoint's {saved[key]!r} is kept (the restored optimizer state carries it)"
            )
    return refused, kept
