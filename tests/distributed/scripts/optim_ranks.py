"""Run under ``torchrun --nproc_per_node 2`` (gloo on CPU, NCCL on GPUs): DDP equivalence, cross-rank
rollback and sync-debug scenarios. Every rank writes ``<scenario>_rank<r>.pt`` into the output
directory; rank 0 also writes the single-process references. ``test_ddp.py`` compares them.

Usage: ``torchrun --nproc_per_node 2 optim_ranks.py OUT_DIR [--device cuda]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

from rapidfire_hf.distributed import SyncChecker, check_sync, describe_engine
from rapidfire_hf.optim import RapidFireOptimizer

B, STEPS, BAD_STEP = 4, 5, 2  # per-rank micro-batch, optimizer steps, the step made unhealthy


class TinyNet(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(device) -> TinyNet:
    torch.manual_seed(0)
    return TinyNet().to(device)


def make_optimizer(kind: str, params, accum: int | None = None):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    pipeline = kind == "rapidfire_pipeline"
    # max_grad_norm large enough never to bind, so that both paths compute the same update
    return RapidFireOptimizer(
        params,
        lr=1e-2,
        gradient_pipeline=pipeline,
        rollback="auto",
        max_grad_norm=100.0 if pipeline else None,
        accumulation_steps=accum,
    )


def global_data(world: int, accum: int, device):
    """[STEPS, world * accum * B, 16] inputs and targets; row block (r, j) is rank r's micro-step j."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, world * accum * B, 16, generator=g)
    y = torch.randn(STEPS, world * accum * B, 4, generator=g)
    return x.to(device), y.to(device)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def local_rows(t: torch.Tensor, rank: int, micro: int, accum: int) -> torch.Tensor:
    start = (rank * accum + micro) * B
    return t[start : start + B]


def train_ddp(acc: Accelerator, kind: str, accum: int, inject: str | None = None, skip: bool = False):
    """DDP training; ``inject`` spoils step BAD_STEP on rank 1 only; ``skip`` leaves that batch out."""
    acc.step = 0  # accelerate counts micro-steps across models: restart the window phase
    model = make_model(acc.device)
    opt = make_optimizer(kind, model.parameters())
    if kind != "adamw" and inject == "rule":
        opt.add_rule("approx_kl", lambda m: m["approx_kl"] < 1.0)
    model, opt = acc.prepare(model, opt)
    x, y = global_data(acc.num_processes, accum, acc.device)
    rank = acc.process_index
    for step in range(STEPS):
        if skip and step == BAD_STEP:
            continue
        for micro in range(accum):
            with acc.accumulate(model):
                out = model(local_rows(x[step], rank, micro, accum))
                loss = nn.functional.mse_loss(out, local_rows(y[step], rank, micro, accum))
                spoiled = step == BAD_STEP and rank == 1
                inner = opt.optimizer
                if kind != "adamw":
                    # the health rules see a bad value on rank 1 only; gradients stay finite there
                    bad_loss = spoiled and inject == "loss"
                    inner.observe_loss(loss.detach() * float("nan") if bad_loss else loss.detach())
                    if inject == "rule":
                        inner.record("approx_kl", torch.tensor(5.0 if spoiled else 0.01, device=acc.device))
                if spoiled and inject == "grad":
                    loss = loss * float("nan")
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    inner = opt.optimizer
    events = [(e.step, e.kind, list(e.reasons)) for e in getattr(inner, "events", [])]
    stats = inner.stats() if hasattr(inner, "stats") else {}
    return model, {
        "params": flat(model),
        "events": events,
        "deferred": stats.get("deferred_steps", {}),
        "skipped": stats.get("skipped", 0),
    }


def train_reference(kind: str, world: int, accum: int, device, skip: bool = False) -> torch.Tensor:
    """One process, no DDP: the whole ``world * accum * B`` batch per step."""
    model = make_model(device)
    opt = make_optimizer(kind, model.parameters(), accum=1)
    x, y = global_data(world, accum, device)
    for step in range(STEPS):
        if skip and step == BAD_STEP:
            continue
        loss = nn.functional.mse_loss(model(x[step]), y[step])
        if kind != "adamw":
            opt.observe_loss(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


def equivalence(acc: Accelerator, out: Path):
    for accum in (1, 2):
        acc.gradient_accumulation_steps = accum
        for kind in ("adamw", "rapidfire", "rapidfire_pipeline"):
            _, result = train_ddp(acc, kind, accum)
            torch.save(result, out / f"equiv_{kind}_acc{accum}_rank{acc.process_index}.pt")
            # every rank runs the reference: RapidFireOptimizer all-reduces its verdict whenever a
            # process group exists, so a rank-0-only run would wait forever for rank 1
            ref = train_reference(kind, acc.num_processes, accum, acc.device)
            if acc.is_main_process:
                torch.save({"params": ref}, out / f"equiv_{kind}_acc{accum}_ref.pt")
    acc.gradient_accumulation_steps = 1


def rollback(acc: Accelerator, out: Path):
    for kind in ("rapidfire", "rapidfire_pipeline"):
        _, clean = train_ddp(acc, kind, 1, skip=True)
        torch.save(clean, out / f"rollback_{kind}_skipped_rank{acc.process_index}.pt")
        for inject in ("grad", "loss", "rule"):
            _, result = train_ddp(acc, kind, 1, inject=inject)
            torch.save(result, out / f"rollback_{kind}_{inject}_rank{acc.process_index}.pt")
        ref = train_reference(kind, acc.num_processes, 1, acc.device, skip=True)
        if acc.is_main_process:
            torch.save({"params": ref}, out / f"rollback_{kind}_ref.pt")


def sync_debug(acc: Accelerator, out: Path):
    model, _ = train_ddp(acc, "adamw", 1)
    checker = SyncChecker(model, interval=2)
    reports = {"in_sync": checker.check(0), "not_due": checker.maybe_check(1)}
    if acc.process_index == 1:
        with torch.no_grad():
            acc.unwrap_model(model).fc2.weight[3, 5] += 1e-4  # desynchronise one parameter on rank 1
    x = torch.randn(B, 16, device=acc.device)
    model(x).pow(2).mean().backward()  # DDP all-reduces: gradients stay equal, the parameter does not
    reports["param_desync"] = checker.maybe_check(2)
    model.zero_grad()
    with model.no_sync():  # skip the all-reduce on purpose: each rank keeps its own gradient
        model(x + acc.process_index).pow(2).mean().backward()
    reports["grad_desync"] = check_sync(model, step=3)
    torch.save(
        {k: (v.__dict__ if v is not None else None) for k, v in reports.items()},
        out / f"sync_rank{acc.process_index}.pt",
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", default="equivalence,rollback,sync")
    args = parser.parse_args()
    acc = Accelerator(cpu=args.device == "cpu")
    # fp32 and no TF32: the comparison against one process must be a matter of summation order only
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    support = describe_engine(acc, log=False)
    if acc.is_main_process:
        torch.save({"engine": support.engine.value, "world": acc.num_processes}, args.out / "engine.pt")
    todo = args.only.split(",")
    for name, fn in (("equivalence", equivalence), ("rollback", rollback), ("sync", sync_debug)):
        if name in todo:
            fn(acc, args.out)
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
