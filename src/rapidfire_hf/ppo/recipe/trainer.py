"""PPOTrainer: TRL 1.12's PPO, in TRL's style, written for speed.

One update: rollout (``rapidfire_hf.rollout``) -> scoring (reference log-probs, values, rewards, all
no-grad in large batches) -> advantages (``rapidfire_hf.ppo.core``) -> ``num_ppo_epochs`` x
mini-batches x micro-batches of the clipped PPO loss. Statistics stay on the device and reach the
host once per update; nothing calls ``empty_cache`` or ``.item()`` per micro-batch.

The trainer holds explicit components and calls them; one update is :meth:`PPOTrainer.one_update`:

* ``roller`` (:class:`~rapidfire_hf.ppo.rollout_phase.Roller`): prompts -> :class:`Rollout`;
* ``scorer`` (:class:`~rapidfire_hf.ppo.scoring.Scorer`): :class:`Rollout` -> :class:`Experience`;
* ``epochs`` (:class:`~rapidfire_hf.ppo.optimization.PPOEpochs`): :class:`Experience` -> statistics, each
  micro-batch stepped by
* ``stepper`` (:class:`~rapidfire_hf.ppo.stepper.Stepper`): the optimizer, its step health
  (:class:`~rapidfire_hf.optim.step_health.StepHealth`), clipping and the OOM split policy;
* ``reporter`` (:class:`~rapidfire_hf.ppo.reporting.Reporter`): metrics, sample tables, telemetry.

Construction helpers are in ``ppo/recipe/setup.py``.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from transformers import TrainerCallback, TrainerControl
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import PrinterCallback

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.phase_offload import PhaseOffload
from rapidfire_hf.memory.phase_peaks import PhasePeaks
from rapidfire_hf.memory.stats import release_cached_memory
from rapidfire_hf.optim.optimizer import RapidFireOptimizer
from rapidfire_hf.ppo.config import PPOConfig, load_rapidfire_config
from rapidfire_hf.ppo.optimization import PPOEpochs, calibrate_precision
from rapidfire_hf.ppo.recipe import checkpoint as ckpt
from rapidfire_hf.ppo.recipe.frozen_auto import after_new_config, decide_frozen, resolved_bits
from rapidfire_hf.ppo.recipe.memory_options import PromptPrefetch, prefetch_window
from rapidfire_hf.ppo.recipe.planning import PlanInputs, plan_run, unplanned_run
from rapidfire_hf.ppo.recipe.setup import (
    _split_value_head_model,
    apply_peft,
    check_generation_gather,
    check_inputs,
    make_callback_handler,
    make_memory_callback,
    make_module,
    make_optimizer,
    make_reference,
    maybe_quantize,
    prepare_models,
    prepare_prompts,
    reward_functions,
    select_adapters,
)
from rapidfire_hf.ppo.recipe.start_report import start_facts, start_lines
from rapidfire_hf.ppo.recovery import NoGradChunks
from rapidfire_hf.ppo.reporting import Reporter
from rapidfire_hf.ppo.rollout_phase import Roller, rollout_backend
from rapidfire_hf.ppo.scoring import Scorer
from rapidfire_hf.ppo.seeds import permutation_generator, sampling_generator
from rapidfire_hf.ppo.settings_check import (
    check_trainer_kv_cache,
    check_trainer_settings,
    check_unchanged,
    start_notes,
)
from rapidfire_hf.ppo.speedups import check_liger_usable
from rapidfire_hf.ppo.stepper import StepEvents, Stepper
from rapidfire_hf.ppo.types import (
    Experience,
    PPOStats,
    PPOTrainerState,
    Rollout,
    RunState,
    TrainedParts,
    _to_float,
    sync_time,
)
from rapidfire_hf.utils.interrupt import StopSignals, TrainingInterrupted
from rapidfire_hf.utils.logs import LogCadence, apply_logging_config
from rapidfire_hf.utils.start_table import start_table

logger = logging.getLogger("rapidfire_hf.ppo.trainer")  # PPOTrainer's logger: one name for its messages

# Experience, PPOTrainerState and Rollout are defined in ppo/types.py (import them from there); they stay
# importable from here for callers that still do (sweep/phases.py) and TRL-style `ppo_trainer.Rollout`.
__all__ = ["Experience", "PPOTrainer", "PPOTrainerState", "Rollout"]


class PPOTrainer:
    """Proximal Policy Optimization with a value model (or a fused value head) and KL-shaped rewards.

    Args:
        args: a :class:`PPOConfig`.
        processing_class: the tokenizer (needs a pad token distinct from any stop token you use).
        model: the policy, a transformers causal LM (optionally wrapped by PEFT, or use ``peft_config``).
        ref_model: frozen reference policy; ``None`` copies the policy, or uses the adapter-disabled
            base when training LoRA (no copy).
        reward_model: a sequence-classification model scoring prompt+response; exclusive with ``reward_funcs``.
        reward_funcs: a callable or list of callables ``f(prompts, completions, completion_ids, **columns) ->
            list[float]``, as in TRL's GRPOTrainer.
        value_model: a sequence-classification model with one label; ``None`` with ``value_mode='fused'``.
        train_dataset: prompts, as a ``prompt`` text column or ``input_ids``.
        optimizer: an optimizer (e.g. ``RapidFireOptimizer(lr=...)`` without parameters: it is bound to
            the policy and value parameters here). Exclusive with ``optimizers``.
        optimizers: ``(optimizer, lr_scheduler)`` as in ``transformers.Trainer``.

    Example:
        >>> trainer = PPOTrainer(args=PPOConfig(output_dir="out"), processing_class=tok, model=policy,
        ...                      ref_model=None, reward_funcs=my_reward, value_model=value, train_dataset=ds)
        >>> trainer.train()
    """

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class=None,
        model=None,
        ref_model=None,
        reward_model=None,
        train_dataset=None,
        value_model=None,
        data_collator=None,
        eval_dataset=None,
        optimizer=None,
        optimizers=(None, None),
        callbacks: list[TrainerCallback] | None = None,
        peft_config=None,
        reward_funcs=None,
        **legacy,
    ):
        from rapidfire_hf.ppo.compat import (
            fused_kernels_requested,
            legacy_trainer_arguments,
            optimizer_precision,
        )

        args, processing_class = legacy_trainer_arguments(args, processing_class, model, legacy)
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a rapidfire_hf.PPOConfig, got {type(args).__name__}")
        # the settings contract: every field applied or refused by name before any model moves
        check_trainer_settings(args, model, optimizer if optimizer is not None else optimizers[0])
        self.args = args
        self._args_snapshot = args.snapshot()  # train() refuses a field changed after construction
        self.processing_class = tok = processing_class
        check_inputs(
            args, tok, model, ref_model, reward_model, reward_funcs, optimizer, optimizers, value_model
        )
        self.stop_token_id = tok.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        self.pad_token_id = tok.pad_token_id

        # A plugin, not gradient_accumulation_steps=: with the latter accelerate reads
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which `accelerate launch` sets to "auto" from a DeepSpeed
        # config and int() rejects (seen under ZeRO-2/3 on 2x H200); DeepSpeed's "auto" is then filled
        # from this plugin at prepare().
        self.accelerator = acc = Accelerator(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.micro_batches_per_step),
            mixed_precision=optimizer_precision(args, optimizer if optimizer is not None else optimizers[0]),
            cpu=args.use_cpu,
            # torch_compile compiles per decoder layer (make_module); accelerate's whole-model compile (from
            # ACCELERATE_DYNAMO_BACKEND, e.g. `accelerate launch --dynamo_backend`) would compile it twice
            **({"dynamo_backend": "no"} if args.torch_compile else {}),
        )
        self._use_liger = args.use_liger_kernel or fused_kernels_requested(
            optimizer if optimizer is not None else optimizers[0], acc.device
        )
        if self._use_liger:  # fail before any model is copied or moved
            check_liger_usable(acc.device)
        check_generation_gather(args, acc)
        # the rollout's path is known once the device and the engine are: an 8-bit KV cache it cannot keep
        # is refused by name before any model moves
        check_trainer_kv_cache(args, model, acc)
        self.rf_config = load_rapidfire_config(args.rapidfire_config)
        # Created before any model reaches the GPU, so expandable segments cover every allocation.
        self.memory_callback = self._make_memory_callback()
        chunks = NoGradChunks(acc.device)  # generation and scoring: smaller after an OOM
        self.phase_peaks = PhasePeaks(acc.device)  # measured beside the plan's per-phase prediction
        self.scorer = Scorer(args, acc, tok, self.pad_token_id, self.stop_token_id, chunks)
        self.stepper = Stepper(
            acc,
            max_grad_norm=args.max_grad_norm,
            max_oom_splits=args.max_oom_splits,
            max_consecutive_skips=args.max_consecutive_skips,
            # the precision plugin observes the clipped gradients once it is set (``precision_plugin``)
            events=StepEvents(self._before_optimizer_step, None, self._after_optimizer_step),
            release=self._release_after_oom,
        )

        model, given_head = _split_value_head_model(model, value_model)
        policy = apply_peft(model, peft_config, args.seed)
        self.is_peft = hasattr(policy, "peft_config")
        self._train_adapter = select_adapters(args, policy, ref_model, self.is_peft)
        prompts = prepare_prompts(
            args, acc, tok, self.pad_token_id, policy, train_dataset, eval_dataset, data_collator
        )
        # "auto" frozen precision: planned for this card before the frozen models are copied or quantized
        self.frozen_choice = decide_frozen(
            args, self.rf_config.memory if self.rf_config is not None else None, policy, reward_model,
            self.is_peft, acc.device, prompts.train_dataset,
        )  # fmt: skip
        ref_bits, reward_bits = resolved_bits(
            args, self.frozen_choice, self.is_peft, reward_model is not None
        )
        self.ref_model = make_reference(args, policy, ref_model, self.is_peft, acc.device, ref_bits)
        self.reward_model = maybe_quantize(reward_model, reward_bits, "reward_model_quantization", acc.device)
        self.reward_funcs = reward_functions(args, reward_funcs)
        module, self.kernel_patches = make_module(  # dropout off, kernels patched
            args, acc, policy, value_model, given_head, self.ref_model, self.reward_model, self._use_liger
        )
        self.train_dataset, self.eval_dataset = prompts.train_dataset, prompts.eval_dataset
        self.data_collator, self.prompt_order = prompts.data_collator, prompts.prompt_order
        self.num_updates = prompts.num_updates
        self.optimizer, self.lr_scheduler = self._make_optimizer(module, optimizer, optimizers)
        self.model, self.optimizer, self.ref_model, self.reward_model = prepare_models(
            args, acc, module, self.optimizer, self.ref_model, self.reward_model
        )
        self.stepper.attach(self.model)

        self.precision_plugin = self._make_precision_plugin()
        self.state = PPOTrainerState(
            is_local_process_zero=acc.is_local_main_process, is_world_process_zero=acc.is_main_process
        )
        self.control = TrainerControl()
        self.callback_handler = make_callback_handler(
            args, self.memory_callback, callbacks, self.model, tok, self.optimizer, self.lr_scheduler
        )
        self._perm_generator = permutation_generator(args.seed)  # the rule of ppo/seeds.py
        self.plan = (
            None  # the throughput plan, made at the first update (ppo/recipe/planning.py, plan_update)
        )
        self.checkpointing = None  # the activation checkpointing the plan applied (None: none)
        # tests: host offload moves CPU tensors too (memory.phase_offload)
        self.host_offload_include_cpu = False
        self.offload = None  # what moves to host memory between the phases, set by the plan
        self._prompts: PromptPrefetch | None = None  # prompt batches prefetched while train() runs
        self._log_cadence: LogCadence | None = None  # at the first log (enable_rapidfire sets rf_config)
        self._train_start: float | None = None  # train()'s start (or one_update()'s first, outside train())
        self._config_applied = False  # apply_rapidfire_config() ran (once only)
        from rapidfire_hf.distributed import attach_sync_debug, describe_engine

        self.engine_support = describe_engine(acc)  # says which features hold under DDP/ZeRO/FSDP
        attach_sync_debug(self)  # only when RAPIDFIRE_SYNC_DEBUG=1
        self.roller = Roller(
            args, acc, self.model, self.pad_token_id, self.stop_token_id, self.kernel_patches,
            self.engine_support, chunks,
        )  # fmt: skip
        self.scorer.model, self.scorer.train_adapter = self.model, self._train_adapter
        self.epochs = PPOEpochs(args, acc, self.model, self.pad_token_id, self.stepper, self._perm_generator)
        self.reporter = Reporter(acc, tok)
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    # ------------------------------------------------------------------ built from the rapidfire config
    # (methods: apply_rapidfire_config rebuilds these on a built trainer, for enable_rapidfire)
    def _make_memory_callback(self):
        return make_memory_callback(self.args, self.rf_config)

    def _make_optimizer(self, module, optimizer, optimizers):
        """``(optimizer, scheduler)`` for ``module`` (``ppo/setup.make_optimizer``)."""
        optimizer, scheduler, self._optimizer_is_default, self.state_decision = make_optimizer(
            self.args, self.rf_config, self.accelerator, module, optimizer, optimizers, self.num_updates,
            frozen=(self.ref_model, self.reward_model),
        )  # fmt: skip
        return optimizer, scheduler

    @property
    def precision_plugin(self):
        """The :class:`~rapidfire_hf.precision.AdaptivePrecisionPlugin` (None: precision.mode static). Setting it
        registers its ``observe_gradients`` with the stepper (after clipping, before each step); None
        registers nothing."""
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is not None and not callable(getattr(plugin, "observe_gradients", None)):
            raise TypeError(
                "PPOTrainer.precision_plugin must be an AdaptivePrecisionPlugin (attached to this trainer) or "
                f"None, got {type(plugin).__name__}"
            )
        self._precision_plugin = plugin
        self.stepper.events.gradients_ready = plugin.observe_gradients if plugin is not None else None

    def _make_precision_plugin(self):
        """The adaptive precision plugin when the rapidfire config asks for it (precision.mode adaptive)."""
        cfg = self.rf_config
        if cfg is None or to_plain(cfg.precision.mode) != "adaptive":
            return None
        from rapidfire_hf.precision import AdaptivePrecisionPlugin
        from rapidfire_hf.precision.schedule import accelerator_precision

        # The trainer's forward runs under accelerator.autocast(), i.e. in the precision of PPOConfig's
        # bf16/fp16: that is the base precision, and precision.initial cannot change it from here (as in
        # enable_rapidfire). Starting the plugin elsewhere would only warn a user who can do nothing about it.
        initial = accelerator_precision(self.accelerator)
        if initial != cfg.precision.initial.value:
            logger.info(
                "rapidfire: precision.initial=%s but PPOConfig runs in %s (its bf16/fp16 arguments); using %s",
                cfg.precision.initial.value,
                initial,
                initial,
            )
        plugin = AdaptivePrecisionPlugin.from_config(cfg, initial=initial)
        compact = (lambda: self.memory_callback.compact("precision_rule")) if self.memory_callback else None
        return plugin.attach(
            self.accelerator,
            self.accelerator.unwrap_model(self.model),
            self.optimizer,
            compact_memory=compact,
            handlers={"disable_pipeline": self.disable_pipeline, "enable_pipeline": self.enable_pipeline},
        )

    @property
    def rapidfire_config_applied(self) -> bool:
        """Whether :meth:`apply_rapidfire_config` ran on this trainer (it runs once)."""
        return self._config_applied

    def apply_rapidfire_config(self, config: Any = None) -> None:
        """Apply a rapidfire config to this trainer before it trains: the same result as
        ``PPOConfig(rapidfire_config=...)`` (what ``enable_rapidfire(trainer, config)`` does on a PPOTrainer).

        The parts the config acts on at construction are rebuilt from it: the memory callback, the
        optimizer and its LR scheduler (when the trainer built its default one; an optimizer the user passed
        is kept) and the adaptive-precision plugin.

        Args:
            config: a ``RapidFireConfig``, preset name, YAML path or dict; ``None`` = balanced.

        Raises:
            ConfigError: the config is invalid, or asks what this trainer does not apply (the settings
                contract, ``rapidfire_hf.config.contract``).
        """
        from rapidfire_hf.config import load_config
        from rapidfire_hf.config.contract import TRAINER, raise_refusals
        from rapidfire_hf.ppo.settings_check import check_trainer_config

        cfg = load_config(config)
        own = None if self._optimizer_is_default else getattr(self.optimizer, "optimizer", self.optimizer)
        raise_refusals(check_trainer_config(self.args, {} if config is None else config, own), TRAINER)
        self.rf_config = cfg
        self.args.rapidfire_config = cfg
        self._replace_memory_callback()
        if self._optimizer_is_default:
            self._rebuild_optimizer()
        else:
            logger.info(
                "rapidfire: PPOTrainer keeps the optimizer passed to it; config.gradient applies to it only "
                "if it is a RapidFireOptimizer built with those settings"
            )
        self.precision_plugin = self._make_precision_plugin()
        self.frozen_choice = after_new_config(  # built with the trainer: a different choice now is said
            self.frozen_choice, self.args, cfg.memory, self.policy, self.reward_model, self.is_peft,
            self.accelerator.device, self.train_dataset,
        )  # fmt: skip
        self._config_applied = True

    def _replace_memory_callback(self) -> None:
        old = self.memory_callback
        if old is not None:
            self.callback_handler.remove_callback(old)
        self.memory_callback = self._make_memory_callback()
        if self.memory_callback is not None:
            self.callback_handler.add_callback(self.memory_callback)

    def _rebuild_optimizer(self) -> None:
        """A config-built optimizer and scheduler in place of the default AdamW, prepared like the first."""
        acc = self.accelerator
        old = self.optimizer
        if old in acc._optimizers:
            acc._optimizers.remove(old)
        module = acc.unwrap_model(self.model)
        optimizer, scheduler = self._make_optimizer(module, None, (None, None))
        self.optimizer = acc.prepare(optimizer)
        self.lr_scheduler = scheduler
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = scheduler

    # ------------------------------------------------------------------ public controls
    def add_callback(self, callback):
        self.callback_handler.add_callback(callback)

    def remove_callback(self, callback):
        self.callback_handler.remove_callback(callback)

    def remove_progress_callbacks(self):
        """Drop transformers' tqdm/printer callbacks (for callers that draw their own progress)."""
        for cb in (DEFAULT_PROGRESS_CALLBACK, PrinterCallback):
            self.callback_handler.remove_callback(cb)

    def disable_pipeline(self):
        """Turn the optimizer's gradient pipeline off (a no-op for optimizers without one)."""
        if self.rapidfire_optimizer is not None:
            self.rapidfire_optimizer.disable_pipeline()

    def enable_pipeline(self):
        if self.rapidfire_optimizer is not None:
            self.rapidfire_optimizer.enable_pipeline()

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model).policy

    @property
    def optimizer(self):
        """The optimizer (accelerate's wrapper once prepared); owned by :attr:`stepper`."""
        return self.stepper.optimizer

    @optimizer.setter
    def optimizer(self, optimizer) -> None:
        self.stepper.optimizer = optimizer  # its step health follows (enable_rapidfire may replace it)

    @property
    def offload(self) -> PhaseOffload | None:
        """What moves to host memory between the phases of an update (``memory.phase_offload``; set by the
        plan, ``host_offload``); the scorer and the stepper wait for what they read."""
        return self._offload

    @offload.setter
    def offload(self, offload: PhaseOffload | None) -> None:
        self._offload = offload
        self.scorer.ready = offload.ready if offload is not None else None
        self.stepper.before_window_step = offload.before_step if offload is not None else None

    def _all_on_device(self) -> None:
        """Every offloaded weight and the optimizer state back (before a checkpoint reads them, after train())."""
        if self._offload is not None:
            self._offload.close()

    @property
    def ref_model(self):
        """The separate frozen reference policy, or None (LoRA: the adapter-disabled policy); the scorer's."""
        return self.scorer.ref_model

    @ref_model.setter
    def ref_model(self, model) -> None:
        self.scorer.ref_model = model

    @property
    def reward_model(self):
        """The reward model, or None (``reward_funcs`` score); the scorer's."""
        return self.scorer.reward_model

    @reward_model.setter
    def reward_model(self, model) -> None:
        self.scorer.reward_model = model

    @property
    def reward_funcs(self) -> list:
        """The reward functions (empty with a reward model); the scorer's."""
        return self.scorer.reward_funcs

    @reward_funcs.setter
    def reward_funcs(self, funcs: list) -> None:
        self.scorer.reward_funcs = funcs

    @property
    def rapidfire_optimizer(self) -> RapidFireOptimizer | None:
        """The RapidFireOptimizer being trained with, or None (a plain optimizer, guarded)."""
        return self.stepper.health.rapidfire

    @property
    def run_state(self) -> RunState:
        """What this run holds and has done so far, read-only (:class:`~rapidfire_hf.ppo.types.RunState`):
        the rollout backend and how its decode steps ran, OOM splits, trained parameters. Read by ``rapidfire
        demo`` and benchmark scripts."""
        engine, params = self.roller.engine, self.stepper.params
        copy_bytes = getattr(engine, "copy_bytes", None)
        return RunState(
            rollout_backend=getattr(engine, "backend", None),
            fused_copy_bytes=copy_bytes() if copy_bytes is not None else None,
            oom_splits=self.stepper.oom_splits,
            # ZeRO-3 leaves each parameter an empty placeholder; ds_numel is its full size
            trainable_parameters=sum(getattr(p, "ds_numel", p.numel()) for p in params),
            trainable_dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.") for p in params})),
            decode_mode_ran=engine.decode_mode_ran if engine is not None else None,
            decode_fallbacks=engine.decode_fallbacks if engine is not None else (),
        )

    def trained_parts(self) -> TrainedParts:
        """What saving, exporting and resuming read (``ppo/recipe/checkpoint.py``, ``ppo/recipe/export.py``), as they are now."""
        return TrainedParts(
            args=self.args, accelerator=self.accelerator, module=self.accelerator.unwrap_model(self.model),
            tokenizer=self.processing_class, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            state=self.state, ref_model=self.ref_model, reward_model=self.reward_model,
            num_train_prompts=len(self.train_dataset), permutation=self._perm_generator,
        )  # fmt: skip

    def plan_inputs(self) -> PlanInputs:
        """What the throughput plan reads of this trainer (``ppo/recipe/planning.py``), as it is now."""
        return PlanInputs(
            args=self.args, accelerator=self.accelerator, module=self.accelerator.unwrap_model(self.model),
            model=self.model, memory=self.rf_config.memory if self.rf_config is not None else None,
            optimizer=self.optimizer, state_decision=getattr(self, "state_decision", None),
            is_peft=self.is_peft, use_liger=self._use_liger, pad_token_id=self.pad_token_id,
            engine_support=self.engine_support, engine=self.roller.engine, ref_model=self.ref_model,
            reward_model=self.reward_model, host_offload_include_cpu=self.host_offload_include_cpu,
            frozen_choice=self.frozen_choice,
        )  # fmt: skip

    def plan_update(self, queries: torch.Tensor):
        """Measure, plan and apply the run's throughput plan for prompts like ``queries``
        (:func:`~rapidfire_hf.ppo.recipe.planning.plan_run`; at the first update); returns the plan, kept as ``plan``."""
        planned = plan_run(self.plan_inputs(), queries)
        # the pieces of a split micro-batch run in its window (OOM recovery's split, planned up front)
        self.stepper.planned_splits = planned.plan.splits
        self.offload = planned.offload  # what moves to host memory between the phases
        self.plan = planned.plan
        self.checkpointing = None if planned.plan.checkpointing == "none" else planned.plan.checkpointing
        return planned.plan

    # ------------------------------------------------------------------ the phases
    def next_prompts(self, batch_index: int) -> dict:
        """The collated prompt batch number ``batch_index`` of this rank (the seeded prompt order)."""
        rows = [self.train_dataset[i] for i in self.prompt_order.indices(batch_index)]
        return self.data_collator(rows)

    def rollout(self, batch: dict, sampling: bool = True) -> Rollout:
        """Generate responses for a batch of prompts with the current policy (greedy when not ``sampling``)."""
        plan = self.plan or unplanned_run(self.plan_inputs(), batch["input_ids"].shape[1])
        generator = None
        if sampling:  # the noise of this update, from (seed, update, rank) alone (ppo/seeds.py)
            generator = sampling_generator(
                self.args.seed, self.state.global_step, self.accelerator.process_index
            )
        # the precision probe's layer hooks record only under gradients: off while generating
        unprobed = self.precision_plugin.unprobed() if self.precision_plugin is not None else nullcontext()
        with unprobed:
            rollout = self.roller.rollout(
                batch,
                plan.generation_rows,
                sampling,
                generator,
                fuse_projections=bool(plan.fuse_projections),
                kv_cache_dtype=plan.engine_kv_cache_dtype,
            )
        if plan.free_cache:  # the plan gave the kept cache's memory to bigger generation chunks
            self.roller.engine.release()
        return rollout

    def score(self, rollout: Rollout) -> Experience:
        """Reference log-probs, values and scores of a rollout, then KL-shaped rewards and advantages."""
        plan = self.plan or unplanned_run(self.plan_inputs(), rollout.queries.shape[1])
        if self._offload is not None:  # the frozen models' weights in (each model waits for its own)
            self._offload.before_scoring()
        return self.scorer.score(rollout, plan.scoring_rows)

    def optimize(self, exp: Experience, permutations: list[torch.Tensor] | None = None) -> PPOStats:
        """``num_ppo_epochs`` passes of mini-batch PPO over a scored rollout. Returns device-side statistics
        (:class:`~rapidfire_hf.ppo.types.PPOStats`).

        Args:
            exp: the scored rollout.
            permutations: one row order per epoch (default: drawn from the trainer's seeded generator).
        """
        if self.plan is None:  # optimize() called outside train(): plan (and apply) now
            self.plan_update(exp.rollout.queries)
        if self._offload is not None:  # the optimizer state in on a side stream (waited for before the step)
            self._offload.before_training()
        return self.epochs.optimize(exp, self.plan.train_rows, permutations)

    # ------------------------------------------------------------------ the stepper's events
    def _before_optimizer_step(self) -> None:
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def _after_optimizer_step(self) -> None:
        self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)

    def _release_after_oom(self) -> int:
        """Cached memory back to the device after an OOM (through the memory callback when there is one)."""
        if self.memory_callback is not None:
            return self.memory_callback.compact("oom_split")
        return release_cached_memory(collect_garbage=True)

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: str | bool | None = None):
        """Run PPO for ``num_updates`` updates (``max_steps`` or ``total_episodes`` worth of prompts)."""
        args, acc = self.args, self.accelerator
        check_unchanged(self._args_snapshot, args, "PPOTrainer")
        start_update = 0
        if resume_from_checkpoint:
            self.state = ckpt.load(self.trained_parts(), resume_from_checkpoint)
            start_update = self.state.global_step
        self.state.max_steps = self.num_updates
        self.state.logging_steps = args.logging_steps
        self.state.save_steps = args.save_steps
        self.state.num_train_epochs = math.ceil(self.num_updates / self.prompt_order.batches_per_pass)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._train_start = time.perf_counter()
        self._prompts = PromptPrefetch(
            self.next_prompts, start_update, self.num_updates, prefetch_window(self.rf_config), acc.device
        )
        apply_logging_config(self.rf_config)  # logging.level (also for a config given by enable_rapidfire)
        self._print_start_table()
        saved, saved_at = None, None  # the last checkpoint this loop wrote, and its update
        with StopSignals("PPOTrainer") as signals:
            try:
                for update in range(start_update, self.num_updates):
                    self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                    metrics = self.one_update(update)
                    self.state.global_step = update + 1
                    self.state.epoch = (update + 1) / self.prompt_order.batches_per_pass
                    self.lr_scheduler.step()
                    self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                    if self.precision_plugin is not None:
                        self.precision_plugin.on_step_end(
                            update + 1,
                            {
                                "loss": metrics["loss/policy_avg"] + args.vf_coef * metrics["loss/value_avg"],
                                "throughput": metrics["tokens_per_second"],
                                "approx_kl": metrics["policy/approxkl_avg"],
                            },
                        )
                    if self.control.should_log:
                        self.log({k: _to_float(v) for k, v in metrics.items()})
                    if self.control.should_save:
                        self._all_on_device()
                        saved, saved_at = ckpt.save(self.trained_parts()), update + 1
                        self.control = self.callback_handler.on_save(args, self.state, self.control)
                    if self.control.should_training_stop:
                        break
                    if self._stop_requested(signals):
                        self._stop_for_signal(signals.requested, saved if saved_at == update + 1 else None)
            except KeyboardInterrupt as err:
                if not isinstance(err, TrainingInterrupted):  # abandoned mid-update: say what stands
                    logger.warning("PPOTrainer: %s", self._abandoned_note())
                raise
        self._prompts = None
        self._all_on_device()
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        acc.wait_for_everyone()
        return self.state

    def _stop_requested(self, signals: StopSignals) -> bool:
        """Whether a SIGINT/SIGTERM asked to stop, agreed by every process (each then saves the same update)."""
        if self.accelerator.num_processes == 1:
            return signals.requested is not None
        flag = torch.tensor([0 if signals.requested is None else 1], device=self.accelerator.device)
        return bool(self.accelerator.reduce(flag, reduction="sum").item())

    def _stop_for_signal(self, signal_name: str | None, saved) -> None:
        """Checkpoint the update just finished (unless saved already), then raise :class:`TrainingInterrupted`
        naming the folder."""
        if saved is None:
            self._all_on_device()
            saved = ckpt.save(self.trained_parts())
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        raise TrainingInterrupted(
            f"PPOTrainer stopped by {signal_name or 'a signal of another process'} after update "
            f"{self.state.global_step}; checkpoint saved in {saved}; continue with "
            "train(resume_from_checkpoint=True)",
            saved,
        )

    def _abandoned_note(self) -> str:
        """What a resume would start from after an update was abandoned (the weights are between two)."""
        last = ckpt.latest_checkpoint(self.args.output_dir)
        where = (
            f"the latest checkpoint is {last}" if last is not None
            else f"no checkpoint was written in {self.args.output_dir}: a resume has nothing to continue from"
        )  # fmt: skip
        return f"update {self.state.global_step + 1} abandoned (interrupted twice); {where}"

    def _print_start_table(self) -> None:
        """Once per ``train()``, on the main process: what is on, what is off and why (quiet at
        ``logging.level`` warning / error)."""
        cfg = self.rf_config
        if not self.accelerator.is_main_process or (
            cfg is not None and cfg.logging.level.value in ("warning", "error")
        ):
            return
        facts = start_facts(
            self.args, cfg, self.policy, self.accelerator.unwrap_model(self.model).fused,
            getattr(self.optimizer, "optimizer", self.optimizer),  # inside accelerate's wrapper
            self.rapidfire_optimizer, self.precision_plugin, self.memory_callback, self.kernel_patches,
            rollout_backend(self.args, self.engine_support), self.accelerator.device,
        )  # fmt: skip
        on, skipped, watched = start_lines(facts)
        on += start_notes(self.args, cfg, self.rapidfire_optimizer, str(self.accelerator.mixed_precision))
        on += [self.frozen_choice.line()] if self.frozen_choice is not None else []
        print(start_table("rapidfire PPOTrainer:", on, skipped, watched), flush=True)

    def one_update(self, update: int) -> dict:
        """Rollout -> scoring -> PPO epochs over prompt batch ``update``; returns the update's metrics.

        ``train()`` runs one per update; called alone (a profiler's warm-up) it plans the run at its first call
        and counts throughput from there."""
        args, device = self.args, self.accelerator.device
        if self._train_start is None:
            self._train_start = time.perf_counter()
        t0 = time.perf_counter()
        batch = self._prompts.take(update) if self._prompts is not None else self.next_prompts(update)
        planned_now = self.plan is None
        if planned_now:  # memory.optimization as a target: micro-batches, chunks, checkpointing
            self.plan_update(batch["input_ids"])
        if self._offload is not None:  # the frozen weights and the optimizer state are not read here
            self._offload.before_generation()
        with self.phase_peaks.phase("generation"):
            rollout = self.rollout(batch)
        t1 = sync_time(device)
        with self.phase_peaks.phase("scoring"):
            exp = self.score(rollout)
        if self._offload is not None:  # nor the frozen weights in training
            self._offload.after_scoring()
        if self.precision_plugin is not None and not self.precision_plugin.calibration_done:
            self._calibrate_precision(exp)
        t2 = sync_time(device)
        if self.memory_callback is not None:  # rollout -> training: release the generation/scoring blocks
            self.memory_callback.phase_boundary("rollout", "train", step=update)
        with self.phase_peaks.phase("training"):
            stats = self.optimize(exp)
        t3 = sync_time(device)
        self.state.episode += args.local_batch_size * self.accelerator.num_processes
        metrics = self._update_metrics(update, exp, stats, (t0, t1, t2, t3), planned_now)
        self._show_samples_if_due(update, exp)
        return metrics

    def _update_metrics(
        self, update: int, exp: Experience, stats: PPOStats, times, planned_now: bool
    ) -> dict:
        health = self.stepper.health
        metrics = self.reporter.metrics(
            exp, stats, times, episode=self.state.episode, train_start=self._train_start,
            scheduler=self.lr_scheduler, health=health, oom_splits=self.stepper.oom_splits,
        )  # fmt: skip
        if planned_now and self.plan.planned:
            metrics.update(self.plan.metrics())
        metrics.update(self.phase_peaks.metrics())
        if self.memory_callback is not None:
            self.reporter.to_telemetry(update + 1, metrics)
        return metrics

    def _show_samples_if_due(self, update: int, exp: Experience) -> None:
        args = self.args
        every = max(1, self.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
        if every and update % every == 0:
            if self.eval_dataset is not None:  # every rank generates (collectives under ZeRO-3/FSDP2)
                self.generate_completions(sampling=True)
            elif self.accelerator.is_main_process:
                self.show_samples(exp)

    def _calibrate_precision(self, exp: Experience) -> None:
        """The precision plugin's sensitivity pass on a scored rollout (``ppo/optimization.py``)."""
        calibrate_precision(self.precision_plugin, exp, self.args, self.pad_token_id)

    # ------------------------------------------------------------------ reporting
    def show_samples(self, exp: Experience, rows: int = 4) -> None:
        """Print a few prompts, completions and scores of a scored rollout and log them as a table."""
        self._report_completions(self.reporter.completion_rows(exp)[:rows])

    @torch.no_grad()
    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """Complete the eval prompts with the current policy, score them, print the first rows and log them
        as a ``completions`` table to W&B and TensorBoard (when those integrations are active).

        Completions are decoded greedily (TRL 1.12 samples at temperature 0.01 here, nearly the same).

        Args:
            sampling: stop after one eval batch of ``per_device_eval_batch_size`` prompts (TRL's name for
                the call made during training); ``False`` completes the whole eval set.

        Returns:
            One dict per prompt: ``query``, ``model response``, ``score``.
        """
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        size = max(1, int(self.args.per_device_eval_batch_size))
        rows: list[dict] = []
        for start in range(0, len(dataset), size):
            batch = self.data_collator([dataset[i] for i in range(start, min(start + size, len(dataset)))])
            rows += self.reporter.completion_rows(self.score(self.rollout(batch, sampling=False)))
            if sampling:
                break
        if self.accelerator.is_main_process:
            self._report_completions(rows)
        return rows

    def evaluate(self, sampling: bool = False) -> dict[str, float]:
        """Mean reward and completion length of :meth:`generate_completions` on the eval prompts, logged
        under ``eval/`` and returned."""
        rows = self.generate_completions(sampling=sampling)
        tok = self.processing_class
        lengths = [len(tok(r["model response"], add_special_tokens=False)["input_ids"]) for r in rows]
        metrics = {
            "eval/objective/scores": sum(r["score"] for r in rows) / max(len(rows), 1),
            "eval/response_length": sum(lengths) / max(len(lengths), 1),
        }
        self.log(metrics)
        return metrics

    def _report_completions(self, rows: list[dict]) -> None:
        self.reporter.report_completions(rows, self.state.global_step, self.callback_handler.callbacks)

    def log(self, logs: dict[str, float]) -> None:
        """Record ``logs`` and send them to the callbacks; the ``rapidfire/*`` keys only every
        ``logging.log_every`` updates of the rapidfire config (every log without one)."""
        logs = dict(logs)
        if self._log_cadence is None:
            self._log_cadence = LogCadence.from_config(self.rf_config)
        if not self._log_cadence.due(self.state.global_step):
            logs = {k: v for k, v in logs.items() if not k.startswith("rapidfire/")}
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def save_model(self, output_dir: str | None = None, dataset_name: str | None = None) -> None:
        """Save the policy where ``from_pretrained(output_dir)`` finds it, with the tokenizer, the value
        model or head beside it, ``training_args.bin`` and a model card (``rapidfire_hf.ppo.recipe.export``)."""
        from rapidfire_hf.ppo.recipe.export import save_for_hub

        save_for_hub(self.trained_parts(), output_dir or self.args.output_dir, dataset_name)

    def push_to_hub(self, commit_message: str = "End of training", dataset_name: str | None = None) -> str:
        """Save to ``args.output_dir`` and upload it to ``args.hub_model_id``; returns the commit URL."""
        from rapidfire_hf.ppo.recipe.export import push_to_hub

        return push_to_hub(self.trained_parts(), commit_message, dataset_name)
