"""RapidFireOptimizer under DDP on 2 CPU processes (gloo): equivalence, cross-rank rollback, sync debug.

One torchrun job runs every scenario (process start and imports cost more than the training); the
tests below read what each rank wrote.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.launch import run_ranks

# fp32 (TF32 off on GPUs): DDP's mean over 2 ranks of per-rank means vs one mean over the whole batch
# differ only in summation order (measured on CPU: max |diff| 3e-8 after 5 AdamW steps at lr 1e-2).
ATOL, RTOL = 1e-6, 1e-5
KINDS = ("adamw", "rapidfire", "rapidfire_pipeline")


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def results(request, tmp_path_factory):
    """gloo on 2 CPU processes, or NCCL on 2 GPUs: the same script and the same assertions."""
    out = tmp_path_factory.mktemp(f"ddp_{request.param}")
    run_ranks("optim_ranks.py", out, "--device", request.param)

    def load(name):
        return torch.load(out / f"{name}.pt", weights_only=True)

    return load


@pytest.mark.slow  # 22 s on a 2-core CPU
def test_engine_detected_as_ddp(results):
    assert results("engine") == {"engine": "ddp", "world": 2}


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_equal_one_rank_with_twice_the_batch(results, kind, accum):
    r0, r1 = results(f"equiv_{kind}_acc{accum}_rank0"), results(f"equiv_{kind}_acc{accum}_rank1")
    ref = results(f"equiv_{kind}_acc{accum}_ref")["params"]
    assert torch.equal(r0["params"], r1["params"]), "DDP replicas diverged"
    torch.testing.assert_close(r0["params"], ref, atol=ATOL, rtol=RTOL)
    assert not torch.equal(r0["params"], results(f"equiv_{kind}_acc{1 if accum == 2 else 2}_ref")["params"])
    assert r0["events"] == [] and r0["skipped"] == 0


def test_pipeline_defers_to_step_after_all_reduce(results):
    # per-parameter hooks fire before DDP's bucket is reduced: every window must be stepped in step()
    for accum in (1, 2):
        assert results(f"equiv_rapidfire_pipeline_acc{accum}_rank0")["deferred"] == {"distributed": 5}


@pytest.mark.parametrize("inject", ["grad", "loss", "rule"])
@pytest.mark.parametrize("kind", ["rapidfire", "rapidfire_pipeline"])
def test_unhealthy_step_on_rank1_is_skipped_by_both_ranks(results, kind, inject):
    r0, r1 = results(f"rollback_{kind}_{inject}_rank0"), results(f"rollback_{kind}_{inject}_rank1")
    skipped = results(f"rollback_{kind}_skipped_rank0")["params"]
    reason = {"grad": "finite_grads", "loss": "finite_loss", "rule": "approx_kl"}[inject]
    assert r0["events"] == r1["events"] == [(2, "skip", [reason])]
    assert torch.equal(r0["params"], r1["params"])
    # bit-exact against the same DDP run that never saw the batch
    assert torch.equal(r0["params"], skipped)
    torch.testing.assert_close(r0["params"], results(f"rollback_{kind}_ref")["params"], atol=ATOL, rtol=RTOL)


def test_sync_debug_names_the_desynchronised_parameter(results):
    r0, r1 = results("sync_rank0"), results("sync_rank1")
    assert r0 == r1, "every rank must reach the same verdict"
    assert r0["in_sync"]["mismatches"] == [] and r0["in_sync"]["gradient_sync_diff"] == 0.0
    assert r0["not_due"] is None  # interval 2: step 1 is not checked
    desync = r0["param_desync"]
    assert [(n, k) for n, k, _ in desync["mismatches"]] == [("fc2.weight", "param")]
    assert desync["grad_diff"] == 0.0  # the all-reduce kept gradients equal
    assert desync["param_diff"] > 1e-7


def test_sync_debug_finds_gradients_that_skipped_the_all_reduce(results):
    grad = results("sync_rank0")["grad_desync"]
    names = {n for n, k, _ in grad["mismatches"] if k == "grad"}
    assert names == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"}
    assert grad["gradient_sync_diff"] == grad["grad_diff"] > 1e-3
