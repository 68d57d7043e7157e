"""One trial of a sweep: its PPOConfig (shared settings plus overrides) and everything it owns.

A trial owns its LoRA adapter slot, value head, optimizer, LR scheduler, prompt order, permutation
generator and per-update sampling seeds (all drawn by the rule of :mod:`rapidfire_hf.ppo.seeds`, as
``PPOTrainer`` draws them), log history and status; nothing in it is shared with another
trial, which is what makes its results independent of the trials beside it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import TrainerControl

from rapidfire_hf.models.value_head import ValueHead
from rapidfire_hf.optim.step_health import StepHealth, step_health
from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.data import PromptOrder
from rapidfire_hf.ppo.default_optimizer import default_adamw, default_adamw_kernel, default_scheduler
from rapidfire_hf.ppo.seeds import new_value_head, permutation_generator, prompt_order, sampling_generator
from rapidfire_hf.ppo.types import PPOTrainerState
from rapidfire_hf.sweep.fields import PER_TRIAL_FIELDS, value_problem


def trial_args(shared: PPOConfig, overrides: dict, name: str) -> PPOConfig:
    """The trial's PPOConfig: ``shared`` with ``overrides`` applied and its own output folder.

    Raises:
        ValueError: an override names no PPOConfig field (the message suggests the closest ones), a
            field every trial must share, or a value PPOConfig or the LR schedule refuses.
    """
    if not isinstance(overrides, dict):
        raise ValueError(
            f"trial {name!r}: the overrides must be a mapping of PPOConfig fields, got {overrides!r}"
        )
    known = {f.name for f in dataclasses.fields(PPOConfig) if f.init}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ValueError(f"trial {name!r}: {key!r} is not a PPOConfig field{hint}")
        if key not in PER_TRIAL_FIELDS:
            raise ValueError(
                f"trial {name!r}: {key!r} is shared by every trial of a sweep (one batched decode and forward): "
                f"set it in the shared config. Per-trial fields: {', '.join(sorted(PER_TRIAL_FIELDS))}"
            )
        problem = value_problem(key, overrides[key])
        if problem is not None:
            raise ValueError(f"trial {name!r}: {problem}")
    out_dir = f"{shared.output_dir}/trials/{name}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = dataclasses.replace(shared, **overrides, output_dir=out_dir)
        make_optimizer(args, [torch.nn.Parameter(torch.zeros(1))], 1)  # the schedule's settings, now
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"trial {name!r}: {' '.join(str(err).split())[:400]}") from None
    return args


@dataclass
class Trial:
    """Everything one trial owns (built by :func:`build_trial`)."""

    name: str
    args: PPOConfig
    overrides: dict
    slot: str
    value_head: ValueHead
    params: list[torch.nn.Parameter]  # adapter then value head, the optimizer's order
    optimizer: torch.optim.Optimizer
    scheduler: object
    prompt_order: PromptOrder
    perm_generator: torch.Generator
    num_updates: int
    health: StepHealth | None = None  # the finite-step guard of its optimizer (set by build_trial)
    state: PPOTrainerState = field(default_factory=PPOTrainerState)
    control: TrainerControl = field(default_factory=TrainerControl)
    status: str = "running"
    parent: str | None = None
    reason: str = ""
    branch_step: int | None = None  # a clone: its parent's update when it was made
    saved_step: int | None = None  # the update of the checkpoint this process last wrote or loaded
    pinned: bool = False  # resumed by hand: the stopping rules leave it alone
    step_error: str | None = None  # why an optimizer step of this trial failed (it then diverges)
    # a stopped trial whose folder vanished: its summary.json record from before, kept (sweep/checkpoint.py)
    kept_record: dict | None = None

    @property
    def done(self) -> bool:
        return self.state.global_step >= self.num_updates

    @property
    def active(self) -> bool:
        return self.status == "running" and not self.done

    def update_generator(self) -> torch.Generator:
        """The sampling noise of this trial's next rollout (:func:`rapidfire_hf.ppo.seeds.sampling_generator`)."""
        return sampling_generator(self.args.seed, self.state.global_step)


def num_updates(args: PPOConfig, num_prompts: int) -> int:
    """Updates a trial runs: ``max_steps``, else ``total_episodes`` (or epochs) worth of rollout batches."""
    if args.max_steps > 0:
        return args.max_steps
    total = args.total_episodes or int(args.num_train_epochs * num_prompts)
    return max(1, math.ceil(total / args.local_batch_size))


def make_optimizer(args: PPOConfig, params, updates: int):
    """AdamW and the LR schedule ``PPOTrainer`` builds by default (``ppo/default_optimizer``: the same kernel choice,
    torch's default on CPU and fused on one GPU, and the same schedule)."""
    opt = default_adamw(args, params, **default_adamw_kernel(params[0].device))
    return opt, default_scheduler(args, opt, updates)


def build_trial(name, args, overrides, bank, slot, hidden_size, device, num_prompts, source=None) -> Trial:
    """A new trial: fresh adapter and value head from ``args.seed``, or a copy of ``source``'s state.

    A copy (clone) takes the source's adapter, value head, optimizer moments, prompt order position,
    permutation generator and update count, then its own hyper-parameters from ``args``.
    """
    if source is None:  # drawn as PPOTrainer draws them from the trial's seed (rapidfire_hf.ppo.seeds)
        adapter = bank.add(slot, seed=args.seed)
        head = new_value_head(hidden_size, args.seed)
    else:
        adapter = bank.copy(source.slot, slot)
        head = ValueHead(hidden_size)
        head.load_state_dict(source.value_head.state_dict())
    head = head.to(device=device, dtype=adapter[0].dtype)
    params = adapter + list(head.parameters())
    updates = num_updates(args, num_prompts)
    opt, sched = make_optimizer(args, params, updates)
    order = prompt_order(num_prompts, args.local_batch_size, args.seed)
    trial = Trial(
        name, args, dict(overrides), slot, head, params, opt, sched, order, permutation_generator(args.seed),
        updates,
    )  # fmt: skip
    trial.health = step_health(
        opt, guard=True, max_consecutive_skips=args.max_consecutive_skips, owner=f"PPOSweep trial {name}"
    )  # as PPOTrainer's Stepper guards a plain optimizer: a non-finite window is skipped
    if source is not None:
        _take_state(trial, source)
    return trial


def _take_state(trial: Trial, source: Trial) -> None:
    """Optimizer moments, schedule position, generators and counters of ``source``, own hyper-parameters."""
    state = source.optimizer.state_dict()
    state = {"state": {k: {n: t.clone() for n, t in v.items()} for k, v in state["state"].items()}}
    state["param_groups"] = trial.optimizer.state_dict()["param_groups"]
    trial.optimizer.load_state_dict(state)
    trial.perm_generator.set_state(source.perm_generator.get_state())
    trial.state.global_step = source.state.global_step
    trial.state.episode = source.state.episode
    trial.state.epoch = source.state.epoch
    trial.state.log_history = [dict(h) for h in source.state.log_history]  # the curve up to the clone
    trial.parent = source.name
    trial.branch_step = source.state.global_step
    with warnings.catch_warnings():  # the schedule catches up to the update count; no step is skipped
        warnings.simplefilter("ignore")
        for _ in range(source.state.global_step):
            trial.scheduler.step()
