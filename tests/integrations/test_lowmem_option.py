"""``memory.lowmem``: ``enable_rapidfire(GRPOTrainer(...), config={"memory": {"lowmem": "on"}})``.

Checked on the CPU with real TRL 1.16 GRPO trainers (fp32, tiny Llama): the option validates and says what
it needs (trainer kind, ``max_grad_norm=0.0``, ``optim='adamw_8bit'``) without touching the trainer when it
refuses; with it on, TRL's GRPO loss and every gradient equal stock TRL's without checkpointing; and two
training steps through the library give the same losses and weights as the benchmark's former wiring of the
same mechanisms (``tests/helpers/grpo_wiring.py``, which applies them by hand).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_grpo_lowmem import assert_same, grpo_inputs, loss_and_grads
from test_grpo_lowmem import tiny_grpo as grpo

from rapidfire_hf.config import ConfigError, load_config
from rapidfire_hf.integrations import RapidFireIntegrationError, enable_rapidfire
from rapidfire_hf.integrations.lowmem import LOWMEM_DEFAULTS, lowmem_options
from rapidfire_hf.integrations.parts import find_rapidfire_optimizer
from tests.helpers import grpo_wiring

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
ON = {"memory": {"lowmem": "on"}}


@pytest.fixture(autouse=True)
def restore_process_wide_patches(monkeypatch):
    """memory.lowmem sets TRL's LM-head tile and may wrap bitsandbytes' sync_gpu (both process-wide)."""
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE)
    if HAS_BNB:
        import bitsandbytes as bnb
        import bitsandbytes.optim.optimizer as bnb_optimizer

        monkeypatch.setattr(bnb_optimizer, "sync_gpu", bnb_optimizer.sync_gpu)
        bnb.optim.GlobalOptimManager.get_instance().initialize()  # overrides are kept process-wide
    yield
    if HAS_BNB:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


def explicit_adamw(trainer):
    """Choose the optimizer explicitly: the very AdamW the trainer's own ``optim`` builds."""
    trainer.optimizer_cls_and_kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    return trainer


def test_option_validates_and_lists_its_values():
    assert load_config(None, env=False).memory.lowmem == "off"
    assert load_config(ON, env=False).memory.lowmem == "on"
    assert load_config({"memory": {"lowmem": "on_8bit_embedding"}}, env=False).memory.lowmem.value == (
        "on_8bit_embedding"
    )
    with pytest.raises(ConfigError, match="memory.lowmem") as err:
        load_config({"memory": {"lowmem": "yes"}}, env=False)
    assert "on_8bit_embedding" in str(err.value)
    assert lowmem_options(None) == LOWMEM_DEFAULTS
    assert lowmem_options({"rows": 4})["rows"] == 4
    with pytest.raises(ValueError, match="unknown key 'chunk'"):
        lowmem_options({"chunk": 4})
    with pytest.raises(ValueError, match="int >= 1"):
        lowmem_options({"prefill_rows": 0})


def test_refuses_other_trainers_and_leaves_them_untouched(build, single_thread):
    trainer = build("sft")
    with pytest.raises(RapidFireIntegrationError, match="GRPOTrainer and RLOOTrainer only"):
        enable_rapidfire(trainer, config=ON)
    assert getattr(trainer, "_rapidfire", None) is None
    enable_rapidfire(trainer)  # still a fresh trainer: the plain call works


def test_names_the_two_training_arguments_that_change_the_math(tokenizer, tmp_path, single_thread):
    trainer = grpo(tokenizer, tmp_path, max_grad_norm=1.0, optim="adamw_torch", gradient_checkpointing=True)
    with pytest.raises(RapidFireIntegrationError) as err:
        enable_rapidfire(trainer, config=ON)
    text = str(err.value)
    assert "max_grad_norm=0.0" in text and "optim='adamw_8bit'" in text and "changes the math" in text
    # nothing was changed: no state, no wrapped layer, the user's settings as they were
    assert getattr(trainer, "_rapidfire", None) is None
    assert trainer.args.max_grad_norm == 1.0 and trainer.args.gradient_checkpointing is True
    assert not any(hasattr(m, "_rapidfire_chunked_checkpointing") for m in trainer.model.modules())
    with pytest.raises(ValueError, match="lowmem_options"):
        enable_rapidfire(trainer, lowmem_options={"rows": 2})  # given without the option
    # 'on_8bit_embedding' builds from optim='adamw_8bit': an explicit optimizer is a conflict
    with pytest.raises(RapidFireIntegrationError, match="cannot be combined"):
        enable_rapidfire(
            explicit_adamw(grpo(tokenizer, tmp_path)), config={"memory": {"lowmem": "on_8bit_embedding"}}
        )
    with pytest.raises(RapidFireIntegrationError, match="gradient pipeline"):
        enable_rapidfire(explicit_adamw(grpo(tokenizer, tmp_path)), config={**ON, "gradient_pipeline": False})


def test_loss_and_gradients_equal_stock_trl(tokenizer, tmp_path, single_thread):
    """TRL's own GRPO loss and every parameter gradient, with everything memory.lowmem applies (chunks of 3
    and 5 rows: ragged), against the same trainer without any checkpointing."""
    trainer = explicit_adamw(grpo(tokenizer, tmp_path, gradient_checkpointing=True))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = grpo_inputs(len(tokenizer))
    stock = loss_and_grads(trainer, inputs)
    enable_rapidfire(trainer, config=ON, lowmem_options={"rows": 3, "forward_rows": 5, "lm_head_chunk": 64})
    parts = trainer._rapidfire.parts["lowmem"]
    assert trainer.args.gradient_checkpointing is False  # replaced, said so in `installed`
    assert any("HF gradient checkpointing replaced" in line for line in trainer._rapidfire.installed)
    assert_same(stock, loss_and_grads(trainer, inputs))
    assert parts.offloader.stats.saved == 4  # 3 layers + the final norm
    assert parts.offloader.reuse_host_buffers and parts.options["rows"] == 3
    import trl.trainer.utils as trl_utils

    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 64


def _old_benchmark_wiring(trainer):
    """The mechanisms of memory.lowmem wired in by hand (tests/helpers/grpo_wiring.py), with this test's
    chunk sizes."""
    import trl.trainer.utils as trl_utils

    from rapidfire_hf.memory.chunked_checkpoint import apply_chunked_checkpointing

    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = 64
    offloader = apply_chunked_checkpointing(
        trainer.model, rows=3, forward_rows=5, offload=True, reuse_host_buffers=True
    )
    trainer = enable_rapidfire(
        trainer, config={"memory": {"optimization": "aggressive"}}, optimizer_kwargs={"rollback": "off"}
    )
    times = {}
    assert grpo_wiring.release_rollout_cache_after_each_rollout(
        trainer, prefill_rows=4, clear_workspaces=True, timings=times
    )
    return trainer, offloader, times


def test_two_steps_match_the_benchmarks_former_wiring(tokenizer, tmp_path, single_thread):
    old, old_offloader, old_times = _old_benchmark_wiring(explicit_adamw(grpo(tokenizer, tmp_path)))
    old.train()
    new = explicit_adamw(grpo(tokenizer, tmp_path))
    new = enable_rapidfire(
        new,
        config={"memory": {"optimization": "aggressive", "lowmem": "on"}},
        lowmem_options={"rows": 3, "forward_rows": 5, "prefill_rows": 4, "lm_head_chunk": 64},
    )
    new.train()

    def losses(t):
        return [h["loss"] for h in t.state.log_history if "loss" in h and "train_runtime" not in h]

    assert len(losses(new)) == 2 and losses(new) == losses(old)
    for (name, a), b in zip(old.model.named_parameters(), new.model.parameters()):
        assert torch.equal(a, b), name
    opt = find_rapidfire_optimizer(new.optimizer)
    assert opt.rollback == "off"  # memory.lowmem's default; the old wiring passed it
    assert opt.stats()["pipelined_steps"] == 2 and not opt.stats()["deferred_steps"]
    parts, patch = new._rapidfire.parts["lowmem"], new._rapidfire.parts["rollout"]
    assert parts.offloader.stats.as_dict() == old_offloader.stats.as_dict()
    assert patch.release_after_rollout and len(patch.timings["engine_s"]) == 2 == len(old_times["engine_s"])
    assert patch.timings["prefill_chunked_rollouts"] == old_times["prefill_chunked_rollouts"]
    assert patch.stats()["engine_calls"] == 2
    assert parts.bnb_sync_skipped is False  # torch AdamW: bitsandbytes is left alone
    assert parts.stats()["activation_offload"]["tensors_saved"] == 2 * 4


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
def test_8bit_embedding_mode_trains_with_all_state_in_8_bits(tokenizer, tmp_path, single_thread):
    """'on_8bit_embedding' with optim='adamw_8bit' (bitsandbytes runs on the CPU too): every window stepped in
    backward, the embedding's AdamW state uint8 like the rest, bitsandbytes' default-stream syncs skipped."""
    import bitsandbytes.optim.optimizer as bnb_optimizer

    trainer = grpo(tokenizer, tmp_path, hidden=128, optim="adamw_8bit")  # >= 4096 elements: 8-bit state
    enable_rapidfire(trainer, config={"memory": {"lowmem": "on_8bit_embedding"}})
    parts = trainer._rapidfire.parts["lowmem"]
    assert parts.embedding_8bit["optimizer_cls"] == "bitsandbytes.optim.AdamW8bit"
    assert parts.bnb_sync_skipped and bnb_optimizer.sync_gpu._rapidfire_skips_default_stream
    trainer.train()
    opt = find_rapidfire_optimizer(trainer.optimizer)
    assert opt.stats()["pipelined_steps"] == 2
    emb = trainer.model.get_input_embeddings().weight
    assert opt.state[emb]["state1"].dtype == torch.uint8
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)  # finite
