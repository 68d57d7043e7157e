"""The settings contract (rapidfire_hf.config.contract): every setting has a row, and the rows hold.

The walk: every PPOConfig field, rapidfire config field and RAPIDFIRE_* variable the code reads has a row
for each entry point. The rows hold: every field a row refuses, given a non-default value, makes the real
PPOTrainer / PPOSweep raise a ConfigError naming it before any work; every field a row applies passes.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rapidfire_hf.config import RapidFireConfig
from rapidfire_hf.config.contract import (
    CONFIG_ROWS,
    ENABLE,
    ENTRY_POINTS,
    SWEEP,
    TRAINER,
    env_rows,
)
from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.config.schema import SECTIONS
from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from rapidfire_hf.ppo.field_facts import PPO_ROWS
from rapidfire_hf.ppo.settings_check import (
    check_enable_settings,
    check_sweep_settings,
    check_trainer_settings,
)
from rapidfire_hf.sweep import PPOSweep
from tests.ppo.helpers import ppo_args

SRC = Path(__file__).resolve().parents[2] / "src" / "rapidfire_hf"


# ------------------------------------------------------------------------------------------ the walk
def test_every_ppo_config_field_has_a_row_and_no_row_is_stale():
    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    assert sorted(fields - set(PPO_ROWS)) == [], "PPOConfig fields without a row in PPO_ROWS"
    assert sorted(set(PPO_ROWS) - fields) == [], "rows for fields PPOConfig no longer has"


def test_every_rapidfire_config_field_has_a_row_and_no_row_is_stale():
    keys = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert sorted(keys - set(CONFIG_ROWS)) == []
    assert sorted(set(CONFIG_ROWS) - keys) == []


def test_every_rapidfire_variable_the_code_reads_has_a_row():
    names = set()
    for path in SRC.rglob("*.py"):
        names |= set(re.findall(r"RAPIDFIRE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(encoding="utf-8")))
    rows = env_rows()
    assert names, "the grep found no RAPIDFIRE_ variable: the pattern is broken"
    assert sorted(names - set(rows)) == [], "RAPIDFIRE_* variables read by the code without a row"


def test_the_plugin_only_options_are_the_plugins_options_that_are_not_config_fields():
    from rapidfire_hf.config.contract import PLUGIN_ONLY_OPTIONS
    from rapidfire_hf.precision.options import DEFAULTS

    assert set(PLUGIN_ONLY_OPTIONS) == set(DEFAULTS) - {f.name for f in dataclasses.fields(SECTIONS["precision"])}


@pytest.mark.parametrize("table", ["ppo", "config", "env"])
def test_every_row_names_each_entry_point_with_a_reason_where_not_applied(table):
    rows = {"ppo": PPO_ROWS, "config": CONFIG_ROWS, "env": env_rows()}[table]
    for name, row in rows.items():
        assert set(row) == set(ENTRY_POINTS), name
        for entry, use in row.items():
            assert use.verdict in ("applied", "refused", "n/a"), (name, entry)
            if use.verdict != "applied":
                assert len(use.why) > 15, (name, entry, use.why)


# ------------------------------------------------------------- non-default values through the entry points
SAMPLES = {  # a non-default value for fields whose type alone does not give one
    "lr_scheduler_type": "cosine",
    "optim": "sgd",
    "logging_strategy": "epoch",
    "eval_strategy": "steps",
    "save_strategy": "epoch",
    "hub_strategy": "end",
    "include_num_input_tokens_seen": "all",
    "log_level": "info",
    "log_level_replica": "info",
    "debug": "underflow_overflow",
    "train_sampling_strategy": "sequential",
    "length_column_name": "len",
    "project": "elsewhere",
    "fsdp": "full_shard",
    "ddp_backend": "gloo",
    "dataloader_multiprocessing_context": "spawn",
    "torch_compile_backend": "eager",
    "torch_compile_mode": "default",
    "rollout_backend": "hf",
    "rollout_decode_mode": "eager",
    "rollout_decode_attention": "sdpa",
    "rollout_decode_sampler": "triton",
    "rollout_decode_fuse_projections": True,
    "rollout_decode_linear": "torch",
    "rollout_cache": "keep",
    "rollout_kv_cache_dtype": "int8",
    "host_offload": "on",
    "rollout_generation_batch_size": 4,
    "local_rollout_forward_batch_size": 4,
    "value_mode": "separate",  # the base arguments are fused
    "kl_estimator": "k3",
    "stop_token": None,
    "stop_token_id": 1,
    "ref_model_quantization": "8bit",
    "reward_model_quantization": "8bit",
    "reward_weights": [1.0],
    "report_to": ["tensorboard"],
    "dataset_text_field": "text",
    "max_steps": 3,
    "num_mini_batches": 4,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 4,
    "lr_scheduler_kwargs": {},
    "include_for_metrics": ["inputs"],
    "output_dir": None,  # set per test
    "top_p": 0.5,
    "gamma": 0.9,
    "lam": 0.9,
    "adam_beta1": 0.8,
    "adam_beta2": 0.99,
    "rapidfire_config": "conservative",
    "trackio_static_space_id": "space",
    "accelerator_config": {"split_batches": True},
    "fsdp_config": {"min_num_params": 1},
    "deepspeed": {"train_batch_size": 8},
    "dataloader_pin_memory": None,  # on the CPU both values are defaults (use_cpu turns it off)
    "parallelism_config": None,  # no value of its own: refused rows are checked with the others
}


def sample_value(args: PPOConfig, name: str):
    """A value of field ``name`` other than its current one, valid for the field's own checks."""
    if name in SAMPLES:
        return SAMPLES[name]
    value = getattr(args, name)
    f = next(f for f in dataclasses.fields(PPOConfig) if f.name == name)
    if isinstance(f.default, bool):  # against the declared default (use_cpu turns dataloader_pin_memory off)
        return not f.default
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1 if value >= 0 else 2
    if isinstance(value, float):
        return value + 0.5 if value else 0.5
    hint = str(f.type)
    if value is None and "bool" in hint:
        return True
    if value is None and "int" in hint:
        return 2
    if value is None and "float" in hint:
        return 0.5
    if value is None and "dict" in hint:
        return {"x": 1}
    if value is None and "list" in hint:
        return ["x"]
    return "x"


def _rows(entry: str, verdict: str) -> list[str]:
    return [n for n, row in PPO_ROWS.items() if row[entry].verdict == verdict and SAMPLES.get(n, 0) is not None]


def _set(args: PPOConfig, name: str) -> PPOConfig:
    setattr(args, name, sample_value(args, name))  # set after construction: the entry point must see it
    return args


@pytest.fixture(scope="module")
def model():
    from rapidfire_hf.demo import build_char_tokenizer

    return build_tiny_llama(build_char_tokenizer())


def base_args(entry: str, tmp_path) -> PPOConfig:
    """What each entry point's own tests build with (the sweep's: no sample tables, no tqdm setting)."""
    if entry == TRAINER:
        return ppo_args(tmp_path, value_mode="fused")
    from tests.sweep.helpers import COMMON

    return PPOConfig(output_dir=str(tmp_path), value_mode="fused", **COMMON)


def refused_keys(err: ConfigError) -> set:
    return {e.key for e in getattr(err, "errors", [err])}


def _trainer(args, tokenizer, model):
    return PPOTrainer(args=args, processing_class=tokenizer, model=model, reward_funcs=vowel_reward,
                      train_dataset=make_prompt_dataset(16))  # fmt: skip


def _sweep(args, tokenizer, model):
    from peft import LoraConfig

    return PPOSweep(args=args, trials={"a": {}}, model=model, processing_class=tokenizer,
                    train_dataset=make_prompt_dataset(16), reward_funcs=vowel_reward,
                    peft_config=LoraConfig(r=2, target_modules=["q_proj"]), progress=False)  # fmt: skip


ENTRY = {TRAINER: _trainer, SWEEP: _sweep}


@pytest.mark.parametrize(
    ("entry", "name"), [(e, n) for e in (TRAINER, SWEEP) for n in _rows(e, "refused")]
)
def test_a_refused_field_is_refused_by_name_by_the_entry_point(entry, name, tmp_path, tokenizer, model):
    args = _set(base_args(entry, tmp_path), name)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as info:
        ENTRY[entry](args, tokenizer, model)
    assert refused_keys(info.value) == {name}, str(info.value)
    assert all((a == b.detach()).all() for a, b in zip(before, model.parameters()))  # before any work


@pytest.mark.parametrize(
    ("entry", "name"), [(e, n) for e in (TRAINER, SWEEP) for n in _rows(e, "applied") + _rows(e, "n/a")]
)
def test_an_applied_field_passes_the_entry_points_check(entry, name, tmp_path, monkeypatch):
    if name in ("bf16", "fp16") and entry == SWEEP:
        pytest.skip("refused on the CPU only: test_sweep_bf16_on_the_cpu_is_refused")
    args = _set(base_args(entry, tmp_path), name)
    if name == "stop_token":
        args.stop_token_id = 1
    if name == "stop_token_id":
        args.stop_token = None
    check = check_trainer_settings if entry == TRAINER else check_sweep_settings
    check(args)


def test_the_enable_column_of_ppo_config_is_the_trainers():
    """enable_rapidfire receives a PPOConfig only inside a PPOTrainer, which applied or refused it."""
    assert {n for n, row in PPO_ROWS.items() if row[ENABLE].verdict != "n/a"} == {"rapidfire_config"}


# ------------------------------------------------------------- rapidfire config fields through the entry points
CONFIG_SAMPLES = {
    "gradient.pipeline": False,
    "gradient.pipeline_depth": 8,
    "gradient.overlap_factor": 0.25,
    "gradient.sync_interval": 4,
    "gradient.bucket_mb": 64.0,
    "gradient.clip_prediction": "scale",
    "gradient.clip_tolerance": 0.1,
    "memory.optimization": "aggressive",
    "memory.checkpointing": "off",
    "memory.planner": False,
    "memory.compaction_threshold": 0.5,
    "memory.release_after_rollout": "always",
    "memory.prefetch_window": 1,
    "memory.lowmem": "on",
    "precision.mode": "static",
    "precision.initial": "fp32",
    "precision.fallback": [],
    "logging.level": "debug",
    "logging.log_every": 2,
    "logging.report_to": ["tensorboard"],
    "logging.wandb_project": "p",
    "logging.telemetry_dir": "tele",
}


def test_config_samples_cover_every_field_with_non_default_values():
    default = RapidFireConfig().to_dict()
    assert set(CONFIG_SAMPLES) == set(CONFIG_ROWS)
    for key, value in CONFIG_SAMPLES.items():
        section, name = key.split(".")
        assert default[section][name] != value, key


def _config(key):
    section, name = key.split(".")
    return {section: {name: CONFIG_SAMPLES[key]}}


@pytest.mark.parametrize(
    ("entry", "key"),
    [(e, k) for e in (TRAINER, SWEEP) for k, row in CONFIG_ROWS.items() if row[e].verdict == "refused"],
)
def test_a_refused_config_field_is_refused_by_name(entry, key, tmp_path, tokenizer, model):
    args = dataclasses.replace(base_args(entry, tmp_path), rapidfire_config=_config(key))
    with pytest.raises(ConfigError) as info:
        ENTRY[entry](args, tokenizer, model)
    assert refused_keys(info.value) == {key}, str(info.value)


@pytest.mark.parametrize(
    ("entry", "key"),
    [(e, k) for e in (TRAINER, SWEEP) for k, row in CONFIG_ROWS.items() if row[e].verdict == "applied"],
)
def test_an_applied_config_field_passes(entry, key, tmp_path):
    bf16 = key == "precision.initial" and CONFIG_SAMPLES[key] == "bf16"
    args = dataclasses.replace(base_args(entry, tmp_path), rapidfire_config=_config(key), bf16=bf16)
    (check_trainer_settings if entry == TRAINER else check_sweep_settings)(args)


@pytest.mark.parametrize("key", [k for k, row in CONFIG_ROWS.items() if row[ENABLE].verdict == "refused"])
def test_enable_rapidfire_refuses_its_refused_config_fields(key):
    with pytest.raises(ConfigError) as info:
        check_enable_settings(_config(key), None)
    assert info.value.key == key


def test_checking_settings_leaves_the_distributed_state_as_configured(tmp_path):
    # a state configured before the trainer (here a CPU group told it is multi-GPU, as benchmarks/distributed's
    # FSDP2 smoke does) must survive the check, which builds a default PPOConfig for its reference values
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    from rapidfire_hf.config import contract
    from rapidfire_hf.ppo import PPOConfig

    args = PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, dataloader_pin_memory=False)
    contract._REFERENCE.clear()  # the reference is built once per class: make this check build it
    state = PartialState(cpu=True)
    before = state.distributed_type
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        contract.ppo_refusals(args, contract.TRAINER)
        assert contract._REFERENCE  # the reference config was built by this call
        assert PartialState().distributed_type == DistributedType.MULTI_GPU
    finally:
        PartialState._shared_state["distributed_type"] = before
