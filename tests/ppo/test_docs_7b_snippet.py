"""docs/ppo.md's "7B on one GPU" code runs as written, on tiny models: every PPOConfig key it sets exists
and reaches the trainer, its optimizer is RapidFireOptimizer over 8-bit AdamW with the pipeline on, and
the trainer trains.
Only the rollout batch and the response length are made small, and ``use_cpu=True`` is added (the names
the snippet uses stay)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rapidfire_hf import PPOConfig, PPOTrainer, RapidFireOptimizer
from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama, make_prompt_dataset
from rapidfire_hf.utils.imports import is_available

DOC = Path(__file__).resolve().parents[2] / "docs" / "ppo.md"


def _snippet() -> str:
    text = DOC.read_text()
    section = text[text.index("## 7B on one GPU") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="bitsandbytes not installed")
def test_the_7b_settings_build_a_trainer(tmp_path, monkeypatch):
    from rapidfire_hf.demo import build_tiny_reward_model

    monkeypatch.chdir(tmp_path)  # output_dir="out/ppo7b" lands here
    code = _snippet()
    assert "batch = 160" in code and "response_length=384" in code
    code = code.replace("batch = 160", "batch = 16").replace("response_length=384", "response_length=4")
    code = code.replace(
        "bf16=True,", "bf16=True, use_cpu=True,"
    )  # transformers wants use_cpu for bf16 on a CPU
    tok = build_char_tokenizer()
    policy, ref = build_tiny_llama(tok), build_tiny_llama(tok)
    ref.load_state_dict(policy.state_dict())
    scope = dict(PPOConfig=PPOConfig, PPOTrainer=PPOTrainer, RapidFireOptimizer=RapidFireOptimizer, tok=tok,
                 policy=policy, ref=ref, reward=build_tiny_reward_model(tok), ds=make_prompt_dataset(32))  # fmt: skip
    exec(compile(code, str(DOC), "exec"), scope)
    trainer = scope["trainer"]
    a = trainer.args
    assert (a.local_rollout_forward_batch_size, a.rollout_generation_batch_size) == (16, 80)
    assert a.value_mode == "fused" and a.local_batch_size == 16 and a.per_device_train_batch_size == 8
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)  # under accelerate's wrapper
    assert isinstance(inner, RapidFireOptimizer) and inner._pipeline is not None  # bound, pipeline on
    assert type(inner.inner).__name__ == "AdamW8bit"
    before = [p.detach().clone() for p in policy.parameters()]
    trainer.train()  # and they train together: 32 prompts, 16 per update, 3 epochs (the default)
    assert trainer.state.global_step == 6
    after = list(policy.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, p) for b, p in zip(before, after))  # 8-bit AdamW stepped the policy
