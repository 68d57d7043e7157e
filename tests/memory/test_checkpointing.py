"""Selective activation checkpointing on a tiny HF Llama: same gradients, and the intended recompute."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rapidfire_hf.memory import apply_selective_checkpointing


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (forward recomputation inside backward included)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(model, ids):
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    with OpCounter() as counter:
        loss.backward()
    return counter.ops


@pytest.fixture()
def ids():
    return torch.randint(4, 40, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("level", ["conservative", "balanced", "aggressive"])
def test_same_gradients_as_no_checkpointing(tiny_policy, ids, level):
    model = copy.deepcopy(tiny_policy)
    applied = apply_selective_checkpointing(model, level)
    assert applied == {"conservative": None, "balanced": "selective", "aggressive": "full"}[level]
    backward_ops(tiny_policy, ids)
    backward_ops(model, ids)
    # fp32 on CPU, the recomputed ops are the same kernels on the same inputs: equal up to rounding
    for (name, p_ref), p in zip(tiny_policy.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_selective_recomputes_elementwise_but_not_matmuls(tiny_policy, ids):
    counts = {}
    for level in ("conservative", "balanced", "aggressive"):
        model = copy.deepcopy(tiny_policy)
        apply_selective_checkpointing(model, level)
        counts[level] = backward_ops(model, ids)
    none, selective, full = counts["conservative"], counts["balanced"], counts["aggressive"]
    matmuls = ("mm", "addmm", "bmm")
    # full checkpointing repeats each layer's forward matmuls in backward; selective reuses them
    assert sum(full[o] for o in matmuls) > sum(none[o] for o in matmuls)
    assert sum(selective[o] for o in matmuls) == sum(none[o] for o in matmuls)

    def attention(ops):
        return sum(n for o, n in ops.items() if o.startswith("_scaled_dot_product") and "backward" not in o)

    assert attention(none) == attention(selective) == 0 and attention(full) > 0
    # ... but both recompute the element-wise work (RMSNorm's rsqrt, SiLU)
    for op in ("rsqrt", "silu"):
        assert selective[op] > none[op] and full[op] > none[op], op


def test_unknown_level_and_unsupported_model():
    with pytest.raises(ValueError, match="memory.optimization='max'"):
        apply_selective_checkpointing(torch.nn.Linear(2, 2), "max")
    with pytest.raises(TypeError, match="needs a transformers PreTrainedModel"):
        apply_selective_checkpointing(torch.nn.Linear(2, 2), "balanced")
