"""CUDA-only checks (skipped on CPU): fused AdamW, bitsandbytes 8-bit inner, no host sync in the step."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.optim import RapidFireOptimizer
from rapidfire_hf.utils.imports import is_available
from tests.optim.helpers import make_model

pytestmark = pytest.mark.gpu


def cuda_run(make_opt, steps=10, observe=False):
    model = make_model().cuda()
    opt = make_opt(model.parameters())
    for i in range(steps):
        g = torch.Generator(device="cuda").manual_seed(i)
        x, y = torch.randn(8, 6, device="cuda", generator=g), torch.randn(8, 3, device="cuda", generator=g)
        loss = (model(x) - y).pow(2).mean()
        if observe:
            opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
@pytest.mark.parametrize("bucket_mb", [0, 1e-3, 64], ids=["per-param", "small", "one-bucket"])
def test_fused_adamw_pipeline_matches_fused_adamw(bucket_mb, overlap):
    ref, _ = cuda_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))
    model, opt = cuda_run(
        lambda ps: RapidFireOptimizer(
            ps, lr=1e-2, gradient_pipeline=True, pipeline_bucket_mb=bucket_mb, pipeline_overlap=overlap
        )
    )
    assert opt.defaults["fused"] is True
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same fused kernel, a bucket at a time


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
@pytest.mark.parametrize("bucket_mb", [0, 64], ids=["per-param", "one-bucket"])
def test_no_host_sync_in_pipelined_step(bucket_mb, overlap):
    model, opt = cuda_run(
        lambda ps: RapidFireOptimizer(
            ps,
            lr=1e-2,
            gradient_pipeline=True,
            pipeline_bucket_mb=bucket_mb,
            pipeline_overlap=overlap,
            rollback="off",  # nothing verified: no read at all (sync_interval spans: test_gpu_guard_spans)
        ),
        steps=2,
    )
    x = torch.randn(8, 6, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.stats()["pipelined_steps"] == 3


@pytest.mark.skipif(not is_available("bitsandbytes"), reason="bitsandbytes not installed")
@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_bitsandbytes_inner_matches_standalone(name):
    import bitsandbytes as bnb

    cls = {"adamw8bit": bnb.optim.AdamW8bit, "paged_adamw8bit": bnb.optim.PagedAdamW8bit}[name]
    ref, _ = cuda_run(lambda ps: cls(ps, lr=1e-2, min_8bit_size=0))
    model, _ = cuda_run(
        lambda ps: RapidFireOptimizer(ps, optimizer=name, lr=1e-2, min_8bit_size=0, gradient_pipeline=True)
    )
    for a, b in zip(model.parameters(), ref.parameters()):
        # bitsandbytes steps each tensor separately as well; a small tolerance covers its blockwise
        # quantisation should the kernel choose a different block path for a lone tensor
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_overlap_on_a_wide_model_matches_one_stream():
    """The side stream under real contention: a deep, wide MLP whose backward keeps the GPU busy while
    buckets step, 20 steps in fp32 with small buckets: bit-identical to the single-stream pipeline and
    to fused AdamW alone (a missing wait would read a gradient before it is complete or a weight after
    it was updated)."""

    def run(make_opt):
        torch.manual_seed(0)
        layers = []
        for _ in range(12):
            layers += [torch.nn.Linear(2048, 2048), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers).cuda()
        opt = make_opt(model.parameters())
        for i in range(20):
            g = torch.Generator(device="cuda").manual_seed(i)
            x = torch.randn(256, 2048, device="cuda", generator=g)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return [p.detach().clone() for p in model.parameters()]

    ref = run(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    for overlap, depth in ((False, None), (True, None), (True, 2)):
        got = run(
            lambda ps, o=overlap, d=depth: RapidFireOptimizer(
                ps,
                lr=1e-3,
                gradient_pipeline=True,
                pipeline_bucket_mb=8,
                pipeline_overlap=o,
                side_stream_depth=d,
            )
        )
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def run_with_nan_at(make_opt, k: int, steps: int, skip_k: bool, inject: bool):
    """``steps`` CUDA steps of a small model; batch ``k`` left out (``skip_k``) or its loss made NaN."""
    model = make_model().cuda()
    opt = make_opt(model.parameters())
    for i in range(steps):
        if skip_k and i == k:
            continue
        g = torch.Generator(device="cuda").manual_seed(i)
        x, y = torch.randn(8, 6, device="cuda", generator=g), torch.randn(8, 3, device="cuda", generator=g)
        loss = (model(x) - y).pow(2).mean()
        if inject and i == k:
            loss = loss * float("nan")
        if isinstance(opt, RapidFireOptimizer):
            opt.observe_loss(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("overlap", [False, True], ids=["one-stream", "overlap"])
@pytest.mark.parametrize("where", ["device", "host"])
def test_rollback_on_cuda_is_exact(where, overlap):
    """A NaN step on CUDA (host snapshot: pinned memory on a side stream) equals a run without it."""
    ref, _ = run_with_nan_at(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), 5, 10, True, False)
    model, opt = run_with_nan_at(
        lambda ps: RapidFireOptimizer(
            ps, lr=1e-2, gradient_pipeline=True, rollback="auto", snapshot=where, pipeline_overlap=overlap
        ),
        5,
        10,
        False,
        True,
    )
    assert [e.kind for e in opt.events] == ["rollback"]
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("share", [0.6, 1e-12], ids=["fits", "does-not-fit"])
def test_auto_snapshot_on_cuda(monkeypatch, share):
    """snapshot='auto': a snapshot that fits stays on the device (rollback from it); one that does not
    (the share made tiny) turns the pipeline off, and the NaN step is skipped before it is applied.
    Either way the run equals fused AdamW that never saw the bad batch."""
    from rapidfire_hf.optim import verification

    monkeypatch.setattr(verification, "SNAPSHOT_DEVICE_SHARE", share)
    ref, _ = run_with_nan_at(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), 4, 8, True, False)
    model, opt = run_with_nan_at(
        lambda ps: RapidFireOptimizer(ps, lr=1e-2, gradient_pipeline=True, rollback="auto"), 4, 8, False, True
    )
    stats = opt.stats()
    if share == 0.6:
        assert [e.kind for e in opt.events] == ["rollback"] and stats["pipeline_enabled"]
        assert stats["snapshot_bytes"] > 0 and stats["snapshot_fallbacks"] == 0
    else:
        assert [e.kind for e in opt.events] == ["snapshot_auto_pipeline_off", "skip"]
        assert (
            not stats["pipeline_enabled"]
            and stats["snapshot_bytes"] == 0
            and stats["snapshot_fallbacks"] == 1
        )
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
