"""``PPOSweep``: many PPO trials, each a LoRA adapter and a value head, on one shared frozen base."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rapidfire_hf.models import causal_lm_parts
from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.data import prepare_prompt_dataset
from rapidfire_hf.ppo.trainer import _disable_dropout
from rapidfire_hf.sweep import checkpoint as ckpt
from rapidfire_hf.sweep import outputs
from rapidfire_hf.sweep.control import ControlFile, EarlyStopping
from rapidfire_hf.sweep.lora import AdapterBank
from rapidfire_hf.sweep.phases import SweepPhases, trial_metrics
from rapidfire_hf.sweep.trial import Trial, build_trial, check_trial_name, trial_args

logger = logging.getLogger(__name__)


@dataclass
class SweepResult:
    """What one trial ended with. ``log_history`` has the format of ``PPOTrainer.state.log_history``."""

    name: str
    overrides: dict
    status: str
    global_step: int
    log_history: list[dict] = field(default_factory=list)
    parent: str | None = None


class PPOSweep:
    """Several PPO trials trained at once on one frozen base model, one LoRA adapter per trial.

    Each trial is the shared ``args`` with its own overrides of PPOConfig fields (learning rate, KL
    coefficient, clip ranges, reward weights, seed, ...; see ``PER_TRIAL_FIELDS``). One copy of the base
    weights serves every trial; the reference policy is the base with adapters off; the reward model or
    reward functions are shared. Each update generates all trials' rows in one batched decode (every row
    through its own trial's adapter), scores them in shared forwards and runs the trials' PPO micro-batches
    through one forward and backward, while every trial keeps its own optimizer, LR schedule, value head,
    prompt order and random streams: a trial's results equal that trial trained alone.

    Args:
        args: the shared :class:`PPOConfig` (``value_mode`` is always fused: a value head per trial).
        trials: ``{name: {field: value}}`` per-trial overrides.
        model: the base causal LM (not PEFT-wrapped); its target linears are wrapped in place.
        processing_class: the tokenizer (a pad token distinct from the stop token).
        train_dataset: prompts (a ``prompt`` column or ``input_ids``).
        peft_config: a ``peft.LoraConfig``; LoRA is required (sharing the base needs frozen base weights).
        reward_funcs / reward_model: exactly one, as in ``PPOTrainer``.
        callbacks: ``transformers.TrainerCallback``-like objects; ``on_step_end`` and ``on_log`` are called
            per trial with ``sweep=`` and ``trial=`` keyword arguments, and may call ``sweep.stop(...)``,
            ``sweep.clone(...)`` or set ``control.should_training_stop`` (stops that trial).
        early_stopping: an :class:`EarlyStopping` rule, or None.
        progress: draw a live table of every trial (rich).

    Example:
        >>> sweep = PPOSweep(args=PPOConfig(output_dir="out/sweep", max_steps=40),
        ...                  trials={"kl0.01": {"kl_coef": 0.01}, "kl0.2": {"kl_coef": 0.2}},
        ...                  model=base, processing_class=tok, reward_funcs=[my_reward],
        ...                  train_dataset=prompts, peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        >>> results = sweep.train()
        >>> results["kl0.2"].log_history[-1]["objective/kl"]
    """

    def __init__(
        self,
        args: PPOConfig,
        trials: dict[str, dict],
        model,
        processing_class,
        train_dataset,
        peft_config=None,
        reward_funcs=None,
        reward_model=None,
        callbacks=None,
        early_stopping: EarlyStopping | None = None,
        progress: bool = True,
    ):
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a rapidfire_hf.PPOConfig, got {type(args).__name__}")
        if peft_config is None:
            raise ValueError(
                "PPOSweep shares one frozen base model between trials, so each trial must train a LoRA "
                "adapter: pass peft_config=LoraConfig(...). Full-model trials are not supported."
            )
        if not trials:
            raise ValueError("trials is empty: give at least one {name: {overrides}} entry")
        adapters = [k for k in ("model_adapter_name", "ref_adapter_name") if getattr(args, k) is not None]
        if adapters:
            raise ValueError(
                f"PPOSweep gives each trial its own adapter on the shared base, whose reference is the base "
                f"itself: {', '.join(adapters)} do not apply; drop them from the PPOConfig."
            )
        funcs = (
            []
            if reward_funcs is None
            else list(reward_funcs)
            if isinstance(reward_funcs, (list, tuple))
            else [reward_funcs]
        )
        if (reward_model is None) == (not funcs):
            raise ValueError("Give exactly one of reward_model and reward_funcs.")
        tok = processing_class
        if getattr(tok, "pad_token_id", None) is None:
            raise ValueError("processing_class has no pad token: add one distinct from the EOS token.")
        self.args, self.tok, self.callbacks = args, tok, list(callbacks or [])
        self.early_stopping, self.show_progress = early_stopping, progress
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
        self.model = model.to(self.device)
        self.bank = AdapterBank(self.model, peft_config)
        _disable_dropout(self.model)
        if reward_model is not None:
            reward_model = reward_model.to(self.device).eval().requires_grad_(False)
            _disable_dropout(reward_model)
        self.train_dataset = prepare_prompt_dataset(
            train_dataset, tok, args.dataset_text_field, args.max_prompt_length
        )
        # every batch is padded to the longest prompt of the dataset: a trial's tensors then have the same
        # shape whichever trials run beside it (no extra padding that would change the arithmetic)
        self.prompt_width = max(len(ids) for ids in self.train_dataset["input_ids"])
        self.hidden_size = causal_lm_parts(self.model)[0].config.hidden_size
        self.phases = SweepPhases(
            self.model, self.bank, args, tok, self._make_engine(), reward_model, funcs,
            full_mask=_full_mask(self.model), reward_full_mask=_full_mask(reward_model),
        )  # fmt: skip
        self.trials: dict[str, Trial] = {}
        self._slots = 0
        self._pending: list[tuple] = []
        self._training = False
        self.control = ControlFile(Path(args.output_dir))
        for name, overrides in trials.items():
            self._add(name, overrides or {})

    # ------------------------------------------------------------------ construction helpers
    def _make_engine(self):
        from rapidfire_hf.rollout import RolloutEngine
        from rapidfire_hf.rollout.llama_forward import unsupported_reason

        stop = self.tok.eos_token_id if self.args.stop_token == "eos" else self.args.stop_token_id
        reason = unsupported_reason(self.model)
        if reason is not None:
            logger.warning("PPOSweep: one model.generate per trial (the batched decode needs %s)", reason)
        return RolloutEngine(
            self.model,
            self.tok.pad_token_id,
            [stop] if stop is not None else [],
            backend="static" if reason is None else "hf",
            decode_mode=self.args.rollout_decode_mode,
        )

    def _add(self, name: str, overrides: dict, source: Trial | None = None, parent_overrides=None) -> Trial:
        check_trial_name(name)
        if name in self.trials:
            raise ValueError(f"a trial named {name!r} exists already: choose another name")
        merged = {**(parent_overrides or {}), **overrides}
        args = trial_args(self.args, merged, name)
        funcs = self.phases.reward_funcs
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(
                f"trial {name!r}: reward_weights has {len(args.reward_weights)} entries for {len(funcs)} reward "
                "functions: give one weight per function."
            )
        slot = f"t{self._slots}"
        self._slots += 1
        trial = build_trial(
            name,
            args,
            merged,
            self.bank,
            slot,
            self.hidden_size,
            self.device,
            len(self.train_dataset),
            source,
        )
        self.trials[name] = trial
        return trial

    # ------------------------------------------------------------------ controls
    def stop(self, name: str, reason: str = "stopped") -> None:
        """Stop a trial at the next update boundary (its state is kept; :meth:`resume` continues it)."""
        self._control(("stop", name, reason))

    def resume(self, name: str) -> None:
        """Let a stopped trial run again from where it stopped."""
        self._control(("resume", name))

    def clone(self, src: str, new: str, **overrides) -> None:
        """A new trial ``new`` from ``src``'s current adapter, value head and optimizer state, with overrides."""
        self._control(("clone", src, new, overrides))

    def _control(self, op: tuple) -> None:
        self._trial(op[1])  # a bad name fails at the call, not later
        if self._training:
            self._pending.append(op)
        else:
            self._apply(op)

    def _trial(self, name: str) -> Trial:
        if name not in self.trials:
            raise KeyError(f"no trial named {name!r}; trials: {', '.join(self.trials)}")
        return self.trials[name]

    def _apply(self, op: tuple) -> None:
        kind, name = op[0], op[1]
        trial = self._trial(name)
        if kind == "stop" and trial.status == "running":
            trial.status, trial.reason = ("early_stopped" if op[2] == "early_stopped" else "stopped"), op[2]
        elif kind == "resume" and trial.status in ("stopped", "early_stopped"):
            trial.status, trial.reason = "running", ""
        elif kind == "clone":
            self._add(op[2], op[3], source=trial, parent_overrides=trial.overrides)
        logger.info("PPOSweep: %s", " ".join(str(x) for x in op))

    def _boundary(self) -> None:
        """Apply what arrived since the last update: Python calls, then commands from the control file."""
        for op in self.control.read():
            try:
                self._apply(op)
            except (KeyError, ValueError) as err:
                logger.warning("PPOSweep: ignored control command %s: %s", op, err)
        pending, self._pending = self._pending, []
        for op in pending:
            self._apply(op)

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict[str, SweepResult]:
        """Run every trial to its number of updates (or until stopped); returns ``{name: SweepResult}``."""
        if resume_from_checkpoint:
            ckpt.load_sweep(self, resume_from_checkpoint)
        self._training, self._start = True, time.perf_counter()
        progress = outputs.SweepProgress(self) if self.show_progress else None
        self._dispatch("on_train_begin")
        try:
            while True:
                self._boundary()
                active = [t for t in self.trials.values() if t.active]
                if not active:
                    break
                self._round(active)
                if self.early_stopping is not None:
                    for name, why in self.early_stopping.check(self.trials):
                        self._apply(("stop", name, "early_stopped"))
                        self._trial(name).reason = why
                if progress is not None:
                    progress.update()
                outputs.write_state(self)
        finally:
            self._training = False
            if progress is not None:
                progress.close()
        for t in self.trials.values():
            if t.done and t.status == "running":
                t.status = "finished"
        self._dispatch("on_train_end")
        ckpt.save_sweep(self)
        outputs.write_all(self)
        return self.results()

    def _round(self, active: list[Trial]) -> None:
        """One update of every active trial: batched rollout, scoring and PPO epochs, then per-trial logs."""
        t0 = time.perf_counter()
        batches = [self._prompts(t) for t in active]
        rollouts = self.phases.rollout(active, batches)
        t1 = _sync_time(self.device)
        exps = self.phases.score(active, rollouts)
        t2 = _sync_time(self.device)
        stats = self.phases.optimize(active, exps)
        t3 = _sync_time(self.device)
        for trial, exp, st in zip(active, exps, stats):
            trial.state.episode += trial.args.local_batch_size
            metrics = trial_metrics(trial, exp, st, (t0, t1, t2, t3), self.tok.eos_token_id, self._start)
            s = trial.state
            s.global_step += 1
            s.epoch = s.global_step / trial.prompt_order.batches_per_pass
            trial.scheduler.step()
            self._dispatch("on_step_end", trial)
            every = max(1, int(trial.args.logging_steps))
            if s.global_step % every == 0 or trial.done:
                s.log_history.append({**metrics, "epoch": s.epoch, "step": s.global_step})
                self._dispatch("on_log", trial, logs=metrics)
            a = trial.args
            if a.save_strategy == "steps" and a.save_steps and s.global_step % int(a.save_steps) == 0:
                ckpt.save_trial(self, trial)
            if trial.control.should_training_stop:
                trial.control.should_training_stop = False
                self._pending.append(("stop", trial.name, "callback"))

    def _prompts(self, trial: Trial) -> dict:
        from rapidfire_hf.ppo.data import collate_prompts

        rows = [self.train_dataset[i] for i in trial.prompt_order.indices(trial.state.global_step)]
        batch = collate_prompts(rows, self.tok.pad_token_id)
        ids = batch["input_ids"]
        extra = self.prompt_width - ids.shape[1]
        if extra > 0:
            ids = torch.cat([ids.new_full((ids.shape[0], extra), self.tok.pad_token_id), ids], dim=1)
        batch["input_ids"] = ids
        return batch

    def _dispatch(self, event: str, trial: Trial | None = None, **kwargs) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is None:
                continue
            if trial is None:
                fn(self.args, None, None, sweep=self, **kwargs)
            else:
                fn(trial.args, trial.state, trial.control, sweep=self, trial=trial.name, **kwargs)

    # ------------------------------------------------------------------ results
    def results(self) -> dict[str, SweepResult]:
        return {
            n: SweepResult(n, dict(t.overrides), t.status, t.state.global_step, t.state.log_history, t.parent)
            for n, t in self.trials.items()
        }

    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        """Trial ``name``'s LoRA weights under peft's keys (loadable with ``set_peft_model_state_dict``)."""
        return self.bank.state_dict(self._trial(name).slot)


def _full_mask(model) -> bool:
    """Whether ``model`` gets the 4-D mask: always on SDPA models, where with the 2-D one transformers
    switches to ``is_causal`` attention for a chunk without padding, so a trial's arithmetic would depend
    on its neighbours' rows; never on others (flash attention takes only the 2-D mask)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"


def _sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
