"""CUDA-only (skipped on CPU): NonFiniteGuard skips a fused AdamW step inside the kernel with no host
sync, and sync_interval spans read their verdict asynchronously; both exact against the inner
optimizer alone skipping the bad batch."""

from __future__ import annotations

import time

import pytest
import torch

from rapidfire_hf.optim import NonFiniteGuard, RapidFireOptimizer
from tests.optim.helpers import make_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
STEPS, K = 12, 5


def cuda_batch(i):
    g = torch.Generator(device="cuda").manual_seed(i)
    return torch.randn(8, 6, device="cuda", generator=g), torch.randn(8, 3, device="cuda", generator=g)


def reference(skipped):
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for i in range(STEPS):
        if i in skipped:
            continue
        x, y = cuda_batch(i)
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def test_guard_skips_in_the_fused_kernel_without_a_host_sync():
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = NonFiniteGuard()
    for i in range(STEPS):
        x, y = cuda_batch(i)
        loss = (model(x) - y).pow(2).mean() * (float("nan") if i == K else 1.0)
        guard.observe_loss(loss)
        loss.backward()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the guarded step raises
        try:
            guard.step(opt, list(model.parameters()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert guard.drain() == 1
    for a, b in zip(model.parameters(), reference({K}).parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("pipeline", [True, False])
def test_span_verdict_read_at_the_next_window_is_exact(pipeline):
    model = make_model().cuda()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=pipeline, sync_interval=4)
    assert opt._async_verify()
    queue, batch_of, poisoned, reports = list(range(STEPS)), {}, set(), []
    while queue:
        b = queue.pop(0)
        batch_of[opt.stats()["steps"]] = b
        x, y = cuda_batch(b)
        loss = (model(x) - y).pow(2).mean()
        if b == K and b not in poisoned:
            poisoned.add(b)
            loss = loss * float("nan")
        opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for report in [opt.last_rollback] + ([opt.verify_now()] if not queue else []):
            if report is not None:
                reports.append(report)
                queue[:0] = [batch_of[s] for s in report.replay]
    assert [r.steps for r in reports] == [[4, 5, 6, 7, 8]]  # the window after the span was discarded too
    for a, b in zip(model.parameters(), reference({K}).parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_host_read_inside_a_span():
    """sync_interval=4 with rollback on: the 2nd-4th steps of a span read nothing on the host (the 4th
    only starts a non-blocking copy); the verdict is consumed by the next span's first step."""
    model = make_model().cuda()
    opt = RapidFireOptimizer(model.parameters(), lr=1e-2, gradient_pipeline=True, sync_interval=4)
    for i in range(8):
        x, y = cuda_batch(i)
        strict = i % 4 != 0
        if strict:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = (model(x) - y).pow(2).mean()
            opt.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.verify_now() is None and opt.stats()["pipelined_steps"] == 8


def test_sync_interval_cost():
    """Measured: seconds per step of a 4096-wide MLP with rollback on, sync_interval 1 against 4."""
    torch.manual_seed(0)
    times = {}
    for interval in (1, 4):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        opt = RapidFireOptimizer(model.parameters(), lr=1e-4, gradient_pipeline=True, sync_interval=interval)
        x = torch.randn(64, 4096, device="cuda")
        for step in range(28):
            if step == 8:
                torch.cuda.synchronize()
                start = time.perf_counter()
            loss = model(x).pow(2).mean()
            opt.observe_loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        opt.verify_now()
        torch.cuda.synchronize()
        times[interval] = (time.perf_counter() - start) / 20
        print(
            f"sync_interval={interval}: {times[interval] * 1e3:.2f} ms/step, {opt.stats()['snapshots']} snapshots"
        )
    assert all(t > 0 for t in times.values())
