"""A dropped RapidFireOptimizer frees its state and the parameters (no cycle through C++-held hooks)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"gradient_pipeline": True},
        {"gradient_pipeline": True, "rollback": "auto", "pipeline_bucket_mb": 0},
    ],
)
def test_optimizer_and_parameters_are_freed(kwargs):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, **kwargs)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    refs = [weakref.ref(opt), weakref.ref(model), weakref.ref(model[0].weight)]
    del model, opt
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]
