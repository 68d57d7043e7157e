"""The sweep's training forwards are packed to a row limit: the same math, a bounded peak."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.sweep.phases import pack_in_order, train_pack_rows
from tests.sweep.helpers import make_sweep, max_abs_diff

TRIALS = {"a": {"kl_coef": 0.05}, "b": {"kl_coef": 0.2, "learning_rate": 3e-3}, "c": {"seed": 3}}


def test_pack_in_order_keeps_order_and_the_limit():
    groups = pack_in_order([3, 3, 2, 5, 1], lambda n: n, 6)
    assert groups == [[3, 3], [2], [5, 1]]
    assert pack_in_order([9, 1], lambda n: n, 4) == [[9], [1]]  # larger than the limit: alone
    assert pack_in_order([], lambda n: n, 4) == []


def test_default_limit_is_the_planners_merge_and_at_least_one_micro_batch():
    assert train_pack_rows(512, 8) == 32  # 16,384 tokens
    assert train_pack_rows(40_000, 8) == 8  # one micro-batch even when it is longer
    assert train_pack_rows(512, 8, override=4) == 4
    with pytest.raises(ValueError, match=">= 1"):
        train_pack_rows(512, 8, override=0)


def _rows_per_training_forward(sweep) -> list[int]:
    seen, inside = [], []
    decoder = sweep.phases.decoder
    optimize = sweep.phases.optimize

    def counted(*args, **kwargs):  # the PPO epochs' forwards only (not the plan's one-row probe)
        inside.append(True)
        try:
            return optimize(*args, **kwargs)
        finally:
            inside.pop()

    sweep.phases.optimize = counted

    def hook(module, args, kwargs):
        if inside and torch.is_grad_enabled() and module.training:
            seen.append(int(kwargs["input_ids"].shape[0]))

    handle = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle


@pytest.mark.usefixtures("single_thread")
def test_packed_sweep_trains_the_same_trials_with_smaller_forwards(tokenizer, tmp_path):
    results, rows = {}, {}
    micro = 4  # tests/sweep/helpers.COMMON: per_device_train_batch_size
    for limit in (None, micro):
        sweep = make_sweep(tokenizer, tmp_path / str(limit), TRIALS, max_steps=2, train_rows_per_forward=limit)
        seen, handle = _rows_per_training_forward(sweep)
        sweep.train()
        handle.remove()
        rows[limit] = seen
        results[limit] = {name: sweep.adapter_state_dict(name) for name in TRIALS}
    assert max(rows[None]) == micro * len(TRIALS)  # every trial's micro-batch in one forward
    assert max(rows[micro]) == micro and len(rows[micro]) == len(TRIALS) * len(rows[None])
    for name in TRIALS:
        diff = max_abs_diff(results[None][name], results[micro][name])
        # the base is frozen and each trial's loss reads its own rows: on the CPU the packed run is
        # bit-exact (measured 0.0); a GPU may pick other matmul kernels for other row counts
        assert diff == 0.0 if not torch.cuda.is_available() else diff < 1e-5, (name, diff)


def test_a_bad_limit_is_refused_before_anything_loads(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="train_rows_per_forward must be a whole number >= 1"):
        from rapidfire_hf.ppo import PPOConfig
        from rapidfire_hf.sweep import PPOSweep

        PPOSweep(PPOConfig(output_dir=str(tmp_path)), {"a": {}}, None, None, None, train_rows_per_forward=0)


def test_the_yaml_key_is_checked_before_anything_loads_and_reaches_the_sweep(tmp_path):
    from rapidfire_hf.config import ConfigError
    from rapidfire_hf.sweep.spec import build, validate

    doc = {
        "reward_funcs": ["demo"],
        "config": {"output_dir": str(tmp_path), "use_cpu": True, "response_length": 4},
        "trials": {"a": {}, "b": {"kl_coef": 0.2}},
    }
    for bad in (0, "lots", 2.5, True):
        with pytest.raises(ConfigError, match="train_rows_per_forward"):
            validate({**doc, "train_rows_per_forward": bad})
    sweep = build(validate({**doc, "train_rows_per_forward": 4}), progress=False)
    assert sweep.planner.train_rows == 4 and sweep.phases.train_rows == 4
