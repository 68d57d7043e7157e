"""PPOConfig's per-field tables, derived from the facts each field declares (rapidfire_hf.ppo.field_facts).

The tables were spelled out by name in four modules before (the resume settings in checkpoint/identity.py, the
sweep's FIELD_KINDS in sweep/fields.py, the model card's fields in ppo/recipe/export.py, the settings contract's
PPO_ROWS in config/contract.py); tests/ppo/reference/field_facts_b865d9f.json is a frozen copy of those four
tables taken before the move. The derived tables must equal it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from rapidfire_hf.config.contract import CONTRACT_KEY
from rapidfire_hf.ppo import field_facts
from rapidfire_hf.ppo.config import FACTS_KEY, FieldFacts, PPOConfig, declared_facts

FROZEN = json.loads((Path(__file__).parent / "reference" / "field_facts_b865d9f.json").read_text())


def _plain_rows(rows) -> dict:
    return json.loads(json.dumps({n: {e: [u.verdict, u.why, list(u.accepts)] for e, u in r.items()}
                                  for n, r in rows.items()}))  # fmt: skip


def test_resume_settings_are_the_frozen_ones():
    assert field_facts.UPDATE_SETTINGS == FROZEN["update_settings"]
    assert list(field_facts.OPTIMIZER_SETTINGS) == FROZEN["optimizer_settings"]


def test_sweep_field_kinds_are_the_frozen_ones():
    assert field_facts.FIELD_KINDS == FROZEN["field_kinds"]


def test_model_card_fields_are_the_frozen_ones_in_order():
    assert list(field_facts.CARD_FIELDS) == FROZEN["card_fields"]


def test_settings_contract_rows_are_the_frozen_ones():
    assert _plain_rows(field_facts.PPO_ROWS) == FROZEN["ppo_rows"]


def test_every_field_ppo_config_declares_carries_its_facts():
    own = {f.name for f in dataclasses.fields(PPOConfig)} & set(PPOConfig.__annotations__)
    assert own, "no field declared by PPOConfig found"
    for f in dataclasses.fields(PPOConfig):
        if f.name in own:
            assert isinstance(declared_facts(f), FieldFacts), f.name


def test_argparse_sees_only_the_help():
    # HfArgumentParser passes every metadata key it iterates to argparse's add_argument
    for f in dataclasses.fields(PPOConfig):
        if declared_facts(f) is not None:
            assert dict(f.metadata) == {"help": f.metadata["help"]}, f.name
            assert f.metadata[FACTS_KEY] is declared_facts(f)
            assert f.metadata[CONTRACT_KEY] is declared_facts(f).contract
    (args,) = HfArgumentParser(PPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "x", "--kl_coef", "0.2", "--cliprange", "0.1", "--report_to", "none"]
    )
    assert (args.kl_coef, args.cliprange) == (0.2, 0.1)


@pytest.mark.parametrize(
    "annotation, kind",
    [(float, "float"), (int | None, "int?"), (list[float] | None, "floats?"), (dict | str | None, "dict?"),
     (bool, "bool"), (str, "str")],
)  # fmt: skip
def test_value_kind_from_annotation(annotation, kind):
    assert field_facts.value_kind(annotation) == kind


def test_a_sweep_field_of_an_uncheckable_type_is_refused_by_name():
    @dataclasses.dataclass
    class Odd:
        odd: tuple = dataclasses.field(default=(), metadata={FACTS_KEY: FieldFacts(sweep=True)})

    with pytest.raises(TypeError, match="PPOConfig.odd is marked sweep=True"):
        field_facts.sweep_kinds(Odd)


def test_the_sweep_ctl_table_is_ppo_configs():
    # sweep ctl reads the per-trial fields without torch or transformers, from a file written from PPOConfig
    from rapidfire_hf.sweep.fields import FIELD_KINDS, PER_TRIAL_FIELDS, TRIAL_FIELDS_FILE

    assert json.loads(TRIAL_FIELDS_FILE.read_text()) == field_facts.FIELD_KINDS, (
        "PPOConfig's sweep=True fields changed: run `python -m rapidfire_hf.sweep.fields` to write "
        f"{TRIAL_FIELDS_FILE.name} again"
    )
    assert FIELD_KINDS == field_facts.FIELD_KINDS and PER_TRIAL_FIELDS == set(field_facts.FIELD_KINDS)


@pytest.mark.parametrize("name, saved, now", [("kl_coef", 0.05, 0.1), ("cliprange", 0.2, 0.3)])
def test_a_resume_with_another_loss_knob_is_refused_naming_it(tmp_path, name, saved, now):
    def settings(value):
        return field_facts.update_settings(PPOConfig(output_dir=str(tmp_path), report_to=[], **{name: value}))

    refused, kept = field_facts.compare_settings(settings(saved), settings(now))
    assert kept == [] and len(refused) == 1
    assert refused[0].startswith(f"{name}: saved {saved}, this run {now}; it sets the ")
