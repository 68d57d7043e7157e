"""``generate_completions`` / ``evaluate``: greedy completions equal plain ``model.generate``, and the
completion table reaches W&B (offline) and TensorBoard."""

from __future__ import annotations

import glob
import json
import os

import torch

from rapidfire_hf.demo import make_prompt_dataset, vowel_reward
from tests.ppo.helpers import tiny_trainer


def _trainer(tmp_path, tok, **kw):
    return tiny_trainer(tmp_path, tok, trainer_kwargs={"eval_dataset": make_prompt_dataset(5, seed=7)}, **kw)


def test_greedy_completions_equal_model_generate(tmp_path, tokenizer, single_thread):
    trainer = _trainer(tmp_path, tokenizer, per_device_eval_batch_size=2)
    rows = trainer.generate_completions(sampling=False)
    assert len(rows) == 5 and rows == trainer.generate_completions(sampling=False)
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    for i, row in enumerate(rows):
        ids = torch.tensor([trainer.eval_dataset[i]["input_ids"]])
        out = policy.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=trainer.args.response_length,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        assert row["model response"] == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        assert row["score"] == vowel_reward([row["model response"]])[0]
    sampled = trainer.generate_completions(sampling=True)
    assert len(sampled) == 2  # one eval batch
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval/objective/scores", "eval/response_length"}
    assert trainer.state.log_history[-1]["eval/objective/scores"] == metrics["eval/objective/scores"]


def test_completion_table_logged_to_wandb_and_tensorboard(tmp_path, tokenizer, monkeypatch, single_thread):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trainer = _trainer(
        tmp_path,
        tokenizer,
        report_to=["wandb", "tensorboard"],
        num_sample_generations=1,
        max_steps=1,
    )
    trainer.train()
    import wandb

    wandb.finish()
    tables = glob.glob(
        str(tmp_path / "wandb" / "*" / "files" / "media" / "table" / "completions_*.table.json")
    )
    assert tables, "no completions table in the offline W&B run"
    with open(tables[0]) as f:
        table = json.load(f)
    assert table["columns"] == ["query", "model response", "score"] and len(table["data"]) == 5

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [
        os.path.dirname(p) for p in glob.glob(str(tmp_path / "**" / "events.out.tfevents*"), recursive=True)
    ]
    texts = []
    for folder in events:
        acc = EventAccumulator(folder, size_guidance={"tensors": 0})
        acc.Reload()
        if "completions/text_summary" in acc.Tags().get("tensors", []):
            texts += acc.Tensors("completions/text_summary")
    assert texts, "no completions text in the TensorBoard events"
    assert b"model response" in texts[0].tensor_proto.string_val[0]
