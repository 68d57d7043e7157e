"""``PPOSweep``: many PPO trials, each a LoRA adapter and a value head, on one shared frozen base."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rapidfire_hf.memory.planner import Plan
from rapidfire_hf.models.plumbing import causal_lm_parts, disable_dropout
from rapidfire_hf.optim.skips import ConsecutiveSkipsError
from rapidfire_hf.ppo.config import PPOConfig, engine_kv_cache_dtype, load_rapidfire_config
from rapidfire_hf.ppo.data import prepare_prompt_dataset
from rapidfire_hf.ppo.settings_check import check_sweep_settings, check_unchanged
from rapidfire_hf.ppo.types import PPOStats, sync_time
from rapidfire_hf.sweep import checkpoint as ckpt
from rapidfire_hf.sweep import outputs
from rapidfire_hf.sweep.control import ControlFile, check_metric_logged
from rapidfire_hf.sweep.fields import check_trial_name
from rapidfire_hf.sweep.journal import JOURNAL, DecisionJournal, Replay, command_of, read_journal
from rapidfire_hf.sweep.lora import AdapterBank
from rapidfire_hf.sweep.phases import SweepPhases, trial_metrics
from rapidfire_hf.sweep.planning import SweepPlanner, sweep_memory
from rapidfire_hf.sweep.trackers import TrialTrackers
from rapidfire_hf.sweep.trial import Trial, build_trial, num_updates, trial_args
from rapidfire_hf.utils.interrupt import StopSignals, TrainingInterrupted

logger = logging.getLogger(__name__)


class SweepError(RuntimeError):
    """A failure shared by every trial of a sweep (the reward function raised, a checkpoint could not be
    written); the message names the update and what was saved. The original error is ``__cause__``."""


@dataclass
class SweepResult:
    """What one trial ended with. ``log_history`` has the format of ``PPOTrainer.state.log_history``."""

    name: str
    overrides: dict
    status: str
    global_step: int
    log_history: list[dict] = field(default_factory=list)
    parent: str | None = None


def sweep_decode_attention(value: str) -> str:
    """The decode attention a sweep's engine runs: ``"auto"`` stays SDPA here.

    ``PPOTrainer``'s ``"auto"`` is the Triton flash-decoding kernel on a GPU (1.00-1.06x per update, same
    calls; benchmarks/kernels, fifth and sixth calls), but no sweep ran with it: every sweep number in
    benchmarks/sweep is SDPA's, and the kernel's compilation (6-10 s in the first generation) counts against
    the time to the best trial. A named implementation is kept.
    """
    return "sdpa" if value == "auto" else value


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
        args: the shared :class:`PPOConfig` (``value_mode`` is fused, a value head per trial: ``"separate"``
            given by name is refused). Every field is applied or refused by name before any work (the
            settings contract, ``rapidfire_hf.config.contract``).
        trials: ``{name: {field: value}}`` per-trial overrides.
        model: the base causal LM (not PEFT-wrapped); its target linears are wrapped in place.
        processing_class: the tokenizer (a pad token distinct from the stop token).
        train_dataset: prompts (a ``prompt`` column or ``input_ids``).
        peft_config: a ``peft.LoraConfig``; LoRA is required (sharing the base needs frozen base weights).
        reward_funcs / reward_model: exactly one, as in ``PPOTrainer``.
        callbacks: ``transformers.TrainerCallback``-like objects; ``on_step_end`` and ``on_log`` are called
            per trial with ``sweep=`` and ``trial=`` keyword arguments, and may call ``sweep.stop(...)``,
            ``sweep.clone(...)`` or set ``control.should_training_stop`` (stops that trial).
        early_stopping: a rule that stops trials (:class:`EarlyStopping`, :class:`SuccessiveHalving`, any
            object with ``check(trials) -> [(name, reason)]``), a list of them, or None.
        progress: draw a live table of every trial (rich); off a terminal, one line per update instead.
        train_rows_per_forward: the most rows one training forward takes across the trials of a micro-step
            (None: the sweep's throughput plan decides, ``sweep/planning.py``: as many trials' micro-batches
            as fit the memory level's target, at most 16,384 tokens, at least one trial's micro-batch; the
            math is the same either way, only the peak and the speed change).

    ``args.rapidfire_config`` sets the plan's memory level (``memory.optimization``: the share of the device
    the sweep may plan to use; default ``balanced``) and ``memory.planner: false`` turns the plan off (the
    fixed 16,384-token packing and TRL's scoring chunk). The plan is printed before the first update and
    logged to the trackers as ``rapidfire/plan/*``. The rest of a rapidfire config does not apply to a
    sweep (each trial trains with torch AdamW, no memory callback or precision plugin): a field given by name
    is refused, naming it.

    ``args.report_to`` may name ``"tensorboard"`` (one sub-folder per trial under ``output_dir/runs``) and
    ``"wandb"`` (one run per trial, grouped by the sweep's folder name).

    Faults stay in their trial. Each trial's optimizer step goes through PPOTrainer's finite-step guard: a
    window whose loss or gradients are not finite is skipped (``rapidfire/skipped_steps``), and
    ``max_consecutive_skips`` skipped windows in a row stop the trial as ``diverged``. A trial whose rewards,
    values, log-probs, losses or weights turn non-finite is stopped with state ``diverged`` (the update and the check in its ``reason``, the log and
    ``summary.json``) and never saved; the others continue unchanged. A failure shared by every trial
    (the reward function raising) saves every trial's checkpoint, log history and the summary, then
    raises :class:`SweepError` naming the update.

    Decisions are durable: every stop, resume, clone, rule cut and save is journaled the moment it is taken
    (``decisions.jsonl``, :mod:`rapidfire_hf.sweep.journal`); every ``save_steps`` rounds every trial is
    checkpointed at once. ``train(resume_from_checkpoint=True)`` after a kill at any point starts from the
    last complete save and takes the same decisions at the same updates: the trials end as the uninterrupted
    run's (bit-exact on the CPU). Ctrl-C or SIGTERM finishes the update in progress, checkpoints every trial
    and raises :class:`rapidfire_hf.utils.interrupt.TrainingInterrupted` naming the folder; a second one
    abandons the update.

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
        early_stopping=None,
        progress: bool = True,
        train_rows_per_forward: int | None = None,
    ):
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a rapidfire_hf.PPOConfig, got {type(args).__name__}")
        check_sweep_settings(args, model)  # the settings contract: applied or refused by name, before any work
        self._args_snapshot = args.snapshot()  # train() refuses a field changed after construction
        if train_rows_per_forward is not None and (
            isinstance(train_rows_per_forward, bool)
            or not isinstance(train_rows_per_forward, int)
            or train_rows_per_forward < 1
        ):
            raise ValueError(
                f"train_rows_per_forward must be a whole number >= 1, got {train_rows_per_forward!r}"
            )
        if peft_config is None:
            raise ValueError(
                "PPOSweep shares one frozen base model between trials, so each trial must train a LoRA "
                "adapter: pass peft_config=LoraConfig(...). Full-model trials are not supported."
            )
        if not isinstance(trials, dict):
            raise TypeError(
                f"trials must be a mapping {{name: {{overrides}}}}, got a {type(trials).__name__}"
            )
        if not trials:
            raise ValueError("trials is empty: give at least one {name: {overrides}} entry")
        if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
            raise ValueError(
                f"output_dir {args.output_dir} is a file: give a folder (the sweep writes one per trial)"
            )
        for name, overrides in trials.items():  # every trial checked before the model moves or changes
            check_trial_name(name)
            trial_args(args, overrides or {}, name)
        funcs = (
            []
            if reward_funcs is None
            else list(reward_funcs)
            if isinstance(reward_funcs, (list, tuple))
            else [reward_funcs]
        )
        if (reward_model is None) == (not funcs):
            raise ValueError("Give exactly one of reward_model and reward_funcs.")
        bad = [f for f in funcs if not callable(f)]
        if bad:
            raise TypeError(f"reward_funcs must be functions; got {bad[0]!r}")
        rules = list(early_stopping) if isinstance(early_stopping, (list, tuple)) else [early_stopping]
        rules = [r for r in rules if r is not None]
        if any(not callable(getattr(r, "check", None)) for r in rules):
            raise TypeError(
                "early_stopping must be an EarlyStopping, a SuccessiveHalving, an object with "
                "check(trials) -> [(name, reason)], or a list of them"
            )
        tok = processing_class
        if getattr(tok, "pad_token_id", None) is None:
            raise ValueError("processing_class has no pad token: add one distinct from the EOS token.")
        self.trackers = TrialTrackers(args.report_to, args.output_dir)  # report_to checked before the model
        level, planner = sweep_memory(load_rapidfire_config(args.rapidfire_config))  # checked before the model
        self.planner = SweepPlanner(level, planner, train_rows_per_forward)
        self._plan_logs: dict = {}  # a new plan's rapidfire/plan/* values, logged with the next update
        self.args, self.tok, self.callbacks = args, tok, list(callbacks or [])
        self.rules, self.show_progress = rules, progress
        self.device = torch.device("cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
        self.model = model.to(self.device)
        self.bank = AdapterBank(self.model, peft_config)
        disable_dropout(self.model)
        if reward_model is not None:
            reward_model = reward_model.to(self.device).eval().requires_grad_(False)
            disable_dropout(reward_model)
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
            train_rows=train_rows_per_forward,
        )  # fmt: skip
        self.trials: dict[str, Trial] = {}
        self._slots = 0
        self._pending: list[tuple[tuple, int]] = []  # (command, its trial's update) taken during training
        self._replay: Replay | None = None  # a resumed sweep: journaled decisions waiting for their update
        self.journal = DecisionJournal(Path(args.output_dir))
        self._metrics_checked = False
        self._control_recorded = 0  # the control file's offset the journal holds
        self._rounds = 0  # rounds run (one update of every active trial each); saves come every save_steps
        self._training = False
        self._phase, self._clean = "start", True
        # control commands refused or ignored, and divergences (sweep_state.json)
        self.messages: list[str] = []
        # marks this sweep's checkpoints (a resume takes over the saved sweep's id)
        self.sweep_id = uuid.uuid4().hex
        self.control = ControlFile(Path(args.output_dir))
        for name, overrides in trials.items():
            self._add(name, overrides or {})

    @property
    def early_stopping(self):
        """The first stopping rule (None without one); ``rules`` holds them all."""
        return self.rules[0] if self.rules else None

    @early_stopping.setter
    def early_stopping(self, rule) -> None:
        self.rules = [] if rule is None else list(rule) if isinstance(rule, (list, tuple)) else [rule]
        self._check_rules()

    def _check_rules(self, trials: list | None = None) -> None:
        """Refuse a stopping rule that a trial's ``logging_steps`` would leave without values (the rules'
        ``check_logging``: ValueError naming the trial); the metric's name is checked at the first update."""
        trials = list(self.trials.values()) if trials is None else trials
        for rule in self.rules:
            check = getattr(rule, "check_logging", None)
            if check is not None:
                check(trials)

    # ------------------------------------------------------------------ construction helpers
    def _make_engine(self):
        from rapidfire_hf.rollout import RolloutEngine
        from rapidfire_hf.rollout.engine import choose_decode_path

        stop = self.tok.eos_token_id if self.args.stop_token == "eos" else self.args.stop_token_id
        # the batched decode runs the native forward, or the model's own forward over the engine's cache (the
        # generic path: the bank's routed layers run inside it, so each row still goes through its trial's
        # adapter); only a model neither runs falls back to one model.generate per trial
        path, reason = choose_decode_path(self.model)
        if path is None:
            logger.warning(
                "PPOSweep: one model.generate per trial (the batched decode cannot run it: %s)", reason
            )
        elif path == "generic":
            logger.info(
                "PPOSweep: the batched decode runs the model's own forward (generic path: %s)", reason
            )
        return RolloutEngine(
            self.model,
            self.tok.pad_token_id,
            [stop] if stop is not None else [],
            # rollout_backend: "hf" is model.generate per trial; "static" for a model it cannot run was
            # refused at construction (ppo/settings_check.py); "auto" takes the batched decode where it runs
            backend="hf" if path is None or self.args.rollout_backend == "hf" else "static",
            decode_mode=self.args.rollout_decode_mode,
            # the generic path runs the model's own attention: the sweep's SDPA default is not asked of it
            decode_attention=(
                self.args.rollout_decode_attention
                if path == "generic"
                else sweep_decode_attention(self.args.rollout_decode_attention)
            ),
            decode_sampler=self.args.rollout_decode_sampler,
            # "auto" is off here: no sweep benchmark ran with fused projections, and layers carrying the
            # trials' adapters on q/k/v or gate/up keep their modules anyway
            decode_fuse_projections=self.args.rollout_decode_fuse_projections is True,
            decode_linear=self.args.rollout_decode_linear,
            # an 8-bit cache off the native path was refused at construction (ppo/settings_check.py)
            kv_cache_dtype=engine_kv_cache_dtype(self.args.rollout_kv_cache_dtype),
        )

    def _add(self, name: str, overrides: dict, source: Trial | None = None, parent_overrides=None) -> Trial:
        """A new trial (a clone with ``source``); all or nothing: on an error nothing is left behind."""
        check_trial_name(name)
        if name in self.trials:
            raise ValueError(f"a trial named {name!r} exists already: choose another name")
        merged = {**(parent_overrides or {}), **(overrides or {})}
        args = trial_args(self.args, merged, name)
        self._check_rules([_Probe(name, args, num_updates(args, len(self.train_dataset)))])
        funcs = self.phases.reward_funcs
        if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
            raise ValueError(
                f"trial {name!r}: reward_weights has {len(args.reward_weights)} entries for {len(funcs)} reward "
                "functions: give one weight per function."
            )
        slot = f"t{self._slots}"
        self._slots += 1
        try:
            trial = build_trial(
                name, args, merged, self.bank, slot, self.hidden_size, self.device, len(self.train_dataset), source
            )  # fmt: skip
        except Exception:
            if slot in self.bank.slots:
                self.bank.remove(slot)
            raise
        self.trials[name] = trial
        return trial

    def _drop(self, name: str) -> None:
        trial = self.trials.pop(name)
        self.bank.remove(trial.slot)

    # ------------------------------------------------------------------ controls
    def stop(self, name: str, reason: str = "stopped") -> None:
        """Stop a trial at the next update boundary (its state is kept; :meth:`resume` continues it)."""
        self._control(("stop", name, reason))

    def resume(self, name: str) -> None:
        """Let a stopped trial run again from where it stopped."""
        self._control(("resume", name))

    def clone(self, src: str, new: str, **overrides) -> None:
        """A new trial ``new`` from ``src``'s current adapter, value head and optimizer state, with overrides.

        The name and the overrides are checked now (ValueError); the clone is made at the next boundary.
        """
        source = self._trial(src)
        check_trial_name(new)
        if new in self.trials:
            raise ValueError(f"a trial named {new!r} exists already: choose another name")
        args = trial_args(self.args, {**source.overrides, **overrides}, new)
        self._check_rules([_Probe(new, args, num_updates(args, len(self.train_dataset)))])
        self._control(("clone", src, new, overrides))

    def _control(self, op: tuple) -> None:
        trial = self._trial(op[1])  # a bad name fails at the call, not later
        if not self._training:
            self._apply(op)
            return
        at = trial.state.global_step
        queued = {"op": "queued", "cmd": _jsonable(op), "at": at}
        if self.journal.known(queued):  # taken by the run that was killed: waiting among the due decisions
            return
        self.journal.record(queued)  # on disk before the call returns: a kill now keeps it
        self._pending.append((op, at))

    def _trial(self, name: str) -> Trial:
        if name not in self.trials:
            raise KeyError(f"no trial named {name!r}; trials: {', '.join(self.trials)}")
        return self.trials[name]

    def _apply(self, op: tuple, extras: dict | None = None, reason: str | None = None) -> None:
        """Apply one command. Raises ValueError (or KeyError) when it cannot be applied; then nothing changed.

        During training the change is journaled (``decisions.jsonl``, on disk) before this returns, with
        ``extras`` saying where the command came from; ``reason`` replaces a stop's reason."""
        kind, name = op[0], op[1]
        trial = self._trial(name)
        at = trial.state.global_step
        if kind == "stop":
            if trial.status != "running":
                raise ValueError(f"trial {name!r} is {trial.status}, not running: nothing to stop")
            status = "early_stopped" if op[2] == "early_stopped" else "stopped"
            trial.status, trial.reason = status, reason or op[2]
            entry = {"op": "stop", "trial": name, "at": at, "status": status, "reason": trial.reason}
        elif kind == "resume":
            if trial.status not in ("stopped", "early_stopped"):
                raise ValueError(f"trial {name!r} is {trial.status}: only a stopped trial can be resumed")
            trial.status, trial.reason, trial.pinned = "running", "", True
            entry = {"op": "resume", "trial": name, "at": at}
        elif kind == "clone":
            clone = self._add(op[2], op[3], source=trial, parent_overrides=trial.overrides)
            try:  # checkpointed at once: a resume restores it from this state, never from its seed
                ckpt.save_trial(self, clone)
                ckpt.write_index(self)
            except Exception:
                self._drop(op[2])
                raise
            entry = {"op": "clone", "trial": name, "new": op[2], "overrides": op[3], "at": at}
        else:
            raise ValueError(f"unknown command {kind!r}")
        if self._training:
            self.journal.record({**entry, **(extras or {})})
        logger.info("PPOSweep: %s", " ".join(str(x) for x in op))

    def _note(self, message: str) -> None:
        logger.warning("PPOSweep: %s", message)
        self.messages = [*self.messages, message][-20:]

    def _boundary(self) -> None:
        """Apply what arrived since the last update: commands from the control file, then Python calls.

        A command that cannot be applied is logged (with its line of the control file) and skipped."""
        if self._replay is not None:  # what came from outside in this round of the killed run, in its order
            replayed = []
            for e in self._replay.due_now(self._rounds):
                if e["op"] == "queued":
                    replayed.append(("a Python call (replayed)", tuple(e["cmd"]), {"cmd": e["cmd"], "queued_at": e["at"]}))
                else:
                    replayed.append((f"{self.control.path.name} (replayed)", command_of(e), {"offset": e["offset"]}))
        held = self._replay is not None and self._rounds < self._replay.last_round
        read = [] if held else self.control.read()
        commands = [(f"{self.control.path.name} line {line}", op, {"offset": end}) for line, op, end in read]
        pending, self._pending = self._pending, []
        calls = [("a Python call", op, {"cmd": _jsonable(op), "queued_at": at}) for op, at in pending]
        if self._replay is not None:
            known = {json.dumps(c[2], sort_keys=True) for c in replayed}
            calls = [c for c in calls if json.dumps(c[2], sort_keys=True) not in known]  # queued again by a callback
            commands = replayed + commands
        for where, op, extras in commands + calls:
            try:
                self._apply(op, extras)
            except Exception as err:  # noqa: BLE001 - a command never ends the run; the error is reported
                text = " ".join(str(err).split())[:300] or type(err).__name__
                self._note(f"ignored `{' '.join(str(x) for x in op[:3])}` from {where}: {text}")
                if "cmd" in extras:
                    self.journal.record({"op": "ignored", "cmd": extras["cmd"], "at": extras["queued_at"]})
        if self.control.offset > self._control_recorded:  # refused lines are never read again
            self.journal.record({"op": "control", "offset": self.control.offset})
            self._control_recorded = self.control.offset

    def _resume(self, folder: Path) -> None:
        """Restore the sweep's last complete save and read back its decision journal (the replay then takes
        the killed run's decisions again at the same rounds), or, without a journal, the latest checkpoints.

        Raises:
            SweepCheckpointError: nothing to resume from (no journal and no checkpoint), a damaged file.
            JournalError: a damaged journal line (named).
        """
        entries = read_journal(folder) if (folder / ckpt.INDEX).is_file() else None
        sweep_id = ckpt.read_index(folder)["sweep_id"] if entries else None
        if entries and entries[0].get("sweep_id") != sweep_id:
            logger.warning("PPOSweep: %s belongs to another sweep than %s: not replayed", folder / JOURNAL, ckpt.INDEX)
            entries = None
        def has_checkpoint(name: str, step: int) -> bool:
            # a folder removed by save_total_limit sends the resume to an earlier save; a damaged checkpoint
            # or a vanished trial folder is the checkpoint reader's to judge (an older one, or the trial damaged)
            trial_dir = folder / "trials" / name
            return not trial_dir.is_dir() or (trial_dir / f"checkpoint-{step}").is_dir()

        replay = Replay(entries, has_checkpoint) if entries else None
        if replay is not None:
            replay.restore_cut(folder, lambda path: _written_by(path, sweep_id))
        restored = ckpt.load_sweep(self, folder)
        if replay is None:
            if not restored:
                raise ckpt.SweepCheckpointError(
                    f"nothing to resume in {folder}: no trial has a complete checkpoint (the sweep stopped before "
                    f"its first save; save_steps={self.args.save_steps}); start it again without resuming"
                )
            statuses = {n: [t.status, t.reason, t.pinned] for n, t in self.trials.items()}
            self.journal.start(self.sweep_id, self.control.offset, statuses)
            self._control_recorded = self.control.offset
            self._rounds = self.journal.round = max(t.state.global_step for t in self.trials.values())
            return
        for name, step in replay.steps.items():
            trial = self.trials.get(name)
            if trial is not None and trial.status not in ("diverged", ckpt.DAMAGED) and trial.state.global_step != step:
                logger.warning(
                    "PPOSweep: trial %s resumes from update %d, not from the sweep's last complete save (update %d): "
                    "its checkpoint of that save was refused or removed. It runs its missing updates again behind "
                    "the others; a stopping rule may judge it at other rounds than before", name,
                    trial.state.global_step, step,
                )  # fmt: skip
        if not restored:
            logger.warning(
                "PPOSweep: no trial of %s had a checkpoint yet: every trial starts again from update 1, and the "
                "sweep's decisions (%s) are taken again at the same updates", folder, JOURNAL,
            )  # fmt: skip
        if folder.resolve() != Path(self.args.output_dir).resolve():  # continue the journal where we write
            self.journal.start(self.sweep_id, 0, entries[0].get("statuses") or {})
            for e in entries[1:]:
                self.journal.record(e)
        self.journal.replayed(entries[1:])
        self._replay = replay
        self._rounds = self.journal.round = replay.round
        self.control.seek(replay.control_offset)
        self._control_recorded = self.control.offset
        for index, decision in replay.decisions:
            if 0 <= index < len(self.rules) and isinstance(getattr(self.rules[index], "decisions", None), list):
                if decision not in self.rules[index].decisions:
                    self.rules[index].decisions.append(decision)
        replay.start(self.trials)
        self._pending = list(replay.pending)

    def _save_all(self) -> None:
        """Checkpoint every trial not saved at its update, write the index, then journal the save: the state a
        resume starts from (every trial at this round, with its status)."""
        ckpt.save_sweep(self)
        index = json.loads((Path(self.args.output_dir) / ckpt.INDEX).read_text(encoding="utf-8"))
        self.journal.record({
            "op": "saved",
            "steps": {n: t.state.global_step for n, t in self.trials.items()},
            "statuses": {n: [t.status, t.reason, t.pinned] for n, t in self.trials.items()},
            "index": index,
        })  # fmt: skip

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: bool | str | None = None) -> dict[str, SweepResult]:
        """Run every trial to its number of updates (or until stopped); returns ``{name: SweepResult}``.

        Raises:
            SweepError: a failure shared by every trial (the reward function raised, a checkpoint could not
                be written); every trial's state, log history and the summary were saved first.
            SweepCheckpointError: ``resume_from_checkpoint`` names a damaged checkpoint or index (named);
                nothing was restored.
        """
        check_unchanged(self._args_snapshot, self.args, "PPOSweep")
        _check_writable(Path(self.args.output_dir))
        if resume_from_checkpoint:
            self._resume(Path(self.args.output_dir if resume_from_checkpoint is True else resume_from_checkpoint))
        elif (Path(self.args.output_dir) / ckpt.INDEX).exists():
            logger.warning(
                "PPOSweep: %s holds an earlier sweep's checkpoints; this run starts afresh and overwrites "
                "them trial by trial (train(resume_from_checkpoint=True) continues them instead)",
                self.args.output_dir,
            )
        self._training, self._start = True, time.perf_counter()
        progress = outputs.SweepProgress(self) if self.show_progress else None
        with StopSignals("PPOSweep") as signals:
            try:
                ckpt.write_index(self)  # from the start: a kill before the first save still leaves the sweep
                if not resume_from_checkpoint:  # every decision from now on is on disk the moment it is taken
                    statuses = {n: [t.status, t.reason, t.pinned] for n, t in self.trials.items()}
                    self.journal.start(self.sweep_id, self.control.offset, statuses)
                    self._control_recorded = self.control.offset
                    self._save_all()  # round 0: where a resume starts before the first save (the index too)
                outputs.write_state(self, "running")
                self._dispatch("on_train_begin")
                if resume_from_checkpoint:  # the rules of the round of the save, as the killed run applied them
                    self._apply_rules()
                while True:
                    self._phase, self._clean = "applying control commands", True
                    self._boundary()
                    active = [t for t in self.trials.values() if t.active]
                    if not active:
                        break
                    self._round(active)
                    self._apply_rules()
                    if progress is not None:
                        progress.update()
                    outputs.write_state(self, "running")
                    if signals.requested:  # Ctrl-C or SIGTERM: every trial is at a boundary now
                        self._stop_for_signal(signals.requested)
            except BaseException as err:
                self._fail(err)
                raise
            finally:
                self._training = False
                self.trackers.close()
                if progress is not None:
                    progress.close()
        for t in self.trials.values():
            if t.done and t.status == "running":
                t.status = "finished"
        self._dispatch("on_train_end")
        self._save_all()
        outputs.write_all(self, status="finished")
        return self.results()

    def _apply_rules(self) -> None:
        """Stop the trials the stopping rules name; each cut is journaled before it is applied, each stop as
        it is applied (a resume keeps the cut), then the index records them."""
        self._phase = "the stopping rules"
        stopped = False
        for index, rule in enumerate(self.rules):
            decisions = getattr(rule, "decisions", None)
            known = len(decisions) if isinstance(decisions, list) else 0
            cut = rule.check(self.trials)
            for decision in (decisions or [])[known:]:  # the rule's record first: a stop without it is re-made
                self.journal.record({"op": "rule", "rule": index, "decision": decision})
            for name, why in cut:
                if self.trials[name].status == "running":
                    self._apply(("stop", name, "early_stopped"), reason=why)
                    logger.info("PPOSweep: stopped %s: %s", name, why)
                    stopped = True
        if stopped:
            ckpt.write_index(self)

    def _stop_for_signal(self, signal_name: str) -> None:
        """At an update boundary after SIGINT/SIGTERM: checkpoint every trial, write the outputs, then raise
        :class:`TrainingInterrupted` naming the folder."""
        self._phase = "the checkpoints after an interrupt"
        self._save_all()
        outputs.write_all(self, status="interrupted")
        raise TrainingInterrupted(
            f"PPOSweep stopped by {signal_name} at an update boundary; {self._checkpoints_note()}; continue with "
            "train(resume_from_checkpoint=True) (rapidfire sweep SWEEP.yaml --resume)",
            Path(self.args.output_dir),
        )

    def _checkpoints_note(self) -> str:
        """Which trial checkpoints exist now (written or read by this process), in words."""
        saved = {n: t.saved_step for n, t in self.trials.items() if t.saved_step is not None}
        out = Path(self.args.output_dir) / "trials"
        if not saved:
            return (
                f"no trial checkpoint exists in {out} yet (the first is written at update {self.args.save_steps}, "
                "save_steps): a resume has nothing to continue from"
            )
        steps = sorted(set(saved.values()))
        shown = str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        return f"checkpoints of {len(saved)} of {len(self.trials)} trials (update {shown}) are in {out}"

    def _fail(self, err: BaseException) -> None:
        """Save what can be saved after a failure shared by every trial, then raise :class:`SweepError`
        (an interrupt, e.g. Ctrl-C, is re-raised as it is by the caller)."""
        if isinstance(err, TrainingInterrupted):  # stopped at a boundary: everything was saved
            return
        steps = sorted({t.state.global_step + 1 for t in self.trials.values() if t.active})
        update = "-".join(str(s) for s in (steps[:1] + steps[-1:] if len(steps) > 1 else steps)) or "?"
        try:
            if self._clean:  # every trial is at an update boundary: its checkpoint is a state to resume
                self._save_all()
            else:  # killed inside the PPO epochs: the weights are between two updates, not a resumable state
                ckpt.write_index(self)
            outputs.write_all(self, status="failed" if isinstance(err, Exception) else "interrupted")
            saved = f"log histories and summary.json were saved; {self._checkpoints_note()}"
        except Exception as save_err:  # noqa: BLE001 - the original error is the one to raise
            saved = f"saving the sweep's state failed too ({type(save_err).__name__}: {save_err})"
        if not isinstance(err, Exception):
            logger.warning("PPOSweep: interrupted at update %s: %s", update, saved)
            return
        raise SweepError(
            f"the sweep failed at update {update}, in {self._phase}: {type(err).__name__}: "
            f"{' '.join(str(err).split())[:500]}. {saved[0].upper()}{saved[1:]} ({self.args.output_dir}); once fixed, "
            "continue with train(resume_from_checkpoint=True)."
        ) from err

    def _round(self, active: list[Trial]) -> None:
        """One update of every active trial: batched rollout, scoring and PPO epochs, then per-trial logs.

        A trial whose weights, rewards, values, log-probs or losses are not finite leaves the round as
        ``diverged``; the others go on as if it had never been there."""
        self._phase = "the check of the adapters"
        active = self._keep_finite(active, [_params_problem(t) for t in active], "before the rollout")
        if not active:
            return
        self._phase = "the throughput plan"
        self._plan(active)
        t0 = time.perf_counter()
        self._phase = "the rollout"
        batches = [self._prompts(t) for t in active]
        rollouts = self.phases.rollout(active, batches)
        t1 = sync_time(self.device)
        self._phase = "scoring (reference log-probs, values, rewards)"
        exps = self.phases.score(active, rollouts)
        keep = self._keep_finite(active, [_experience_problem(e) for e in exps], "after scoring")
        exps = [e for t, e in zip(active, exps) if t in keep]
        active = keep
        if not active:
            return
        t2 = sync_time(self.device)
        self._phase, self._clean = "the PPO epochs", False
        stats = self.phases.optimize(active, exps)
        t3 = sync_time(self.device)
        self._phase = "the update's metrics"
        skipped = {t.name: _skips(t) for t in active}  # the guards' flags, one host read per trial
        problems = [
            t.step_error or _stats_problem(st) or _skips_problem(skipped[t.name]) or _params_problem(t)
            for t, st in zip(active, stats)
        ]
        keep = self._keep_finite(active, problems, "in the PPO epochs")
        logged = []
        for trial, exp, st in zip(active, exps, stats):
            if trial not in keep:
                continue
            trial.state.episode += trial.args.local_batch_size
            metrics = trial_metrics(trial, exp, st, (t0, t1, t2, t3), self.tok.eos_token_id, self._start)
            if not self._metrics_checked:  # a rule's metric must be among what the trials log
                check_metric_logged(self.rules, metrics, trial.name)
                self._metrics_checked = True
            metrics["rapidfire/skipped_steps"] = skipped[trial.name]  # as PPOTrainer logs it
            metrics["rapidfire/oom_splits"] = self.phases.oom_splits  # of the shared training forwards
            metrics.update(self._plan_logs)
            s = trial.state
            s.global_step += 1
            s.epoch = s.global_step / trial.prompt_order.batches_per_pass
            trial.scheduler.step()
            every = max(1, int(trial.args.logging_steps))
            log = s.global_step % every == 0 or trial.done
            if log:
                s.log_history.append({**metrics, "epoch": s.epoch, "step": s.global_step})
            logged.append((trial, metrics if log else None))
        self._plan_logs = {}
        self._clean = True  # every trial is at an update boundary again
        self._rounds = self.journal.round = self._rounds + 1
        self._phase = "the callbacks and checkpoints"
        for trial, metrics in logged:
            self._dispatch("on_step_end", trial)
            if metrics is not None:
                self._dispatch("on_log", trial, logs=metrics)
                self.trackers.log(trial, metrics, trial.state.global_step)
            if trial.control.should_training_stop:
                trial.control.should_training_stop = False
                self._control(("stop", trial.name, "callback"))
        a = self.args  # every trial saved at the same round: the resume point of the whole sweep
        if a.save_strategy == "steps" and a.save_steps and self._rounds % int(a.save_steps) == 0:
            self._save_all()

    def plan(self) -> Plan:
        """The throughput plan for the next update of the active trials, made without training (one probe
        forward of one row); what ``rapidfire sweep SWEEP.yaml --plan`` prints. ``train()`` then keeps it
        until the trials' rows change.

        Raises:
            ValueError: no trial is active (every one is finished or stopped).
        """
        active = [t for t in self.trials.values() if t.active]
        if not active:
            raise ValueError("no active trial to plan for: every trial is finished or stopped")
        self.planner.update(self.phases, active, self.args, self.prompt_width)
        return self.planner.plan

    def _plan(self, active: list[Trial]) -> None:
        """The sweep's throughput plan for this update's trials (``sweep/planning.py``): printed as a table
        the first time, one line when it changes; its values go to the trackers with the update."""
        plan = self.planner.update(self.phases, active, self.args, self.prompt_width)
        if plan is None:
            return
        if self.planner.plans == 1:
            print(plan.table(), flush=True)
        else:
            logger.info(SweepPlanner.describe(plan, len(active)))
        self._plan_logs = plan.metrics()

    def _keep_finite(self, trials: list[Trial], problems: list[str | None], when: str) -> list[Trial]:
        """The trials without a problem; the others are marked ``diverged`` with the update and the check."""
        keep = []
        for trial, problem in zip(trials, problems):
            if problem is None:
                keep.append(trial)
                continue
            trial.status = "diverged"
            trial.reason = f"update {trial.state.global_step + 1}: {problem} ({when})"
            self._note(
                f"trial {trial.name} diverged at {trial.reason}; it stops and is never saved "
                "(its earlier checkpoints are kept), the other trials continue"
            )
        return keep

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


# what each tensor of a scored rollout says when it is not finite
_EXPERIENCE_CHECKS = (
    ("scores", "non-finite rewards (objective/scores)"),
    ("values", "non-finite values (the value head)"),
    ("logprobs", "non-finite log-probs of the sampled tokens (the adapter)"),
    ("ref_logprobs", "non-finite reference log-probs (the base model)"),
    ("advantages", "non-finite advantages"),
    ("returns", "non-finite returns"),
)
_LOSS_STATS = ("pg_loss", "vf_loss", "approx_kl")


def _first_bad(tensors: list[torch.Tensor], names: list[str]) -> str | None:
    """The name of the first tensor holding a NaN or infinity (one host sync for all of them)."""
    finite = torch.stack([t.isfinite().all() for t in tensors]).tolist()
    return next((n for n, ok in zip(names, finite) if not ok), None)


def _experience_problem(exp) -> str | None:
    adv = exp.adv
    return _first_bad([getattr(adv, k) for k, _ in _EXPERIENCE_CHECKS], [m for _, m in _EXPERIENCE_CHECKS])


def _stats_problem(stats: PPOStats) -> str | None:
    bad = _first_bad([getattr(stats, k) for k in _LOSS_STATS], list(_LOSS_STATS))
    return None if bad is None else f"non-finite {bad}"


def _skips(trial: Trial) -> int | ConsecutiveSkipsError:
    """Optimizer steps the trial's guard skipped so far, or the error of a run of too many in a row."""
    try:
        return trial.health.skipped()
    except ConsecutiveSkipsError as err:
        return err


def _skips_problem(skipped: int | ConsecutiveSkipsError) -> str | None:
    if not isinstance(skipped, ConsecutiveSkipsError):
        return None
    return " ".join(str(skipped).split()).split(". ")[0]  # "... skipped N optimizer steps in a row ..."


def _params_problem(trial: Trial) -> str | None:
    n = len(trial.params) - len(list(trial.value_head.parameters()))
    bad = _first_bad(list(trial.params), ["adapter"] * n + ["value head"] * (len(trial.params) - n))
    return None if bad is None else f"non-finite {bad} weights"


def _full_mask(model) -> bool:
    """Whether ``model`` gets the 4-D mask: always on SDPA models, where with the 2-D one transformers
    switches to ``is_causal`` attention for a chunk without padding, so a trial's arithmetic would depend
    on its neighbours' rows; never on others (flash attention takes only the 2-D mask)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"


class _Probe:
    """What a stopping rule's ``check_logging`` reads of a trial about to be made."""

    def __init__(self, name: str, args: PPOConfig, num_updates: int):
        self.name, self.args, self.num_updates = name, args, num_updates


def _written_by(folder: Path, sweep_id: str) -> bool:
    """Whether the checkpoint ``folder`` was written by the sweep ``sweep_id`` (unreadable: no)."""
    try:
        return ckpt.read_meta(folder)["sweep_id"] == sweep_id
    except Exception:  # noqa: BLE001 - a damaged folder is not proven ours: left alone
        return False


def _check_writable(folder: Path) -> None:
    """Refuse an output folder that cannot be created or written, before anything is read or trained.

    Raises:
        ValueError: naming the folder and the system's reason.
    """
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        shown = str(folder) if len(str(folder)) <= 120 else f"{str(folder)[:60]}... ({len(str(folder))} characters)"
        raise ValueError(
            f"output_dir {shown} cannot be written ({err.strerror or err}): give a folder that can be created and "
            "written (the sweep keeps its checkpoints, index and decisions there)"
        ) from None


def _jsonable(op: tuple) -> list:
    """A command as its journal line holds it (JSON has lists, not tuples)."""
    return [dict(x) if isinstance(x, dict) else x for x in op]
