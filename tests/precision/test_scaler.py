"""PerGroupGradScaler against torch.amp.GradScaler (one group, bit for bit) and group isolation (two groups)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rapidfire_hf.precision import PerGroupGradScaler


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _train(model, opt, scaler, steps: int, inf_at: set[int], inf_param: nn.Parameter):
    scales, losses = [], []
    for step in range(steps):
        x, y = _data(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in inf_at:
            inf_param.grad.view(-1)[0] = float("inf")  # an overflow in one parameter
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    return scales, losses


def test_single_group_matches_gradscaler_bit_for_bit():
    ref_model = _mlp()
    model = copy.deepcopy(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # growth_interval=3 so the trajectory has growths and back-offs within a few steps
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ours = PerGroupGradScaler(opt, device="cpu", init_scale=2.0**10, growth_interval=3)
    inf_at = {4, 5, 9}
    ref_scales, ref_losses = _train(ref_model, ref_opt, ref, 14, inf_at, ref_model[0].weight)
    scales, losses = _train(model, opt, ours, 14, inf_at, model[0].weight)

    assert scales == ref_scales
    assert losses == ref_losses
    assert len(set(ref_scales)) > 2  # the trajectory really grew and backed off
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], ref_opt.state[q][key])
    assert ours.overflow_counts == [3]
    assert ours.state_dict()["scales"] == [ref.get_scale()]
    assert ours.state_dict()["growth_trackers"] == [ref.state_dict()["_growth_tracker"]]


def test_overflow_in_one_group_leaves_the_other_group_untouched():
    model = _mlp()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
    opt = torch.optim.SGD(groups, lr=0.1)
    scaler = PerGroupGradScaler(opt, device="cpu", init_scale=2.0**8, growth_interval=1)
    before = [p.detach().clone() for p in model.parameters()]

    x, y = _data(0)
    loss = nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    # reference: plain SGD on copies of group 1, with its unscaled gradient (2**-8 is exact)
    alone = [p.detach().clone().requires_grad_(True) for p in model[2].parameters()]
    for a, p in zip(alone, model[2].parameters()):
        a.grad = p.grad / 2.0**8
    torch.optim.SGD(alone, lr=0.1).step()
    model[0].weight.grad[0, 0] = float("nan")
    scaler.step(opt)
    scaler.update()

    first, second = list(model[0].parameters()), list(model[2].parameters())
    assert all(torch.equal(p, b) for p, b in zip(first, before[:2]))  # group 0 not updated
    for p, a in zip(second, alone):
        assert torch.equal(p, a)  # group 1 updated exactly as if it were alone
    assert scaler.get_scales() == [2.0**7, 2.0**9]  # backed off / grown independently
    assert scaler.last_skipped_groups == [0]
    assert scaler.get_scale() == 2.0**7  # the next backward carries the smallest scale

    # GradScaler, by contrast, drops the whole step
    model2 = _mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ref.scale(nn.functional.mse_loss(model2(x), y)).backward()
    model2[0].weight.grad[0, 0] = float("nan")
    ref.step(opt2)
    assert torch.equal(model2[2].weight, before[2])


def test_all_groups_overflow_skips_step_and_state_round_trip():
    model = _mlp()
    opt = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[2].parameters()}])
    scaler = PerGroupGradScaler(opt, device="cpu", init_scale=4.0)
    x, y = _data(0)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    model[0].weight.grad.fill_(float("inf"))
    model[2].weight.grad.fill_(float("inf"))
    assert scaler.step(opt) is None
    assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())
    scaler.update()

    other = PerGroupGradScaler(opt, device="cpu")
    other.load_state_dict(scaler.state_dict())
    assert (
        other.state_dict()
        == scaler.state_dict()
        == {
            "scales": [2.0, 2.0],
            "growth_trackers": [0, 0],
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "overflow_counts": [1, 1],
        }
    )
    with pytest.raises(ValueError, match="parameter groups"):
        PerGroupGradScaler(torch.optim.SGD(model.parameters(), lr=1.0), device="cpu").load_state_dict(
            scaler.state_dict()
        )
