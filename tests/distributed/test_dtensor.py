"""FSDP2 hands the optimizer DTensor parameters and gradients. On a one-rank gloo mesh on the CPU
(a subprocess, so that its process group does not leak into other tests): verification reads the
global gradient norm and skips a non-finite step without touching a parameter, the precision plugin's
metric queue takes a DTensor norm, and the precision sensitivity pass declines sharded weights instead
of failing (all three failed enable_rapidfire on 2x H200 under FSDP2). Also: the plugin's per-layer
gradient statistics, gathered from all layers at once, read DTensor gradients."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, socket, torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from rapidfire_hf.optim import RapidFireOptimizer
    from rapidfire_hf.precision.plugin import sharded_parameters_reason

    mesh = init_device_mesh("cpu", (1,))
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])
    torch.manual_seed(0)
    params = [torch.nn.Parameter(shard(torch.randn(4, 3))) for _ in range(3)]
    opt = RapidFireOptimizer(params, lr=1e-2, rollback="auto", max_grad_norm=1.0)
    moved = []
    for i in range(3):
        for p in params:
            p.grad = shard(torch.full((4, 3), 1e-3))
        if i == 1:
            g = torch.full((4, 3), 1e-3)
            g[0, 0] = float("nan")
            params[0].grad = shard(g)
        before = [p.detach().full_tensor().clone() for p in params]
        opt.step()
        opt.zero_grad()
        moved.append([not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params)])
    assert moved == [[True] * 3, [False] * 3, [True] * 3], moved
    assert [(e.kind, e.reasons) for e in opt.events] == [("skip", ["finite_grads"])], opt.events

    from rapidfire_hf.precision.metrics import AsyncMetrics
    queue = AsyncMetrics()  # the precision plugin's metric queue, fed FSDP2's DTensor gradient norm
    queue.submit(1, {"grad_norm": shard(torch.full((2,), 3.0)).norm(), "loss": 1.5})
    ((step, values),) = queue.ready(wait=True)
    assert step == 1 and values["loss"] == 1.5 and abs(values["grad_norm"] - 18 ** 0.5) < 1e-5, values

    from rapidfire_hf.precision.metrics import GradientMonitor
    layers = {"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 2)}  # per-layer statistics of DTensor grads
    for m in layers.values():
        for p in m.parameters():
            p.grad = shard(torch.randn(p.shape))
    stats = {k: float(v) for k, v in GradientMonitor(layers).collect().items()}
    for name, m in layers.items():
        want = sum(p.grad.full_tensor().double().norm() ** 2 for p in m.parameters()) ** 0.5
        assert abs(stats[f"layer:{name}.grad_norm"] - float(want)) < 1e-5 * float(want), (stats, name)
    assert stats["nonfinite_grads"] == 0.0, stats

    model = torch.nn.Linear(3, 4)
    assert sharded_parameters_reason(model) is None
    model.weight = torch.nn.Parameter(shard(torch.randn(4, 3)))
    assert "DTensor" in sharded_parameters_reason(model)
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.slow  # 6 s on a 2-core CPU
def test_dtensor_gradients_are_verified_and_sharded_weights_skip_the_sensitivity_pass():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
