"""Selective activation checkpointing on a tiny HF Llama: same gradients, less activation memory per
level, the intended recompute, and ``auto``'s choice."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rapidfire_hf.memory import activation_bytes, apply_selective_checkpointing, auto_checkpointing
from rapidfire_hf.memory.checkpointing import (
    RECOMPUTE_BELOW,
    USER_CHECKPOINTING,
    choose_level,
    configure_checkpointing,
    recompute_flops_per_byte,
)

LEVELS = ("conservative", "balanced", "aggressive")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny model is faster that way on the shared cores."""


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


def checkpointed(model, level):
    model = copy.deepcopy(model)
    apply_selective_checkpointing(model, level)
    return model.train()


@pytest.mark.parametrize("level", LEVELS)
def test_same_gradients_as_no_checkpointing(tiny_policy, ids, level):
    model = checkpointed(tiny_policy, level)
    backward_ops(tiny_policy, ids)
    backward_ops(model, ids)
    # fp32 on CPU: the recompute runs the same kernels on the same inputs, so the gradients are bit-exact
    for (name, p_ref), p in zip(tiny_policy.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, p_ref.grad), name


def test_activation_bytes_drop_per_level(tiny_policy, ids):
    held = {}
    for level in LEVELS:
        model = checkpointed(tiny_policy, level)
        held[level] = activation_bytes(lambda m=model: m(input_ids=ids).logits)
    assert held["conservative"] > held["balanced"] > held["aggressive"] > 0, held
    # what saved_tensors_hooks sees agrees where it can see: outside checkpointed regions only
    seen = {}
    for level in LEVELS:
        model, total = checkpointed(tiny_policy, level), [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids)
        seen[level] = total[0]
    assert seen["conservative"] > seen["balanced"]


def test_balanced_recomputes_elementwise_and_aggressive_also_matmuls(tiny_policy, ids):
    counts = {level: backward_ops(checkpointed(tiny_policy, level), ids) for level in LEVELS}
    none, balanced, aggressive = (counts[lv] for lv in LEVELS)
    matmuls = ("mm", "addmm", "bmm")
    # the tiny model's matmuls contract over 64-256 (<= 256 FLOPs/byte in fp32): aggressive recomputes them
    assert sum(aggressive[o] for o in matmuls) > sum(none[o] for o in matmuls)
    assert sum(balanced[o] for o in matmuls) == sum(none[o] for o in matmuls)

    def attention(ops):
        return sum(n for o, n in ops.items() if o.startswith("_scaled_dot_product") and "backward" not in o)

    assert attention(none) == attention(balanced) == 0 and attention(aggressive) > 0
    for op in ("rsqrt", "silu"):  # both recompute the element-wise work (RMSNorm's rsqrt, SiLU)
        assert balanced[op] > none[op] and aggressive[op] > none[op], op


def test_recompute_cost_per_byte():
    aten = torch.ops.aten
    a32, b32 = torch.empty(8, 2048), torch.empty(2048, 16)
    assert recompute_flops_per_byte(aten.mm.default, (a32, b32)) == 2 * 2048 / 4
    a16 = a32.bfloat16()
    assert recompute_flops_per_byte(aten.addmm.default, (torch.empty(16).bfloat16(), a16, b32)) == 2048
    q, k = torch.empty(1, 4, 8, 64), torch.empty(1, 4, 512, 64)
    assert (
        recompute_flops_per_byte(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, k)) == 512
    )
    assert recompute_flops_per_byte(aten.mul.Tensor, (a32, a32)) == 0.25
    # 1.1B Llama in bf16: q/k/v/o/gate/up (K=2048) recomputed under aggressive, down (K=5632) kept
    assert 2 * 2048 / 2 < RECOMPUTE_BELOW["aggressive"] <= 2 * 5632 / 2
    assert 2 * 32 / 4 >= RECOMPUTE_BELOW["balanced"] > 1.0


def test_choose_level_takes_least_recompute_that_fits():
    per_row = {"conservative": 300, "balanced": 200, "aggressive": 100}  # x 4 rows x TRAIN_PEAK_FACTOR 1.1
    assert choose_level(per_row, rows=4, budget=1320) == "conservative"
    assert choose_level(per_row, rows=4, budget=1319) == "balanced"
    assert choose_level(per_row, rows=4, budget=440) == "aggressive"
    assert choose_level(per_row, rows=4, budget=10) == "aggressive"  # nothing fits: the most recompute
    assert choose_level(per_row, rows=4, budget=10, allowed=("conservative",)) == "conservative"


@pytest.mark.slow  # 5 s on a 2-core CPU
def test_auto_measures_and_applies(tiny_policy, ids):
    model = copy.deepcopy(tiny_policy).train()

    def probe():
        return model(input_ids=ids[:1]).logits

    level, measured = auto_checkpointing([model], probe, rows=2, device="cpu", free_bytes=1 << 40)
    assert level == "conservative" and not model.model.layers[0].gradient_checkpointing
    assert measured["conservative"] > measured["balanced"] > measured["aggressive"]
    # balanced's target is 85% of the memory: fits balanced for 2 rows (x 1.3 peak factor), not conservative
    budget = int(2 * 1.3 * measured["balanced"] / 0.85) + 64
    level, _ = auto_checkpointing([model], probe, rows=2, device="cpu", free_bytes=budget)
    assert level == "balanced" and model.model.layers[0].gradient_checkpointing
    assert activation_bytes(probe) == measured["balanced"]


def test_user_gradient_checkpointing_is_kept(tiny_policy):
    from types import SimpleNamespace

    model = copy.deepcopy(tiny_policy)
    model.gradient_checkpointing_enable()
    layer = model.model.layers[0]
    before = layer._gradient_checkpointing_func
    args = SimpleNamespace(gradient_checkpointing=True)
    assert configure_checkpointing([model], "aggressive", args) == USER_CHECKPOINTING
    assert layer._gradient_checkpointing_func is before
    assert configure_checkpointing([model], "auto", SimpleNamespace(gradient_checkpointing=False)) == "auto"


def test_unknown_level_and_unsupported_model():
    with pytest.raises(ValueError, match="memory.optimization='max'"):
        apply_selective_checkpointing(torch.nn.Linear(2, 2), "max")
    with pytest.raises(TypeError, match="needs a transformers PreTrainedModel"):
        apply_selective_checkpointing(torch.nn.Linear(2, 2), "balanced")


def test_auto_falls_back_to_no_recompute_when_it_cannot_measure(tiny_policy):
    model = copy.deepcopy(tiny_policy).train()

    def probe():
        raise RuntimeError("no measuring here")

    level, measured = auto_checkpointing([model], probe, rows=2, device="cpu", free_bytes=1 << 40)
    assert level == "conservative" and measured == {}  # unknown: pay nothing, as stock would
    assert not model.model.layers[0].gradient_checkpointing
