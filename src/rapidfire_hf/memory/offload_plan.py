"""Whether a PPO run keeps the frozen models' weights and the optimizer state in host memory between phases.

The reference and reward models are read only while scoring, the optimizer state only while training
(:mod:`rapidfire_hf.memory.phase_offload` moves them). Offloading frees their bytes in the other phases:
the frozen weights in generation and training, the optimizer state in generation and scoring. The
arithmetic is unchanged; the cost is copies over the host link every update (the frozen weights in once,
the state out and back), each on a side stream where the next phase can start beside it.

:func:`choose_offload` plans the run with both moved and compares what the update then runs with the
plan without them (:func:`update_work`: fitting, pieces of the micro-batch, recompute, training forwards,
generation and scoring chunks, a freed KV cache). Offload is chosen only where that is less work: on a
card where everything already fits as asked, nothing moves. Then the cheapest subset (fewest bytes over
the link) that gives the same work is kept. ``memory.optimization`` decides whether the trade is allowed
(:data:`rapidfire_hf.memory.levels.MEMORY_LEVELS`' ``offload``: every level but ``conservative``);
PPOConfig's ``host_offload`` may turn it ``"off"`` or force it ``"on"``.

At 7B full fine-tuning, batch 160, one H100 80 GB, ``aggressive`` (the shape alone, ``rapidfire plan``):
moving the 24.8 GiB of the reference and reward weights and the 12.6 GiB of 8-bit AdamW state lets the
micro-batch of 8 train whole without recompute (instead of 2 pieces of 4 with element-wise recompute) and
generate the batch of 160 in one chunk (instead of 2).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rapidfire_hf.memory.planner import GIB, POLICIES, Budget, Plan, Workload, _changed, level_target

# Bytes per second the planner assumes for a pinned host <-> device copy (PCIe Gen4 x16 measures about
# 22 GB/s one way, Gen5 about 45): only for the plan table's estimate of the copies' seconds an update.
HOST_LINK_BYTES_PER_S = 22e9

HOST_OFFLOAD_VALUES = ("auto", "on", "off")
# PPOConfig's default and `rapidfire plan`'s: "auto" since one H100 80 GB measured 3,857 against 2,559 tokens/s
# with "off" (7B full fine-tuning, batch 160, same call: benchmarks/card80/results/h100_2026-12-06)
HOST_OFFLOAD_DEFAULT = "auto"
# the planner also takes one part forced (replaying a stored plan's choice: tests, benchmarks)
FORCED_PARTS = ("frozen", "state")


def update_work(plan: Plan, work: Workload) -> tuple:
    """What one update of ``plan`` runs, least first when compared: not fitting, halvings of the micro-batch,
    recompute, training forwards per mini-batch, generation chunks, scoring chunks, a KV cache rebuilt."""
    recompute = POLICIES.index(plan.checkpointing) if plan.checkpointing in POLICIES else len(POLICIES)
    forwards = -(-work.micro_batches // max(1, plan.merge)) * 2**plan.splits
    return (
        not plan.fits,
        plan.splits,
        recompute,
        forwards,
        -(-work.rollout_rows // max(1, plan.generation_rows)),
        -(-work.rollout_rows // max(1, plan.scoring_rows)),
        plan.free_cache,
    )


def copy_bytes(budget: Budget) -> int:
    """Bytes an update copies over the host link with ``budget``'s offload: the frozen weights in once (their
    host copy stays current), the optimizer state out and back."""
    return budget.frozen_away + (2 * budget.state_bytes if budget.state_away else 0)


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def choose_offload(
    make: Callable[[Budget], Plan],
    work: Workload,
    budget: Budget,
    frozen_bytes: int,
    level,
    want: str = "auto",
    state_movable: bool = True,
) -> tuple[Budget, Plan]:
    """The budget and plan of the run with the offload that pays (module docstring).

    Args:
        make: the plan of the run within a budget (the caller's ``make_plan`` with its other arguments).
        work: the update's shapes.
        budget: the budget without offload; its ``state_bytes`` is what offloading the state frees.
        frozen_bytes: the frozen models' weights on the device that could be offloaded (0: none, e.g. a
            rule reward with LoRA, or quantized frozen models).
        level: ``memory.optimization``.
        want: PPOConfig's ``host_offload``: ``"auto"`` (the plan decides), ``"on"`` (whatever can move moves),
            ``"off"``; ``"frozen"`` or ``"state"``: that part only (replaying a stored plan).
        state_movable: the optimizer state lives where it can be offloaded (a CUDA device).

    Returns:
        ``(budget, plan)``: the plan's ``offload_frozen`` / ``offload_state`` and their reasons are set.

    Raises:
        ValueError: ``want`` not one of ``auto``, ``on``, ``off``.
    """
    if want not in HOST_OFFLOAD_VALUES + FORCED_PARTS:
        raise ValueError(f"host_offload={want!r}: expected one of {', '.join(HOST_OFFLOAD_VALUES)}")
    state = budget.state_bytes if state_movable else 0
    frozen = max(0, frozen_bytes)
    full = replace(budget, frozen_away=frozen, state_away=state > 0)
    plain_plan = make(budget)
    none = {
        "frozen": "no frozen weights that move (none on the device, or quantized ones, which stay there)",
        "state": "no optimizer state to move",
    }
    chosen, why = budget, None
    if want == "off":
        why = "your host_offload='off'"
    elif want == "on":
        chosen, why = full, "your host_offload='on'"
    elif want in FORCED_PARTS:
        part = {"frozen": replace(budget, frozen_away=frozen), "state": replace(budget, state_away=state > 0)}
        chosen, why = part[want], f"forced: {want} only"
    elif not level_target(level).offload:
        why = f"memory.optimization={getattr(level, 'value', level)} makes no host offload"
    elif copy_bytes(full) == 0:
        why = "nothing to move"
    else:
        full_plan = make(full)
        if update_work(full_plan, work) >= update_work(plain_plan, work):
            why = f"the {_size(frozen + state)} it would free changes nothing the update runs"
        else:
            target = update_work(full_plan, work)
            options = [
                replace(budget, frozen_away=frozen),
                replace(budget, state_away=state > 0),
            ]
            chosen = full
            for option in sorted((o for o in options if copy_bytes(o) > 0), key=copy_bytes):
                if update_work(make(option), work) == target:
                    chosen = option
                    break
    plan = plain_plan if chosen is budget else make(chosen)
    plan = replace(plan, reasons=dict(plan.reasons), asked=dict(plan.asked))
    plan.asked["host_offload"] = want
    plan.offload_frozen = chosen.frozen_away > 0
    plan.offload_state = chosen.state_away
    seconds = copy_bytes(chosen) / HOST_LINK_BYTES_PER_S
    if why is None:  # chosen because it pays
        changed = ", ".join(_changed(plain_plan, plan)) or "fits"
        why = f"{changed}; ~{seconds:.1f} s of copies an update"
    elif want == "on":
        why += f" (~{seconds:.1f} s of copies an update)"
    paid = chosen is not budget and want == "auto"
    spare = "not needed: the other offload alone gives the same plan"
    plan.reasons["offload_frozen"] = (
        (f"{_size(frozen)} away outside scoring: " + why if plan.offload_frozen else (spare if paid else why))
        if frozen
        else none["frozen"]
    )
    plan.reasons["offload_state"] = (
        (f"{_size(state)} away outside training: " + why if plan.offload_state else (spare if paid else why))
        if state
        else none["state"]
    )
    return chosen, plan


def with_offload_of(source: Plan, plan: Plan) -> Plan:
    """``plan`` (decided after ``source``, e.g. with the fused decode copies held) carrying ``source``'s
    offload choices and their reasons."""
    if plan is source:
        return plan
    plan = replace(plan, reasons=dict(plan.reasons), asked=dict(plan.asked))
    plan.offload_frozen, plan.offload_state = source.offload_frozen, source.offload_state
    for key in ("offload_frozen", "offload_state"):
        if key in source.reasons:
            plan.reasons[key] = source.reasons[key]
    if "host_offload" in source.asked:
        plan.asked["host_offload"] = source.asked["host_offload"]
    return plan
