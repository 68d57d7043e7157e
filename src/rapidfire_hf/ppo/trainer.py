"""PPOTrainer: TRL 1.12's PPO, in TRL's style, written for speed.

One update: rollout (``rapidfire_hf.rollout``) -> scoring (reference log-probs, values, rewards, all
no-grad in large batches) -> advantages (``rapidfire_hf.ppo.core``) -> ``num_ppo_epochs`` x
mini-batches x micro-batches of the clipped PPO loss. Statistics stay on the device and reach the
host once per update; nothing calls ``empty_cache`` or ``.item()`` per micro-batch.

This module holds the construction and the loop; the phases are mixins: the rollout
(``ppo/rollout_phase.py``), scoring (``ppo/scoring.py``), the optimisation pass
(``ppo/optimization.py``), out-of-memory recovery (``ppo/recovery.py``), reporting
(``ppo/reporting.py``) and the construction helpers (``ppo/setup.py``).
"""

from __future__ import annotations

import math
import time

import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin
from transformers import TrainerCallback, TrainerControl
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import PrinterCallback

from rapidfire_hf.ppo import checkpoint as ckpt
from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.memory_options import PromptPrefetch
from rapidfire_hf.ppo.optimization import OptimizationMixin
from rapidfire_hf.ppo.planning import plan_run
from rapidfire_hf.ppo.recovery import OOMRecoveryMixin
from rapidfire_hf.ppo.reporting import ReportingMixin
from rapidfire_hf.ppo.rollout_phase import RolloutMixin
from rapidfire_hf.ppo.scoring import ScoringMixin
from rapidfire_hf.ppo.setup import SetupMixin, _disable_dropout, _split_value_head_model
from rapidfire_hf.ppo.speedups import check_liger_usable
from rapidfire_hf.ppo.types import Experience, PPOTrainerState, Rollout, _sync_time, _to_float
from rapidfire_hf.utils.logs import apply_logging_config

__all__ = ["Experience", "PPOTrainer", "PPOTrainerState", "Rollout", "_disable_dropout"]


class PPOTrainer(RolloutMixin, ScoringMixin, OptimizationMixin, OOMRecoveryMixin, ReportingMixin, SetupMixin):
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
        self.args = args
        self.processing_class = tok = processing_class
        self._check_inputs(
            tok, model, ref_model, reward_model, reward_funcs, optimizer, optimizers, value_model
        )
        self.stop_token_id = tok.eos_token_id if args.stop_token == "eos" else args.stop_token_id
        self.pad_token_id = tok.pad_token_id

        # A plugin, not gradient_accumulation_steps=: with the latter accelerate reads
        # ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which `accelerate launch` sets to "auto" from a DeepSpeed
        # config and int() rejects (seen under ZeRO-2/3 on 2x H200); DeepSpeed's "auto" is then filled
        # from this plugin at prepare().
        self.accelerator = Accelerator(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.micro_batches_per_step),
            mixed_precision=optimizer_precision(args, optimizer if optimizer is not None else optimizers[0]),
            cpu=args.use_cpu,
            # torch_compile compiles per decoder layer (_make_module); accelerate's whole-model compile (from
            # ACCELERATE_DYNAMO_BACKEND, e.g. `accelerate launch --dynamo_backend`) would compile it twice
            **({"dynamo_backend": "no"} if args.torch_compile else {}),
        )
        self._use_liger = args.use_liger_kernel or fused_kernels_requested(
            optimizer if optimizer is not None else optimizers[0], self.accelerator.device
        )
        if self._use_liger:  # fail before any model is copied or moved
            check_liger_usable(self.accelerator.device)
        self._check_generation_gather()
        self.rf_config = self._load_rapidfire_config(args.rapidfire_config)
        # Created before any model reaches the GPU, so expandable segments cover every allocation.
        self.memory_callback = self._make_memory_callback()

        model, given_head = _split_value_head_model(model, value_model)
        policy = self._apply_peft(model, peft_config)
        self.is_peft = hasattr(policy, "peft_config")
        self._train_adapter = self._select_adapters(policy, ref_model)
        self.ref_model = self._make_reference(policy, ref_model)
        self.reward_model = self._maybe_quantize(
            reward_model, args.reward_model_quantization, "reward_model_quantization"
        )
        self.reward_funcs = self._reward_functions(reward_funcs)
        module = self._make_module(policy, value_model, given_head)  # dropout off, kernels patched
        self._prepare_prompts(policy, train_dataset, eval_dataset, data_collator)
        self.optimizer, self.lr_scheduler = self._make_optimizer(module, optimizer, optimizers)
        self._prepare_models(module)  # self.model, the prepared module; frozen models on the device

        acc = self.accelerator
        self.precision_plugin = self._make_precision_plugin()
        self.state = PPOTrainerState(
            is_local_process_zero=acc.is_local_main_process, is_world_process_zero=acc.is_main_process
        )
        self.control = TrainerControl()
        self.callback_handler = self._make_callback_handler(callbacks)
        self._perm_generator = torch.Generator().manual_seed(args.seed)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._oom_recovery = None  # built at the first micro-batch (rapidfire_hf.memory.OOMRecovery)
        self._telemetry_seen: dict[str, int] = {}
        self._rollout_engine = None
        self.plan = None  # the throughput plan, made at the first update (ppo/planning.py)
        from rapidfire_hf.distributed import attach_sync_debug, describe_engine

        self.engine_support = describe_engine(acc)  # says which features hold under DDP/ZeRO/FSDP
        attach_sync_debug(self)  # only when RAPIDFIRE_SYNC_DEBUG=1
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

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
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if hasattr(inner, "disable_pipeline"):
            inner.disable_pipeline()

    def enable_pipeline(self):
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        if hasattr(inner, "enable_pipeline"):
            inner.enable_pipeline()

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model).policy

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: str | bool | None = None):
        """Run PPO for ``num_updates`` updates (``max_steps`` or ``total_episodes`` worth of prompts)."""
        args, acc = self.args, self.accelerator
        start_update = 0
        if resume_from_checkpoint:
            start_update = ckpt.load(self, resume_from_checkpoint)
        self.state.max_steps = self.num_updates
        self.state.logging_steps = args.logging_steps
        self.state.save_steps = args.save_steps
        self.state.num_train_epochs = math.ceil(self.num_updates / self.prompt_order.batches_per_pass)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        self._train_start = time.perf_counter()
        self._prompts = PromptPrefetch.for_trainer(self, start_update)  # memory.prefetch_window
        apply_logging_config(self.rf_config)  # logging.level (also for a config given by enable_rapidfire)
        for update in range(start_update, self.num_updates):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            metrics = self._one_update(update)
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
                ckpt.save(self)
                self.control = self.callback_handler.on_save(args, self.state, self.control)
            if self.control.should_training_stop:
                break
        self._prompts = None
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        acc.wait_for_everyone()
        return self.state

    def _one_update(self, update: int) -> dict:
        args, acc = self.args, self.accelerator
        t0 = time.perf_counter()
        batch = self._next_batch(update)
        planned_now = self.plan is None
        if planned_now:  # memory.optimization as a target: micro-batches, chunks, checkpointing
            plan_run(self, batch["input_ids"])
        rollout = self.rollout(batch)
        t1 = _sync_time(acc.device)
        exp = self.score(rollout)
        if self.precision_plugin is not None and not self.precision_plugin.calibration_done:
            self._calibrate_precision(exp)
        t2 = _sync_time(acc.device)
        if self.memory_callback is not None:  # rollout -> training: release the generation/scoring blocks
            self.memory_callback.phase_boundary("rollout", "train", step=update)
        stats = self.optimize(exp)
        t3 = _sync_time(acc.device)
        self.state.episode += args.local_batch_size * acc.num_processes
        metrics = self._metrics(exp, stats, (t0, t1, t2, t3))
        metrics["rapidfire/skipped_steps"] = self._skipped_steps()
        if planned_now and self.plan.planned:
            metrics.update(self.plan.metrics())
        if self._rf_opt is not None:  # predicted clip coefficients checked, and the share that missed
            opt_stats = self._rf_opt.stats()
            metrics["rapidfire/clip_miss_rate"] = opt_stats["clip_misses"] / max(1, opt_stats["clip_checks"])
        self._to_telemetry(update + 1, metrics)
        every = max(1, self.num_updates // args.num_sample_generations) if args.num_sample_generations else 0
        if every and update % every == 0:
            if self.eval_dataset is not None:  # every rank generates (collectives under ZeRO-3/FSDP2)
                self.generate_completions(sampling=True)
            elif acc.is_main_process:
                self.show_samples(exp)
        return metrics

    def save_model(self, output_dir: str | None = None, dataset_name: str | None = None) -> None:
        """Save the policy where ``from_pretrained(output_dir)`` finds it, with the tokenizer, the value
        model or head beside it, ``training_args.bin`` and a model card (``rapidfire_hf.ppo.export``)."""
        from rapidfire_hf.ppo.export import save_for_hub

        save_for_hub(self, output_dir or self.args.output_dir, dataset_name)

    def push_to_hub(self, commit_message: str = "End of training", dataset_name: str | None = None) -> str:
        """Save to ``args.output_dir`` and upload it to ``args.hub_model_id``; returns the commit URL."""
        from rapidfire_hf.ppo.export import push_to_hub

        return push_to_hub(self, commit_message, dataset_name)
