"""PPOTrainer says once, when train() starts, what is on, what is off and why, and where to watch it."""

from __future__ import annotations

import pytest

from tests.ppo.helpers import tiny_trainer

pytestmark = pytest.mark.usefixtures("single_thread", "no_rapidfire_env")


def _table(out: str) -> list[str]:
    lines = out.splitlines()
    start = lines.index("rapidfire PPOTrainer:")
    table = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        table.append(line)
    return table



def _start_inputs(policy, backend: str):
    """What ``start_facts`` reads for the rollout row: the rollout settings at their defaults (``backend`` as
    given), no kernel patches, a plain optimizer, a CUDA device (nothing is allocated there)."""
    from types import SimpleNamespace

    import torch

    args = SimpleNamespace(rollout_decode_mode="auto", rollout_decode_attention="auto", rollout_decode_sampler="torch",
                           rollout_decode_fuse_projections="auto", rollout_decode_linear="torch",
                           rollout_decode_fuse_lora=False, rollout_backend=backend,
                           rollout_kv_cache_dtype="auto")  # fmt: skip
    patches = SimpleNamespace(summary=lambda: {"compiled_layers": {}, "liger": False})
    return args, patches, torch.optim.SGD(policy.parameters(), lr=0.1), torch.device("cuda")

def test_no_config_names_what_it_leaves_off(tmp_path, tokenizer, capsys):
    tiny_trainer(tmp_path, tokenizer, max_steps=1).train()
    table = _table(capsys.readouterr().out)
    assert "  on       rollout: model.generate" in table
    assert "  on       value: separate value model" in table
    assert any(x.startswith("  on       optimizer: AdamW with the finite-step guard") for x in table)
    skipped = [x for x in table if x.startswith("  skipped")]
    assert any(
        "fast rollout engine (the static engine records CUDA graphs; this run is on cpu)" in x
        for x in skipped
    )
    assert any("throughput planner (no rapidfire_config" in x for x in skipped)
    assert any("AdaptivePrecisionPlugin (no rapidfire_config)" in x for x in skipped)
    assert any(x.startswith("  on       MemoryCompactionCallback (") for x in table)


def test_without_memory_management_nothing_writes_telemetry(tmp_path, tokenizer, capsys):
    tiny_trainer(tmp_path, tokenizer, max_steps=1, memory_management=False).train()
    table = _table(capsys.readouterr().out)
    assert "  skipped  MemoryCompactionCallback (memory_management=False)" in table
    assert not any("process registry" in x for x in table)  # the callback is what writes the telemetry


def test_a_preset_lists_its_parts_and_where_the_telemetry_goes(tmp_path, tokenizer, capsys, monkeypatch):
    monkeypatch.setenv("RAPIDFIRE_CACHE_DIR", str(tmp_path / "cache"))
    tiny_trainer(tmp_path, tokenizer, max_steps=1, value_mode="fused", rapidfire_config="balanced").train()
    table = _table(capsys.readouterr().out)
    assert "  on       value: fused head on the policy" in table
    assert any(x.startswith("  on       optimizer: RapidFireOptimizer(") for x in table)
    assert "  on       MemoryCompactionCallback (balanced)" in table
    assert any(x.startswith("  on       throughput planner (memory.optimization=balanced") for x in table)
    assert any(x.startswith("  on       AdaptivePrecisionPlugin (") for x in table)
    assert any(f"process registry {tmp_path / 'cache' / 'procs'}" in x for x in table)


def test_logging_level_warning_keeps_it_quiet(tmp_path, tokenizer, capsys):
    config = {"preset": "balanced", "logging": {"level": "warning"}}
    tiny_trainer(tmp_path, tokenizer, max_steps=1, rapidfire_config=config).train()
    assert "rapidfire PPOTrainer:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("engine", "asked", "runs"),
    [
        ("fsdp2", "auto", "auto"),  # the static engine on the policy gathered once per rollout (on CUDA)
        ("fsdp2", "hf", "hf"),
        ("deepspeed_zero3", "auto", "hf"),  # ZeRO-3: model.generate under the once-per-rollout gather
        ("deepspeed_zero3", "static", "static"),  # asked by name: the engine inside the gather
        ("ddp", "auto", "auto"),
    ],
)
def test_the_rollout_backend_under_each_engine(engine, asked, runs):
    from types import SimpleNamespace

    from rapidfire_hf.distributed import support_for
    from rapidfire_hf.ppo.rollout_phase import rollout_backend

    assert rollout_backend(SimpleNamespace(rollout_backend=asked), support_for(engine, 2)) == runs


def test_the_start_table_names_why_zero3_generates_with_model_generate(tokenizer):


    from rapidfire_hf.demo import build_tiny_llama
    from rapidfire_hf.ppo.recipe.start_report import start_facts
    from rapidfire_hf.ppo.rollout_phase import ZERO3_ROLLOUT

    policy = build_tiny_llama(tokenizer)
    args, patches, opt, cuda = _start_inputs(policy, "auto")
    facts = start_facts(args, None, policy, False, opt, None, None, None, patches, "hf", cuda)
    assert facts.rollout == f"rollout: model.generate ({ZERO3_ROLLOUT})" and "ZeRO-3" in ZERO3_ROLLOUT
    args.rollout_backend = "hf"
    facts = start_facts(args, None, policy, False, opt, None, None, None, patches, "hf", cuda)
    assert facts.rollout == "rollout: model.generate (rollout_backend='hf')"


def test_the_start_table_names_the_engine_path_of_a_zero3_policy_and_its_gather(tokenizer):
    """Under ZeRO-3 the table is printed outside the rollout's gather: it names the path the engine runs inside it
    (native for a Llama), not the partition refusal the engine gives outside it (``choose_decode_path(gathered=)``).
    The partitions are faked as DeepSpeed marks them (``ds_id``, ``ds_status``): DeepSpeed is not needed."""
    from types import SimpleNamespace

    from rapidfire_hf.demo import build_tiny_llama
    from rapidfire_hf.ppo.recipe.start_report import start_facts
    from rapidfire_hf.rollout.engine import choose_decode_path
    from rapidfire_hf.rollout.sharded import ZERO3_PARTITIONED

    policy = build_tiny_llama(tokenizer)
    for i, p in enumerate(policy.parameters()):
        p.ds_id, p.ds_status = i, SimpleNamespace(name="NOT_AVAILABLE")
    assert choose_decode_path(policy) == (None, f"native: {ZERO3_PARTITIONED}; generic: {ZERO3_PARTITIONED}")
    assert choose_decode_path(policy, gathered=True) == ("native", None)
    args, patches, opt, cuda = _start_inputs(policy, "static")
    facts = start_facts(args, None, policy, False, opt, None, None, None, patches, "static", cuda)
    assert facts.rollout == (
        "rollout: static engine (native forward; DeepSpeed ZeRO-3: the policy gathered once per rollout, "
        "partitioned after it), decode_mode=auto"
    )
