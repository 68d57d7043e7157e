"""Real transformers.Trainer and PEFT LoRA with RapidFireOptimizer, against the plain AdamW."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.optim import RapidFireOptimizer

VOCAB, SEQ = 46, 12


def token_dataset(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, VOCAB, (n, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def trainer_run(tmp_path, make_opt, max_grad_norm: float):
    from transformers import Trainer, TrainingArguments

    model = build_tiny_llama(hidden=32, layers=1, heads=2, kv_heads=1)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 8)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=token_dataset(), optimizers=(opt, sched)).train()
    return model, opt


def test_trainer_matches_plain_adamw(tmp_path):
    """Pipeline on, windows from the Trainer's sync_gradients, clipping done by the optimizer (the
    Trainer's own clipping is off: with the pipeline the gradients are gone when it would run)."""
    ref, _ = trainer_run(
        tmp_path / "ref", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True), 50.0
    )
    model, opt = trainer_run(
        tmp_path / "rf",
        lambda m: RapidFireOptimizer(
            m.parameters(), lr=1e-2, gradient_pipeline=True, max_grad_norm=50.0, rollback="auto"
        ),
        0.0,
    )
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    stats = opt.stats()
    assert stats["steps"] == 4 and stats["skipped"] == 0
    assert stats["pipelined_steps"] == 3  # the first window has no norm history to predict clipping from


def test_peft_lora_parameters():
    peft = pytest.importorskip("peft")

    def run(make_opt):
        model = peft.get_peft_model(
            build_tiny_llama(hidden=32, layers=1, heads=2, kv_heads=1),
            peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        )
        params = [p for p in model.parameters() if p.requires_grad]
        opt = make_opt(params)
        for i in range(6):
            ids = torch.randint(4, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(i))
            loss = model(input_ids=ids, labels=ids).loss
            if isinstance(opt, RapidFireOptimizer):
                opt.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    ref, _ = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
    model, opt = run(lambda ps: RapidFireOptimizer(ps, lr=1e-2, gradient_pipeline=True, rollback="auto"))
    lora = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    assert lora and opt.stats()["pipelined_steps"] == 6
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
    assert not torch.equal(dict(lora)[lora[1][0]], torch.zeros_like(lora[1][1]))  # lora_B moved from 0
