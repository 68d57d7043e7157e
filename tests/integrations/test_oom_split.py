"""enable_rapidfire's OOM split in training_step: an OOM in a micro-batch's forward gives the same run.

The OOM is a real ``torch.OutOfMemoryError`` raised by a forward pre-hook on the model's decoder
(``tests/helpers/faults_train.py``) at one chosen gradient-tracking forward; the reference is the same
``enable_rapidfire`` trainer without the injection. fp32 (``bf16=False``: under the builders' default bf16
autocast the halves' gradients differ from the whole's at bf16 rounding, 2e-3 relative, measured) and SGD
(AdamW's first steps move every element by about lr whatever its gradient's size, so rounding noise in a
near-zero gradient becomes a step of +-lr): the halves sum their gradients in another order than the whole
micro-batch, and that is all that differs.
"""

from __future__ import annotations

import pytest
import torch
from rf_trainers import PARITY_CONFIG, STEPS, train_log

from rapidfire_hf.integrations import enable_rapidfire
from rapidfire_hf.memory import OOMRecoveryError
from rapidfire_hf.ppo.modeling import causal_lm_parts
from tests.helpers.faults_train import oom_above_rows, oom_on_calls

PARAM_ATOL = 1e-6
LOSS_RTOL = 1e-5


def _train(build, kind, inject=None, **overrides):
    trainer = enable_rapidfire(build(kind, **overrides), config=PARITY_CONFIG)
    oom = inject(causal_lm_parts(trainer.model)[0]) if inject is not None else None
    trainer.train()
    return trainer, oom


@pytest.mark.slow  # 8 s on a 2-core CPU
@pytest.mark.parametrize("call", [2, 1], ids=["closing-micro-batch", "first-micro-batch"])
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_oom_split_gives_the_same_steps_and_weights(build, kind, call):
    """Accumulation 2, pipeline on, no clipping: the window's micro-batch ``call`` runs out of memory."""
    kw = dict(max_grad_norm=0.0, gradient_accumulation_steps=2, optim="sgd", learning_rate=0.1, bf16=False)
    reference, _ = _train(build, kind, **kw)
    trainer, oom = _train(build, kind, inject=lambda m: oom_on_calls(m, [call], grad=True), **kw)
    assert oom.raised == 1
    opt, ref_opt = trainer.optimizer.optimizer, reference.optimizer.optimizer
    assert opt.stats()["steps"] == ref_opt.stats()["steps"] == STEPS
    assert opt.stats()["pipelined_steps"] == ref_opt.stats()["pipelined_steps"] == STEPS
    torch.testing.assert_close(
        torch.tensor(train_log(trainer)),
        torch.tensor(train_log(reference)),
        rtol=LOSS_RTOL,
        atol=1e-7,  # GRPO's first loss is ~1e-9 (on-policy, zero-mean advantages): an absolute floor
    )
    for a, b in zip(reference.model.parameters(), trainer.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=PARAM_ATOL)


def test_gives_up_naming_the_settings_that_act(build):
    with pytest.raises(
        OOMRecoveryError, match=r"chunk of 1 sample\(s\) after splitting the micro-batch 2 time"
    ) as err:
        _train(build, "sft", inject=lambda m: oom_above_rows(m, 0, grad=True), max_grad_norm=0.0)
    message = str(err.value)
    assert "per_device_train_batch_size" in message and "gradient_checkpointing" in message
    assert "memory.optimization" not in message


def test_class_keeps_its_name_and_stock_behaviour(build):
    trainer = enable_rapidfire(build("sft"), config=PARITY_CONFIG)
    assert type(trainer).__name__ == "SFTTrainer"
    assert any("OOM split" in line for line in trainer._rapidfire.installed)


def test_pairs_stay_whole_when_a_preference_batch_is_split():
    from rapidfire_hf.integrations.oom import split_pairs

    ids = torch.arange(6)[:, None]  # rows: chosen 0,1,2; rejected 3,4,5
    batch = {"input_ids": ids, "ref_chosen_logps": torch.tensor([0.0, 1.0, 2.0]), "beta": 0.1}
    first, second = split_pairs(batch)
    assert first["input_ids"].flatten().tolist() == [0, 1, 3, 4]
    assert second["input_ids"].flatten().tolist() == [2, 5]
    assert first["ref_chosen_logps"].tolist() == [0.0, 1.0] and second["ref_chosen_logps"].tolist() == [2.0]
    assert first["beta"] == second["beta"] == 0.1


def test_rollout_engine_generation_oom_halves_the_prompts_and_gives_the_same_completions(build, caplog):
    """GRPO with the rollout engine: greedy generation of 3 prompts runs out of memory above 1 row; the
    retry in halves gives the completions of the run without the OOM, token for token."""
    trainer = enable_rapidfire(
        build("grpo", generation_kwargs={"do_sample": False}), config=PARITY_CONFIG, rollout="hf"
    )  # the hf backend runs the decoder's forward, where the OOM is injected
    prompts = [trainer.processing_class(p)["input_ids"] for p in ["task: ab ->", "task: hello ->", "x"]]
    reference, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    oom = oom_above_rows(causal_lm_parts(trainer.model)[0], 1, grad=False)
    with caplog.at_level("WARNING", logger="rapidfire_hf.memory.oom"):
        recovered, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    oom.remove()
    assert oom.raised == 2  # 3 rows, then 2 rows
    assert sum("OOM in generation" in r.getMessage() for r in caplog.records) == 2
    assert recovered == reference


def _plain_trainer(tokenizer, tmp_path, cls):
    """A ``transformers.Trainer`` (or a subclass of it that overrides nothing) on the tiny Llama."""
    from datasets import Dataset
    from rf_trainers import common_args
    from transformers import DataCollatorForLanguageModeling, TrainingArguments

    from rapidfire_hf.demo import build_tiny_llama

    texts = [f"task: {w} -> {w[::-1]}" for w in ("abc", "defg", "hij", "klmno", "pqr", "stuv", "wxy", "zab")]
    ds = Dataset.from_dict(dict(tokenizer(texts * 4, truncation=True, max_length=16)))
    args = TrainingArguments(
        **common_args(
            tmp_path,
            per_device_train_batch_size=4,
            max_grad_norm=0.0,
            optim="sgd",
            learning_rate=0.1,
            bf16=False,
        )
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return cls(model=build_tiny_llama(tokenizer), args=args, train_dataset=ds, data_collator=collator)


@pytest.mark.slow  # two trainings per case, about 25 s on a 2-core CPU
@pytest.mark.parametrize("subclass", [False, True], ids=["Trainer", "subclass-without-training_step"])
def test_plain_trainer_gets_the_split(tokenizer, tmp_path, subclass):
    """``enable_rapidfire`` on ``transformers.Trainer`` itself (whose class the OOM split cannot follow in
    its MRO) and on a subclass that does not override ``training_step`` (whose step the loss observer
    wraps before the split's class exists): the injected OOM is split and the run matches the reference."""
    from transformers import Trainer

    cls = type("PlainSubclass", (Trainer,), {}) if subclass else Trainer

    def run(inject):
        trainer = enable_rapidfire(_plain_trainer(tokenizer, tmp_path, cls), config=PARITY_CONFIG)
        oom = oom_on_calls(causal_lm_parts(trainer.model)[0], [1], grad=True) if inject else None
        trainer.train()
        return trainer, oom

    reference, _ = run(False)
    trainer, oom = run(True)
    assert type(trainer).__name__ == cls.__name__
    assert oom.raised == 1 and trainer.optimizer.optimizer.stats()["steps"] == STEPS
    for a, b in zip(reference.model.parameters(), trainer.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=PARAM_ATOL)
