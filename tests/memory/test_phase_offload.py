"""memory.phase_offload: frozen models' weights leave the device and come back bit for bit as the same
Parameter objects (CPU, ``include_cpu``), copied to the host once; a PPO update with host offload is the
update without it (bit-exact on the CPU, fp32)."""

from __future__ import annotations

import torch

from rapidfire_hf.memory.phase_offload import FrozenWeights, PhaseOffload
from tests.ppo.helpers import ppo_args


def _frozen(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model.requires_grad_(False)
    return model


def test_frozen_weights_round_trip_keeps_parameters_and_values():
    model = _frozen()
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    frozen = FrozenWeights({"reference": model}, include_cpu=True)
    assert frozen.offload() == sum(v.numel() * v.element_size() for v in values)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert frozen.offload() == 0  # already away: a no-op
    frozen.restore()
    frozen.wait("reference")
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    assert frozen.copies_out == len(params)
    frozen.offload()  # frozen: the host copy is current, nothing is copied again
    assert frozen.copies_out == len(params)
    frozen.restore()
    with torch.no_grad():
        params[0].add_(1.0)  # an in-place write: that storage is copied again at the next offload
    frozen.offload()
    assert frozen.copies_out == len(params) + 1
    frozen.restore()
    assert torch.equal(params[0], values[0] + 1.0)


def test_cpu_weights_stay_unless_asked_and_shared_storages_move_once():
    model = _frozen()
    assert FrozenWeights({"reward": model}).offload() == 0  # CPU weights are left alone by default
    twin = torch.nn.Sequential(model[0])  # shares the first layer's storages with the model listed first
    frozen = FrozenWeights({"reference": model, "reward": twin}, include_cpu=True)
    assert frozen.nbytes("reward") == 0 and frozen.nbytes() == frozen.nbytes("reference")
    frozen.offload()
    frozen.restore()
    assert torch.equal(twin[0].weight, model[0].weight)


def test_phase_offload_moves_what_each_phase_does_not_read():
    model = _frozen()
    opt_model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(opt_model.parameters(), lr=1e-2)
    opt_model(torch.randn(2, 4)).sum().backward()
    opt.step()
    off = PhaseOffload.build({"reference": model}, opt, include_cpu=True)
    state = [v for s in opt.state.values() for v in s.values() if v.numel() > 1]

    def away(tensors):
        return all(t.untyped_storage().nbytes() == 0 for t in tensors)

    off.before_generation()
    assert away(model.parameters()) and away(state)
    off.before_scoring()
    off.ready("reference")
    assert not away(model.parameters()) and away(state)
    off.after_scoring()
    off.before_training()
    off.before_step()
    assert away(model.parameters()) and not away(state)
    off.close()
    assert not away(model.parameters()) and not away(state)


def _update(tmp_path, tok, host_offload: str, config):
    from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model, make_prompt_dataset
    from rapidfire_hf.ppo import PPOTrainer

    torch.manual_seed(0)
    args = ppo_args(tmp_path, value_mode="fused", host_offload=host_offload, rapidfire_config=config)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=build_tiny_llama(tok),
        reward_model=build_tiny_value_model(tok, seed=7),
        train_dataset=make_prompt_dataset(16),
    )
    trainer.host_offload_include_cpu = True  # the test hook: CPU weights and state move as if offloaded
    moved = []
    real = PhaseOffload.before_generation

    def spy(self):
        real(self)
        moved.append((self.frozen.away if self.frozen else None, self.state is not None))

    PhaseOffload.before_generation = spy
    try:
        trainer.train()
    finally:
        PhaseOffload.before_generation = real
    return trainer, moved


CONFIG = {"memory": {"prefetch_window": 0}, "gradient": {"pipeline": False}, "precision": {"mode": "static"}}


def test_an_update_with_host_offload_is_the_update_without(tmp_path, tokenizer):
    on, moved = _update(tmp_path / "on", tokenizer, "on", CONFIG)
    off, none = _update(tmp_path / "off", tokenizer, "off", CONFIG)
    assert on.plan.offload_frozen and on.plan.offload_state and not off.plan.offload_frozen
    assert moved == [(True, True), (True, True)] and none == []  # both updates moved both
    assert on.offload.frozen.nbytes("reference") > 0 and on.offload.frozen.nbytes("reward") > 0
    for (name, a), b in zip(on.policy.state_dict().items(), off.policy.state_dict().values()):
        assert torch.equal(a, b), name
    keys = ("loss/policy_avg", "loss/value_avg", "objective/scores", "objective/kl")
    log_on = [h for h in on.state.log_history if "loss/policy_avg" in h]
    log_off = [h for h in off.state.log_history if "loss/policy_avg" in h]
    assert [[h[k] for k in keys] for h in log_on] == [[h[k] for k in keys] for h in log_off]
    # after train() every weight and the state are back on the device (saving, evaluation, user code)
    assert all(p.untyped_storage().nbytes() > 0 for p in on.ref_model.parameters())
    assert all(p.untyped_storage().nbytes() > 0 for p in on.reward_model.parameters())
    assert "offload frozen weights" in on.plan.table() and "your host_offload='on'" in on.plan.table()


def test_auto_moves_nothing_where_everything_fits(tmp_path, tokenizer):
    trainer, moved = _update(tmp_path, tokenizer, "auto", CONFIG)
    assert trainer.plan.offload_frozen is False and trainer.offload is None and moved == []
    assert "changes nothing the update runs" in trainer.plan.reasons["offload_frozen"]
