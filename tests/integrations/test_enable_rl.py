"""GRPOTrainer and RLOOTrainer with enable_rapidfire: the rollout engine generates, the math matches stock.

The rollout engine samples from the same distribution as ``model.generate`` but need not draw the same
tokens for a seed, so the loss curves are compared where the math is the same: the stock trainer is fed
the very completions the engine produced in the rapidfire run (its ``_generate_single_turn`` replays
them, after checking it was asked for the same prompts). From there on, rewards, advantages, losses and
updates are TRL's own code in both runs, with the RapidFireOptimizer (pipeline on) against torch AdamW.

The GRPO loss of an on-policy step is ``-mean(advantage)`` whatever the weights, so parameters, entropy
and (RLOO) KL are compared too: they depend on every update. Tolerances as in test_enable_trainers.py.
"""

from __future__ import annotations

import pytest
import torch
from rf_trainers import PARITY_CONFIG, STEPS, train_log

from rapidfire_hf.integrations import enable_rapidfire

RTOL = 1e-5
# torch AdamW stepped one tensor at a time vs foreach differs in the last bits of sqrt and division; where
# |grad| is near eps (1e-8) — common in GRPO's small policy gradients — m / (sqrt(v) + eps) amplifies that
# to ~3e-6 after 4 steps. 1e-5 is 1% of one step at lr 1e-3.
PARAM_ATOL = 1e-5


def record_generations(trainer) -> list[tuple[list, list]]:
    """Record (prompt_ids, completion_ids) of every generation call of ``trainer``."""
    calls = []
    generate = trainer._generate_single_turn

    def recording(prompt_ids, *args, **kwargs):
        out = generate(prompt_ids, *args, **kwargs)
        completions = out[0] if isinstance(out, tuple) else out
        calls.append(([list(p) for p in prompt_ids], [list(c) for c in completions]))
        return out

    trainer._generate_single_turn = recording
    return calls


def replay_generations(trainer, calls, returns_logprobs: bool) -> None:
    """Make ``trainer`` generate exactly the recorded completions, in order."""
    pending = list(calls)

    def replay(prompt_ids, *args, **kwargs):
        prompts, completions = pending.pop(0)
        assert [list(p) for p in prompt_ids] == prompts, "the stock run was asked for different prompts"
        return (completions, None) if returns_logprobs else completions

    trainer._generate_single_turn = replay


@pytest.mark.slow  # 17 s on a 2-core CPU
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_matches_stock_on_the_same_completions(build, kind):
    rapid = enable_rapidfire(build(kind, max_grad_norm=0.0), config=PARITY_CONFIG, rollout="static")
    patch = rapid._rapidfire.parts["rollout"]
    calls = record_generations(rapid)
    rapid.train()
    assert patch.calls == len(calls) >= 1 and patch.fallbacks == 0
    # each generation ends at the rollout -> train boundary, where the memory part compacts
    assert [c["reason"] for c in rapid._rapidfire.parts["memory"].compactions] == [
        "phase rollout->train"
    ] * len(calls)
    # completions are in TRL's format: ids up to and including the first EOS, at most max_completion_length
    eos = rapid.processing_class.eos_token_id
    for _, completions in calls:
        assert all(1 <= len(c) <= 8 for c in completions)
        assert all(eos not in c[:-1] for c in completions)

    stock = build(kind, max_grad_norm=0.0)
    replay_generations(stock, calls, returns_logprobs=kind == "grpo")
    stock.train()

    stats = rapid.optimizer.optimizer.stats()
    assert stats["steps"] == STEPS and stats["pipelined_steps"] == STEPS and stats["skipped"] == 0
    keys = ["loss", "reward", "entropy"] + (["kl"] if kind == "rloo" else [])
    for key in keys:
        base, ours = train_log(stock, key), train_log(rapid, key)
        assert len(base) == len(ours) == STEPS, key
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(base), rtol=RTOL, atol=1e-7, msg=key)
    # GRPO/RLOO build their inputs inside training_step: throughput comes from TRL's token count
    assert all(t > 0 for t in train_log(rapid, "rapidfire/tokens_per_sec"))
    diffs = [(a - b).abs().max().item() for a, b in zip(stock.model.parameters(), rapid.model.parameters())]
    assert max(diffs) <= PARAM_ATOL


def test_greedy_engine_gives_hf_generate_completions(build):
    """With greedy decoding the engine's completions equal TRL's own generate branch, token for token."""
    trainer = build("grpo", generation_kwargs={"do_sample": False})
    original = trainer._generate_single_turn
    enable_rapidfire(trainer, config=PARITY_CONFIG, rollout="static")
    assert trainer._rapidfire.parts["rollout"].original == original
    prompts = [trainer.processing_class(p)["input_ids"] for p in ["task: ab ->", "task: hello ->", "x"]]
    ours, _ = trainer._generate_single_turn(prompts, None, {}, 1)
    theirs, _ = original(prompts, None, {}, 1)
    assert ours == theirs
    assert trainer._rapidfire.parts["rollout"].calls == 1


def test_unsupported_sampling_falls_back_to_hf(build):
    trainer = enable_rapidfire(
        build("grpo", repetition_penalty=1.3, max_steps=1), config=PARITY_CONFIG, rollout="static"
    )
    assert "rollout" not in trainer._rapidfire.parts
    assert any("repetition_penalty" in s for s in trainer._rapidfire.skipped)
    trainer.train()
    assert train_log(trainer, "reward")


def test_the_grpo_rollout_engine_runs_sdpa_attention(monkeypatch, tokenizer):
    """The engine's "auto" attention (the Triton kernel on a GPU) was measured for PPOTrainer only: TRL's
    trainers keep SDPA, named, until a GRPO benchmark says otherwise."""
    import rapidfire_hf.rollout as rollout
    from rapidfire_hf.integrations.rollout import DECODE_ATTENTION, RolloutPatch

    seen = {}

    class Spy:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

        def chunk_prefill(self, rows):
            return False

    monkeypatch.setattr(rollout, "RolloutEngine", Spy)
    trainer = type("T", (), {})()
    trainer._generate_single_turn = lambda prompt_ids, images=None, multimodal_fields=None: None
    trainer._tokenizer = tokenizer
    trainer.eos_token_ids = [tokenizer.eos_token_id]
    patch = RolloutPatch(trainer)
    patch._engine_for(torch.nn.Linear(2, 2))
    assert DECODE_ATTENTION == "sdpa" and seen["decode_attention"] == "sdpa"
