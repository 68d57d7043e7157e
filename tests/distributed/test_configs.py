"""The accelerate configs load with accelerate's own launcher code and give the engines they promise.

What accelerate would export to the training processes is computed with its launch helpers, then
the FSDP plugin is built from that environment exactly as ``Accelerator()`` builds it. DeepSpeed
itself is not installed on CPU machines, so its plugin is checked at the config level only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIGS = Path(__file__).parents[2] / "accelerate_configs"
EXPECTED = {
    "single_gpu": ("NO", 1),
    "multi_gpu": ("MULTI_GPU", 2),
    "deepspeed_zero2": ("DEEPSPEED", 2),
    "deepspeed_zero3": ("DEEPSPEED", 2),
    "fsdp2": ("FSDP", 2),
}


def _launch_args(name: str):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "train.py"])
    return _validate_launch_command(args)[0]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_and_says_when_to_use_it(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = CONFIGS / f"{name}.yaml"
    config = load_config_from_file(str(path))
    kind, processes = EXPECTED[name]
    assert config.distributed_type.value == kind and config.num_processes == processes
    assert config.mixed_precision == "bf16"
    assert path.read_text().startswith("# ") and "Use " in path.read_text().split("\ncompute_environment")[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_export_their_zero_stage(stage):
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = _launch_args(f"deepspeed_zero{stage}")
    args.deepspeed_fields_from_accelerate_config = ""  # set by launch_command before it calls the helper
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_fsdp2_config_builds_a_version_2_plugin(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    env = prepare_multi_gpu_env(_launch_args("fsdp2"))
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
