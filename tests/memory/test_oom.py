"""OOM recovery: a micro-batch that raises torch.OutOfMemoryError is split and retried with the same result.

Each result is compared with the same run without the OOM (same gradients, loss, optimizer steps and
parameters, to fp32 summation-order tolerance).

The OOM source is simulated (CPU has no allocator limit): the step raises a real ``torch.OutOfMemoryError``
when its chunk is larger than a limit, either before backward or from a gradient hook in the middle of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import BatchEncoding

from rapidfire_hf.memory import OOMRecovery, OOMRecoveryError, TelemetryWriter, split_batch

# fp32 on CPU: the halves sum their gradients in another order than the whole batch does
ATOL, RTOL = 1e-6, 1e-5


def lm_step(model, limit):
    def step(chunk, weight):
        if chunk["input_ids"].shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (simulated: {chunk['input_ids'].shape[0]} > {limit})"
            )
        loss = model(**chunk).loss  # mean over the chunk's tokens; all rows have the same length
        (loss * weight).backward()
        return loss

    return step


def batch(n=8, length=10, seed=0):
    ids = torch.randint(4, 40, (n, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def test_split_gives_same_gradients_loss_and_update_as_no_oom(tiny_policy):
    reference, model = tiny_policy, copy.deepcopy(tiny_policy)
    # SGD: the update is linear in the gradient, so the tolerance carries over (Adam divides tiny
    # gradients by their own magnitude and turns 1e-9 noise into a full step)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recover = OOMRecovery(max_splits=3, params=model.parameters())

    for seed in (0, 1):  # the second batch is split up front, with no new OOM
        b = batch(seed=seed)
        ref_loss = lm_step(reference, limit=8)(b, 1.0)
        loss = recover(lm_step(model, limit=2), b)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)
        for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=ATOL, rtol=RTOL, msg=name)
        opt_ref.step(), opt.step(), opt_ref.zero_grad(), opt.zero_grad()
        for p_ref, p in zip(reference.parameters(), model.parameters()):
            torch.testing.assert_close(p, p_ref, atol=ATOL, rtol=RTOL)
    assert [(e["depth"], e["chunk_size"]) for e in recover.events] == [(1, 8), (2, 4)]
    assert recover.splits == 2


def test_gives_up_after_max_splits_with_a_clear_message(tiny_policy, tmp_path):
    telemetry = TelemetryWriter(tmp_path, register=False)
    recover = OOMRecovery(max_splits=2, params=tiny_policy.parameters(), telemetry=telemetry)
    with pytest.raises(
        OOMRecoveryError, match=r"chunk of 2 sample\(s\) after splitting the micro-batch 2 time"
    ):
        recover(lm_step(tiny_policy, limit=1), batch())
    assert all(p.grad is None for p in tiny_policy.parameters())
    path = telemetry.open()
    telemetry.close()
    assert path.read_text().count('"oom_split"') == 2


class MLP(torch.nn.Module):
    def __init__(self, limit):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.limit = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3), limit

    def forward(self, x):
        h = self.l1(x)
        if h.requires_grad and x.shape[0] > self.limit:

            def fail(grad):  # raised after l2's gradients were accumulated
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, in backward)")

            h.register_hook(fail)
        return self.l2(torch.relu(h))


def mlp_step(model):
    def step(chunk, weight):
        loss = model(chunk).pow(2).mean()
        (loss * weight).backward()
        return loss

    return step


def test_oom_in_backward_drops_the_partial_gradients_it_created():
    reference, model = MLP(limit=100), MLP(limit=4)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    mlp_step(reference)(x, 1.0)
    OOMRecovery(params=model.parameters())(mlp_step(model), x)
    for p_ref, p in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=ATOL, rtol=RTOL)


def test_oom_in_backward_into_existing_gradients_is_refused():
    model = MLP(limit=4)
    recover = OOMRecovery(params=model.parameters())
    recover(mlp_step(model), torch.randn(2, 6))  # first micro-batch of the accumulation window: fine
    with pytest.raises(OOMRecoveryError, match="added into existing .grad"):
        recover(mlp_step(model), torch.randn(8, 6))


def test_split_batch_keeps_type_and_shared_values():
    enc = BatchEncoding(
        {
            "input_ids": torch.arange(10).view(5, 2),
            "texts": list("abcde"),
            "scale": 2.0,
            "num_items_in_batch": torch.tensor(7),
        }
    )
    first, second = split_batch(enc)
    assert isinstance(first, BatchEncoding)
    assert first["input_ids"].tolist() == [[0, 1], [2, 3], [4, 5]] and second["texts"] == ["d", "e"]
    assert first["scale"] == second["scale"] == 2.0
    assert first["num_items_in_batch"] is second["num_items_in_batch"]  # 0-d: given to both halves
    assert [t.tolist() for t in split_batch(torch.arange(4))] == [[0, 1], [2, 3]]


# ---- gradient accumulation windows and the gradient pipeline -------------------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _accumulated_run(oom_rows=None, hold=True, pipeline=True, windows=2, accumulation=2):
    """``windows`` accumulation windows of ``accumulation`` micro-batches of 8 rows through accelerate, a
    RapidFireOptimizer and OOMRecovery; micro-batches above ``oom_rows`` rows run out of memory."""
    from accelerate import Accelerator

    from rapidfire_hf.memory import accelerate_hold
    from rapidfire_hf.optim import RapidFireOptimizer
    from tests.helpers.faults_train import oom_above_rows

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = _mlp()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline)
    oom = oom_above_rows(model[0], oom_rows, grad=True) if oom_rows is not None else None
    recover = OOMRecovery(
        params=model.parameters(),
        optimizer=opt,
        hold=(lambda: accelerate_hold(acc, model)) if hold else None,
    )
    data = torch.randn(windows * accumulation, 8, 6, generator=torch.Generator().manual_seed(2))
    for x in data:
        with acc.accumulate(model):
            recover(mlp_step(model), x)
            if acc.sync_gradients:
                opt.step()
                opt.zero_grad()
    acc.gradient_state._set_sync_gradients(True)  # leave accelerate's shared state as a fresh one has it
    return model, opt, oom


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline-on", "pipeline-off"])
def test_split_in_accumulation_windows_steps_once_per_window(pipeline):
    """Every micro-batch OOMs and is split: the pieces but the last do not close the window, so the
    pipeline steps each parameter once per window, on the whole window's gradient."""
    reference, ref_opt, _ = _accumulated_run(pipeline=pipeline)
    model, opt, oom = _accumulated_run(oom_rows=4, pipeline=pipeline)
    assert oom.raised == 1  # the first micro-batch; the later ones are split up front
    assert opt.stats()["steps"] == ref_opt.stats()["steps"] == 2
    # each parameter stepped by the inner AdamW once per window
    assert {int(st["step"]) for st in opt.inner.state.values()} == {2}
    assert opt.stats()["pipelined_steps"] == ref_opt.stats()["pipelined_steps"]
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, p_ref, atol=ATOL, rtol=RTOL)


def test_oom_in_a_pipelined_closing_backward_is_refused():
    """With one micro-batch per window every backward closes it and the pipeline's hooks step during it:
    an OOM in that backward after gradients were created cannot be retried exactly."""
    from rapidfire_hf.optim import RapidFireOptimizer

    model = MLP(limit=4)
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True)
    recover = OOMRecovery(params=model.parameters(), optimizer=opt)
    with pytest.raises(OOMRecoveryError, match="gradient pipeline"):
        recover(mlp_step(model), torch.randn(8, 6))


def test_a_pipeline_counting_backwards_itself_is_refused():
    from rapidfire_hf.optim import RapidFireOptimizer
    from tests.helpers.faults_train import oom_above_rows

    model = _mlp()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, accumulation_steps=2)
    oom_above_rows(model[0], 4, grad=True)
    recover = OOMRecovery(params=model.parameters(), optimizer=opt)
    with pytest.raises(OOMRecoveryError, match="accumulation_steps"):
        recover(mlp_step(model), torch.randn(8, 6))


def test_default_message_names_only_what_the_caller_controls(tiny_policy):
    recover = OOMRecovery(max_splits=0, params=tiny_policy.parameters(), advice="Lower rows_per_chunk.")
    with pytest.raises(OOMRecoveryError, match="Lower rows_per_chunk") as err:
        recover(lm_step(tiny_policy, limit=1), batch())
    assert "memory.optimization" not in str(err.value)


def test_unit_weight_weighs_every_piece_one():
    """``unit_weight``: the step normalises each piece by the whole micro-batch itself (PPO's training chunks,
    whose OOM splits are exact: tests/ppo/test_oom_recovery.py)."""
    from rapidfire_hf.memory.oom import unit_weight

    assert unit_weight({"x": [1]}, 8) == 1.0 and unit_weight(None, 1) == 1.0
