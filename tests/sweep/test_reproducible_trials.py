"""A trial of a sweep is the run PPOTrainer makes alone with the trial's settings and seed (issue 28 item 3).

Three runs per trial: ``PPOTrainer`` alone, a one-trial sweep, and the trial inside a three-trial sweep whose
trials differ in KL coefficient, learning rate, seed, PPO epochs and micro-batch. Nothing is copied from
one run to another: each draws its LoRA adapter, value head, prompt order, epoch permutations and sampling
noise from the seed by the one rule of ``rapidfire_hf.ppo.seeds``. Tolerance: bit-exact (0) on CPU fp32 for
every per-update metric the three share and for the final adapter and value-head weights.

The rollout batches are 8 rows per trial (a CPU GEMM over fewer than 8 rows may round one ulp differently
inside a larger batch; ``test_independence.py`` holds 2-row trials to 1e-5). PPOTrainer pads a batch to its
longest prompt and a sweep to the dataset's longest (so that a trial's tensors do not depend on its
neighbours); with prompts of one length the two are the same. With prompts of mixed lengths the wider
padding changes the rounding only (``test_mixed_prompt_lengths_round_differently``: measured up to 1.2e-7 on
the metrics (val/ratio), 7.5e-9 on the weights after 3 updates; held to 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.demo import build_tiny_llama, build_tiny_reward_model, make_prompt_dataset, vowel_reward
from rapidfire_hf.ppo import PPOConfig, PPOTrainer

from .helpers import COMMON, lora_config, make_sweep

# differ in a reward-side, an optimizer-side and a schedule-side setting, and in the seed
TRIALS = {
    "kl0.01": {"kl_coef": 0.01},
    "kl0.2-lr3-seed5": {"kl_coef": 0.2, "learning_rate": 3e-3, "seed": 5},
    "epochs1-micro2-seed7": {
        "num_ppo_epochs": 1,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "cliprange": 0.1,
        "seed": 7,
    },
}
# what a sweep logs of PPOTrainer's metrics, less wall-clock ones
_TIMED = ("time/", "tokens_per_second", "eps")


def _dataset(**kw):
    return make_prompt_dataset(48, min_len=4, max_len=4, **kw)


def _trainer(tokenizer, out_dir, overrides, reward_model=None):
    args = PPOConfig(
        output_dir=str(out_dir),
        value_mode="fused",
        rollout_backend="static",  # the sweep's batched decode (PPOTrainer's "auto" is model.generate on CPU)
        memory_management=False,
        disable_tqdm=True,
        **{**COMMON, **overrides},
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=build_tiny_llama(tokenizer),
        peft_config=lora_config(),
        reward_funcs=None if reward_model is not None else vowel_reward,
        reward_model=reward_model,
        train_dataset=_dataset(),
    )
    trainer.train()
    return trainer


def _metrics(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith(_TIMED)} for h in history]


def _weights_of_trainer(trainer) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    adapter = get_peft_model_state_dict(trainer.policy)
    out = {k.replace(".default", ""): v for k, v in adapter.items()}
    head = trainer.accelerator.unwrap_model(trainer.model).value_head
    out.update({f"value_head.{k}": v for k, v in head.state_dict().items()})
    return out


def _weights_of_trial(sweep, name) -> dict[str, torch.Tensor]:
    out = dict(sweep.adapter_state_dict(name))
    out.update({f"value_head.{k}": v for k, v in sweep.trials[name].value_head.state_dict().items()})
    return out


def assert_same_run(trainer, sweep, name: str, what: str) -> None:
    """The trial's per-update metrics (the keys both log) and final weights equal the trainer's, bit for bit."""
    ours, theirs = _metrics(sweep.trials[name].state.log_history), _metrics(trainer.state.log_history)
    assert len(ours) == len(theirs) == COMMON["max_steps"], what
    for step, (a, b) in enumerate(zip(ours, theirs)):
        shared = sorted(set(a) & set(b))
        assert "objective/scores" in shared and "loss/value_avg" in shared
        differ = {k: (a[k], b[k]) for k in shared if a[k] != b[k]}
        assert not differ, f"{what}, update {step + 1}: {differ}"
    w_sweep, w_trainer = _weights_of_trial(sweep, name), _weights_of_trainer(trainer)
    assert w_sweep.keys() == w_trainer.keys()
    differ = [k for k in w_sweep if not torch.equal(w_sweep[k], w_trainer[k])]
    assert not differ, f"{what}: final weights differ in {differ[:3]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three-trial sweep and, per trial, PPOTrainer alone and a one-trial sweep."""
    from rapidfire_hf.demo import build_char_tokenizer

    torch.set_num_threads(1)  # as the single_thread fixture: reductions in one fixed order
    tok = build_char_tokenizer()
    root = tmp_path_factory.mktemp("reproducible")
    together = make_sweep(tok, root / "together", TRIALS, dataset=_dataset())
    together.train()
    alone = {}
    for name, overrides in TRIALS.items():
        sweep = make_sweep(tok, root / f"sweep-{name}", {name: overrides}, dataset=_dataset())
        sweep.train()
        alone[name] = (_trainer(tok, root / f"trainer-{name}", overrides), sweep)
    return together, alone


@pytest.mark.parametrize("name", list(TRIALS))
def test_trainer_equals_one_trial_sweep(runs, name):
    _, alone = runs
    trainer, sweep = alone[name]
    assert_same_run(trainer, sweep, name, f"{name}: PPOTrainer vs one-trial sweep")


@pytest.mark.parametrize("name", list(TRIALS))
def test_trainer_equals_the_trial_in_a_three_trial_sweep(runs, name):
    together, alone = runs
    trainer, _ = alone[name]
    assert_same_run(trainer, together, name, f"{name}: PPOTrainer vs the trial among three")


def test_the_trials_differ(runs):
    together, _ = runs
    scores = {tuple(h["objective/kl"] for h in t.state.log_history) for t in together.trials.values()}
    assert len(scores) == len(TRIALS)


def test_shared_reward_model(tokenizer, tmp_path, single_thread):
    """The other scoring mode: a reward model shared by the trials, scored in packs."""
    name, overrides = "kl0.2-lr3-seed5", TRIALS["kl0.2-lr3-seed5"]
    sweep = make_sweep(
        tokenizer, tmp_path / "sweep", TRIALS, dataset=_dataset(),
        reward_model=build_tiny_reward_model(tokenizer), local_rollout_forward_batch_size=6,
    )  # fmt: skip
    sweep.train()
    trainer = _trainer(
        tokenizer, tmp_path / "trainer", {**overrides, "local_rollout_forward_batch_size": 6},
        reward_model=build_tiny_reward_model(tokenizer),
    )  # fmt: skip
    assert_same_run(trainer, sweep, name, "reward model")


def test_mixed_prompt_lengths_round_differently(tokenizer, tmp_path, single_thread):
    """Prompts of 3-6 letters: the sweep pads every batch to the dataset's longest prompt, PPOTrainer to the
    batch's; the same tokens are sampled and the numbers differ by float rounding only."""
    name, overrides = "kl0.01", TRIALS["kl0.01"]
    mixed = make_prompt_dataset(48, min_len=3, max_len=6)
    sweep = make_sweep(tokenizer, tmp_path / "sweep", {name: overrides}, dataset=mixed)
    sweep.train()
    args = PPOConfig(
        output_dir=str(tmp_path / "trainer"), value_mode="fused", rollout_backend="static",
        memory_management=False, disable_tqdm=True, **{**COMMON, **overrides},
    )  # fmt: skip
    trainer = PPOTrainer(
        args=args, processing_class=tokenizer, model=build_tiny_llama(tokenizer), peft_config=lora_config(),
        reward_funcs=vowel_reward, train_dataset=mixed,
    )  # fmt: skip
    trainer.train()
    ours, theirs = _metrics(sweep.trials[name].state.log_history), _metrics(trainer.state.log_history)
    assert len(ours) == len(theirs) == COMMON["max_steps"]
    for a, b in zip(ours, theirs):
        assert a["objective/scores"] == b["objective/scores"]  # the same sampled tokens
        for key in sorted(set(a) & set(b)):
            assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), key
    w_sweep, w_trainer = _weights_of_trial(sweep, name), _weights_of_trainer(trainer)
    assert max(float((w_sweep[k] - w_trainer[k]).abs().max()) for k in w_sweep) < 1e-6
