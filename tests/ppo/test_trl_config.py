"""PPOConfig as TRL users write it: TRL 1.12's extra fields, uneven micro-batches, the pre-1.0 names,
chat-formatted prompts and ``dataset_num_proc``."""

from __future__ import annotations

import os

import pytest
import torch

from rapidfire_hf.config.errors import ConfigErrors
from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama, build_tiny_value_model, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer
from rapidfire_hf.ppo.data import prepare_prompt_dataset
from tests.ppo.helpers import ppo_args

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"


def test_trl_script_fields(tmp_path):
    args = PPOConfig(
        output_dir=str(tmp_path),
        sft_model_path="/models/sft",
        reward_model_path="/models/rm",
        dataset_num_proc=2,
    )
    assert (args.sft_model_path, args.reward_model_path, args.dataset_num_proc) == (
        "/models/sft",
        "/models/rm",
        2,
    )
    assert (
        args.run_name.startswith("ppo__42__")
        and args.logging_steps == 1
        and args.num_sample_generations == 10
    )
    assert PPOConfig(output_dir=str(tmp_path), exp_name="mine", seed=3).run_name.startswith("mine__3__")


def test_old_trl_names_are_mapped_with_warnings(tmp_path):
    with pytest.warns(FutureWarning) as record:
        args = PPOConfig(
            output_dir=str(tmp_path), model_name="gpt2", batch_size=16, mini_batch_size=4,
            gradient_accumulation_steps=2, ppo_epochs=2, init_kl_coef=0.2,
        )  # fmt: skip
    messages = " ".join(str(w.message) for w in record)
    assert (
        "use sft_model_path=" in messages and "use num_ppo_epochs=" in messages and "use kl_coef=" in messages
    )
    assert (args.sft_model_path, args.num_ppo_epochs, args.kl_coef) == ("gpt2", 2, 0.2)
    # 16 prompts per rollout, 4 rows per backward, 2 backwards per optimizer step: 2 steps per epoch
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches) == (
        4,
        4,
        2,
    )
    assert args.micro_batches_per_step == 2
    with pytest.raises(TypeError, match="adaptive KL"):
        PPOConfig(output_dir=str(tmp_path), adap_kl_ctrl=True)


def test_uneven_micro_batches_train_one_step_per_mini_batch(tmp_path, tokenizer, single_thread):
    """TRL's own uneven case: rollout 12 = micro 4 x 3, two mini-batches of 6 -> micro-batches 4 and 2."""
    args = ppo_args(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_mini_batches=2,
                    num_ppo_epochs=1, max_steps=1)  # fmt: skip
    policy = build_tiny_llama(tokenizer)
    rows = []
    policy.model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]) if torch.is_grad_enabled() else None,
        with_kwargs=True,
    )
    from rapidfire_hf.demo import make_prompt_dataset

    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=policy, value_model=build_tiny_value_model(tokenizer),
        reward_funcs=vowel_reward, train_dataset=make_prompt_dataset(24),
    )  # fmt: skip
    trainer.train()
    assert rows == [4, 2, 4, 2]  # training forwards (policy under grad): two mini-batches
    state = trainer.optimizer.optimizer.state
    assert {int(s["step"]) for s in state.values()} == {2}  # one optimizer step per mini-batch


def test_chat_prompts_use_the_chat_template(tmp_path):
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    messages = [[{"role": "user", "content": "abc"}], [{"role": "user", "content": "de"}]]
    ds = prepare_prompt_dataset([{"prompt": m} for m in messages], tok)
    for row, m in zip(ds, messages):
        expected = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert row["input_ids"] == list(expected)
        assert tok.decode(row["input_ids"]).endswith("a:")
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat_template"):
        prepare_prompt_dataset([{"prompt": m} for m in messages], tok)


class _PidTokenizer:
    """Wraps a tokenizer and records the id of every process that tokenizes."""

    def __init__(self, tok, folder):
        self.tok, self.folder = tok, folder

    def __call__(self, *a, **kw):
        open(os.path.join(self.folder, str(os.getpid())), "w").close()
        return self.tok(*a, **kw)


def test_dataset_num_proc_tokenizes_in_several_processes(tmp_path):
    tok = build_char_tokenizer()
    prompts = [{"prompt": "abc" * (i % 3 + 1)} for i in range(8)]
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir()
    multi.mkdir()
    one = prepare_prompt_dataset(prompts, _PidTokenizer(tok, str(single)))
    two = prepare_prompt_dataset(prompts, _PidTokenizer(tok, str(multi)), num_proc=2)
    assert one["input_ids"] == two["input_ids"]
    assert os.listdir(single) == [str(os.getpid())]
    assert len(os.listdir(multi)) == 2 and str(os.getpid()) not in os.listdir(multi)


@pytest.mark.parametrize(
    "argv,expected",
    [([], "auto"), (["true"], True), (["False"], False), (["auto"], "auto")],
)
def test_fuse_projections_from_a_command_line(tmp_path, argv, expected):
    """A TRL script's command line gives text: "auto" stays, "true" / "false" become booleans, anything else
    is refused naming the field."""
    from transformers import HfArgumentParser

    flag = ["--rollout_decode_fuse_projections", *argv] if argv else []
    parser = HfArgumentParser(PPOConfig)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *flag]
    )
    assert args.rollout_decode_fuse_projections == expected and type(
        args.rollout_decode_fuse_projections
    ) is type(expected)
    with pytest.raises(ConfigErrors, match="rollout_decode_fuse_projections='maybe'"):
        parser.parse_args_into_dataclasses(
            [
                "--output_dir",
                str(tmp_path),
                "--report_to",
                "none",
                "--rollout_decode_fuse_projections",
                "maybe",
            ]
        )
