"""PPOStats (``ppo/types.py``): the one statistics type of PPOTrainer's and every sweep trial's PPO epochs."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.ppo.core import LossOutput
from rapidfire_hf.ppo.types import PPOStats


def test_record_writes_each_statistic_at_its_forward_and_names_read_the_fields():
    stats = PPOStats.zeros((2, 1, 3), torch.device("cpu"))
    values = dict(
        loss=1.0, pg_loss=2.0, vf_loss=3.0, pg_clipfrac=4.0, vf_clipfrac=5.0, approx_kl=6.0, ratio_mean=7.0
    )
    out = LossOutput(**{k: torch.tensor(v, requires_grad=k == "loss") for k, v in values.items()})
    stats.record((1, 0, 2), out, torch.tensor(8.0))
    expected = dict(
        approx_kl=6.0, pg_clipfrac=4.0, pg_loss=2.0, vf_loss=3.0, vf_clipfrac=5.0, entropy=8.0, ratio=7.0
    )
    for name, value in expected.items():
        tensor = getattr(stats, name)
        assert stats[name] is tensor and tensor.shape == (2, 1, 3) and not tensor.requires_grad
        assert tensor[1, 0, 2].item() == value and tensor.sum().item() == value  # nowhere else
    with pytest.raises(KeyError, match="'loss': PPOStats has approx_kl"):
        stats["loss"]
