"""PPOTrainer: TRL 1.12's PPO, in TRL's style, written for speed.

One update: rollout (``rapidfire_hf.rollout``) -> scoring (reference log-probs, values, rewards, all
no-grad in large batches) -> advantages (``rapidfire_hf.ppo.core``) -> ``num_ppo_epochs`` x
mini-batches x micro-batches of the clipped PPO loss. Statistics stay on the device and reach the
host once per update; nothing calls ``empty_cache`` or ``.item()`` per micro-batch.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, GradientAccumulationPlugin
from transformers import TrainerCallback, TrainerControl
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer import DEFAULT_CALLBACKS, DEFAULT_PROGRESS_CALLBACK
from transformers.trainer_callback import CallbackHandler, PrinterCallback

from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.ppo import checkpoint as ckpt
from rapidfire_hf.ppo.config import PPOConfig
from rapidfire_hf.ppo.core import (
    compute_advantages,
    first_true_indices,
    ppo_loss,
    truncate_after_stop,
)
from rapidfire_hf.ppo.data import PromptOrder, collate_prompts, prepare_prompt_dataset, prompt_limits
from rapidfire_hf.ppo.memory_options import PromptPrefetch, setup_checkpointing
from rapidfire_hf.ppo.modeling import (
    PolicyAndValue,
    ValueHead,
    causal_lm_parts,
    check_value_model,
    policy_logprobs,
    reward_model_scores,
    sequence_inputs,
    value_head_dtype,
    value_positions,
)
from rapidfire_hf.ppo.quantized import is_quantized
from rapidfire_hf.ppo.recovery import OOMRecoveryMixin
from rapidfire_hf.ppo.reporting import ReportingMixin
from rapidfire_hf.ppo.rewards import reward_funcs_scores
from rapidfire_hf.ppo.setup import SetupMixin, _split_value_head_model
from rapidfire_hf.ppo.speedups import (
    KernelPatches,
    all_sdpa,
    apply_liger,
    check_liger_usable,
    compile_layers,
)
from rapidfire_hf.ppo.types import _STAT_KEYS, Experience, PPOTrainerState, Rollout, _sync_time, _to_float
from rapidfire_hf.utils.logs import apply_logging_config

logger = logging.getLogger(__name__)


class PPOTrainer(OOMRecoveryMixin, ReportingMixin, SetupMixin):
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
            # torch_compile compiles per decoder layer below; accelerate's whole-model compile (from
            # ACCELERATE_DYNAMO_BACKEND, e.g. `accelerate launch --dynamo_backend`) would compile it twice
            **({"dynamo_backend": "no"} if args.torch_compile else {}),
        )
        self._use_liger = args.use_liger_kernel or fused_kernels_requested(
            optimizer if optimizer is not None else optimizers[0], self.accelerator.device
        )
        if self._use_liger:  # fail before any model is copied or moved
            check_liger_usable(self.accelerator.device)
        self.rf_config = self._load_rapidfire_config(args.rapidfire_config)
        # Created before any model reaches the GPU, so expandable segments cover every allocation.
        self.memory_callback = self._make_memory_callback()

        model, given_head = _split_value_head_model(model, value_model)
        policy = self._apply_peft(model, peft_config)
        self.is_peft = hasattr(policy, "peft_config")
        self.ref_model = self._make_reference(policy, ref_model)
        self.reward_model = self._maybe_quantize(
            reward_model, args.reward_model_quantization, "reward_model_quantization"
        )
        self.reward_funcs = self._as_list(reward_funcs)
        if args.reward_weights is not None and len(args.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(args.reward_weights)} entries but there are {len(self.reward_funcs)} "
                "reward functions: give one weight per function."
            )
        if value_model is not None:
            check_value_model(value_model, policy)
            module = PolicyAndValue(policy, value_model=value_model)
        elif given_head is not None:
            module = PolicyAndValue(
                policy, value_head=given_head.to(value_head_dtype(policy, self.accelerator.mixed_precision))
            )
        elif args.value_mode == "fused":
            head = ValueHead(causal_lm_parts(policy)[0].config.hidden_size)
            module = PolicyAndValue(
                policy, value_head=head.to(value_head_dtype(policy, self.accelerator.mixed_precision))
            )
        else:
            raise ValueError(
                "value_model is None: pass a value model (e.g. AutoModelForSequenceClassification with num_labels=1) "
                "or set PPOConfig(value_mode='fused') to train a value head on the policy."
            )
        for m in (module, self.ref_model, self.reward_model):
            if m is not None:
                _disable_dropout(m)
        if args.gradient_checkpointing:
            policy.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs
            )
        # after the reference copy (a deepcopy of patched or compiled modules is not one) and PEFT
        self.kernel_patches = KernelPatches()
        roles = {"policy": policy, "value_model": value_model, "ref_model": self.ref_model}
        if self._use_liger:
            apply_liger(roles, args.liger_kernel_config, self.kernel_patches, compiled=args.torch_compile)
        if args.torch_compile:
            compile_layers(roles, args.torch_compile_backend, args.torch_compile_mode, self.kernel_patches)
            module.full_mask = all_sdpa(roles)  # one mask kind for the compiled layers: no recompiles

        limits = prompt_limits(policy, args.response_length)  # ids in the vocabulary, prompts that fit
        limits["num_proc"] = args.dataset_num_proc
        self.train_dataset = prepare_prompt_dataset(
            train_dataset, tok, args.dataset_text_field, args.max_prompt_length, **limits
        )
        # As in TRL's PPO, the eval prompts serve the sample tables of `num_sample_generations`.
        self.eval_dataset = None
        if eval_dataset is not None:
            self.eval_dataset = prepare_prompt_dataset(
                eval_dataset,
                tok,
                args.dataset_text_field,
                args.max_prompt_length,
                name="eval_dataset",
                **limits,
            )
        self.data_collator = data_collator or (lambda rows: collate_prompts(rows, self.pad_token_id))
        acc = self.accelerator
        self.prompt_order = PromptOrder(
            len(self.train_dataset),
            args.local_batch_size * acc.num_processes,
            args.seed,
            acc.process_index,
            acc.num_processes,
        )
        total = args.total_episodes or int(args.num_train_epochs * len(self.train_dataset))
        self.num_updates = (
            args.max_steps
            if args.max_steps > 0
            else max(1, math.ceil(total / (args.local_batch_size * acc.num_processes)))
        )

        self.optimizer, self.lr_scheduler = self._make_optimizer(module, optimizer, optimizers)
        ds_plugin = getattr(acc.state, "deepspeed_plugin", None)
        if ds_plugin is not None and ds_plugin.is_auto("train_micro_batch_size_per_gpu"):
            # accelerate reads this from a prepared dataloader; PPO prepares none (prompts are indexed).
            ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        self.model, self.optimizer = acc.prepare(module, self.optimizer)
        for name in ("ref_model", "reward_model"):
            frozen = getattr(self, name)
            if frozen is not None:  # bitsandbytes models are placed at load time and refuse .to()
                setattr(self, name, (frozen if is_quantized(frozen) else frozen.to(acc.device)).eval())

        self.precision_plugin = self._make_precision_plugin()
        self.state = PPOTrainerState(
            is_local_process_zero=acc.is_local_main_process, is_world_process_zero=acc.is_main_process
        )
        self.control = TrainerControl()
        reporting = get_reporting_integration_callbacks(args.report_to)
        progress = PrinterCallback if args.disable_tqdm else DEFAULT_PROGRESS_CALLBACK
        self.callback_handler = CallbackHandler(
            DEFAULT_CALLBACKS
            + reporting
            + [progress]
            + [c for c in [self.memory_callback] if c]
            + list(callbacks or []),
            self.model,
            tok,
            self.optimizer,
            self.lr_scheduler,
        )
        self._perm_generator = torch.Generator().manual_seed(args.seed)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._oom_recovery = None  # built at the first micro-batch (rapidfire_hf.memory.OOMRecovery)
        self._telemetry_seen: dict[str, int] = {}
        self._rollout_engine = None
        from rapidfire_hf.distributed import attach_sync_debug, describe_engine

        self.engine_support = describe_engine(acc)  # says which features hold under DDP/ZeRO/FSDP
        attach_sync_debug(self)  # only when RAPIDFIRE_SYNC_DEBUG=1
        self.control = self.callback_handler.on_init_end(args, self.state, self.control)

    def _calibrate_precision(self, exp: Experience) -> None:
        """The precision plugin's sensitivity pass on the first scored rollouts (its per-layer schedule).

        The pass compares each layer in the low precision with an fp32 reference, so it needs fp32
        weights (mixed precision); with weights stored in bf16/fp16 there is nothing to compare with and
        the schedule stays as configured (said once in the log). It differentiates with
        ``torch.autograd.grad`` only: no ``.grad`` is written, so no optimizer hook fires.
        """
        plugin, args = self.precision_plugin, self.args
        if plugin.calibration_skipped is not None:
            return
        if any(p.dtype != torch.float32 for p in plugin.model.parameters()):
            plugin.calibration_skipped = (
                "the model's weights are not fp32"  # the plugin's own flag: one place
            )
            logger.info("rapidfire: no precision sensitivity pass (%s)", plugin.calibration_skipped)
            return
        ctx = exp.rollout.queries.shape[1]

        def loss_fn(model, batch):  # what training differentiates: log-probs and values of the rollout
            logprobs, values, _ = model(batch["query_responses"], self.pad_token_id, ctx, args.temperature)
            return -logprobs.mean() + args.vf_coef * values.pow(2).mean()

        rows = exp.rollout.query_responses[: args.per_device_train_batch_size]
        plugin.calibrate({"query_responses": rows}, loss_fn=loss_fn)  # logs the schedule when complete

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

    @contextmanager
    def _reference_context(self):
        if self.ref_model is None:
            with self.policy.disable_adapter():
                yield self.policy
        else:
            yield self.ref_model

    # ------------------------------------------------------------------ one update, step by step
    def next_prompts(self, batch_index: int) -> dict:
        rows = [self.train_dataset[i] for i in self.prompt_order.indices(batch_index)]
        return self.data_collator(rows)

    def _next_batch(self, update: int) -> dict:
        """The prompt batch of ``update``: from the prefetcher while ``train()`` runs, else collated now."""
        prompts = getattr(self, "_prompts", None)
        return prompts.take(update) if prompts is not None else self.next_prompts(update)

    def rollout(self, batch: dict, sampling: bool = True) -> Rollout:
        """Generate responses for a batch of prompts with the current policy (greedy when not ``sampling``)."""
        from rapidfire_hf.rollout import RolloutEngine, SamplingParams

        args, device = self.args, self.accelerator.device
        queries = batch["input_ids"].to(device)
        if self._rollout_engine is None:
            stops = [self.stop_token_id] if self.stop_token_id is not None else []
            self._rollout_engine = RolloutEngine(
                self.policy,
                self.pad_token_id,
                stops,
                backend=self._rollout_backend(),
                decode_mode=args.rollout_decode_mode,
            )
        params = SamplingParams(
            max_new_tokens=args.response_length,
            temperature=args.temperature + 1e-7,
            top_k=args.top_k,
            top_p=args.top_p,
            do_sample=sampling,
        )
        # generation runs the policy alone: a separate value model stays sharded (ZeRO-3 / FSDP2)
        # the rollout engine runs the models' own kernels (its decode step is compiled and recorded on its own)
        # rollout_generation_batch_size bounds the KV cache: chunks of prompts, one after the other
        chunk = args.rollout_generation_batch_size or queries.shape[0]

        def generate_rows(start, stop):
            part = queries[start:stop]
            out = self._rollout_engine.generate(part, part != self.pad_token_id, params)
            return out.responses, out.logprobs.float()

        with (
            torch.no_grad(),
            gathered_for_generation(self.accelerator, self.model, self.policy),
            self.kernel_patches.original(),
        ):  # an OOM halves the chunk and retries (ppo/recovery.py)
            parts = self._no_grad_in_chunks(
                generate_rows,
                queries.shape[0],
                chunk,
                "generation",
                "rollout_generation_batch_size",
                on_oom=self._rollout_engine.release,
            )
        responses, logprobs = zip(*parts)
        extra = {k: v for k, v in batch.items() if k != "input_ids"}
        return Rollout(
            queries=queries, responses=torch.cat(responses), logprobs=torch.cat(logprobs), extra=extra
        )

    def _rollout_backend(self) -> str:
        """The configured backend, except "hf" for sharded weights (recorded graphs would keep pointers
        to weights that ZeRO-3/FSDP2 free again after the rollout)."""
        from rapidfire_hf.distributed import Engine

        sharded = self.engine_support.engine in (Engine.ZERO3, Engine.FSDP2)
        return "hf" if sharded and self.args.rollout_backend == "auto" else self.args.rollout_backend

    @torch.no_grad()
    def score(self, rollout: Rollout) -> Experience:
        """Reference log-probs, values and scores of a rollout, then KL-shaped rewards and advantages."""
        args = self.args
        pad, ctx = self.pad_token_id, rollout.queries.shape[1]
        qr = rollout.query_responses
        post = truncate_after_stop(rollout.responses, self.stop_token_id, pad)
        post_qr = torch.cat([rollout.queries, post], dim=1)
        unwrapped = self.accelerator.unwrap_model(self.model)
        step = args.local_rollout_forward_batch_size
        # what scoring runs of the trained module: with a separate reference model, only the value model
        # (a separate 7B policy then stays sharded under ZeRO-3 / FSDP2); the policy too when it is its
        # own reference (LoRA) or carries the value head
        needed = unwrapped.value_model if not unwrapped.fused and self.ref_model is not None else None
        with gathered_for_generation(self.accelerator, self.model, needed), self.accelerator.autocast():

            def score_rows(start, stop):
                chunk = qr[start:stop]
                # only the reference log-probs run with the adapter off (LoRA); the values, from the fused
                # head on the policy's hidden states, need the adapter on, as in training
                with self._reference_context() as ref:
                    lp = policy_logprobs(ref, chunk, pad, ctx, args.temperature, unwrapped.full_mask)
                if self.reward_model is None:
                    return lp, self._values(unwrapped, chunk, ctx), None
                rm = reward_model_scores(self.reward_model, post_qr[start:stop], pad, ctx)
                return lp, self._values(unwrapped, chunk, ctx), rm

            # an OOM halves the forward batch and retries (ppo/recovery.py)
            parts = self._no_grad_in_chunks(
                score_rows, qr.shape[0], step, "scoring", "local_rollout_forward_batch_size"
            )
        ref_lp, values, scores = (list(col) for col in zip(*parts))
        scores = (
            torch.cat(scores) if self.reward_model is not None else self._reward_funcs_scores(rollout, post)
        )
        eos = self.processing_class.eos_token_id
        if args.missing_eos_penalty is not None and eos is not None:
            scores = scores - args.missing_eos_penalty * (~(post == eos).any(-1)).float()
        sequence_lengths = first_true_indices(post == pad) - 1
        adv = compute_advantages(
            rollout.logprobs,
            torch.cat(ref_lp).float(),
            torch.cat(values).float(),
            scores.float(),
            sequence_lengths,
            kl_coef=args.kl_coef,
            kl_estimator=args.kl_estimator,
            gamma=args.gamma,
            lam=args.lam,
            whiten_rewards=args.whiten_rewards,
        )
        return Experience(rollout=rollout, adv=adv, postprocessed_responses=post)

    def _values(self, unwrapped: PolicyAndValue, query_responses, ctx):
        if not unwrapped.fused:
            return value_positions(
                unwrapped.value_model,
                sequence_inputs(query_responses, self.pad_token_id, unwrapped.full_mask),
                ctx,
            )
        decoder, _ = causal_lm_parts(unwrapped.policy)
        hidden = decoder(
            **sequence_inputs(query_responses, self.pad_token_id, unwrapped.full_mask), use_cache=False
        ).last_hidden_state
        return unwrapped.value_head(hidden[:, ctx - 1 : -1])

    def _reward_funcs_scores(self, rollout: Rollout, post: torch.Tensor) -> torch.Tensor:
        tok = self.processing_class
        prompts = tok.batch_decode(rollout.queries, skip_special_tokens=True)
        completions = tok.batch_decode(post, skip_special_tokens=True)
        completion_ids = [row[row != self.pad_token_id].tolist() for row in post.cpu()]
        total = reward_funcs_scores(
            self.reward_funcs, self.args.reward_weights, prompts, completions, completion_ids, rollout.extra
        )  # each function's scores checked (type, shape, count), naming the function
        return total.to(rollout.queries.device)

    def optimize(
        self, exp: Experience, permutations: list[torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``num_ppo_epochs`` passes of mini-batch PPO over a scored rollout. Returns device-side statistics.

        Args:
            exp: the scored rollout.
            permutations: one row order per epoch (default: drawn from the trainer's seeded generator).
        """
        args, acc = self.args, self.accelerator
        qr, ctx = exp.rollout.query_responses, exp.rollout.queries.shape[1]
        n, mb = args.local_batch_size, args.local_mini_batch_size
        shape = (args.num_ppo_epochs, args.num_mini_batches, args.micro_batches_per_step)
        stats = {k: torch.zeros(shape, device=acc.device) for k in _STAT_KEYS}
        self.model.train()
        if not getattr(self, "_checkpointing_set", False):  # memory.optimization, once
            setup_checkpointing(self, qr, ctx)
        if self._oom_recovery is not None:  # memory may differ after the rollout: try whole micro-batches
            self._oom_recovery.reset()
        for epoch in range(args.num_ppo_epochs):
            perm = (
                permutations[epoch]
                if permutations is not None
                else torch.randperm(n, generator=self._perm_generator)
            )
            for m, mb_start in enumerate(range(0, n, mb)):
                self._train_windows(exp, stats, [(epoch, m, perm[mb_start : mb_start + mb])])
        if self._rf_opt is not None and hasattr(self._rf_opt, "verify_now"):
            # the rollout of the next update uses these weights: verify what is still unverified now
            self._train_windows(exp, stats, self._replays(self._rf_opt.verify_now()))
        self._window_rows = {}
        return stats

    def _train_windows(self, exp, stats, windows) -> None:
        """Run optimizer windows ``(epoch, mini-batch, rows)`` in order, and the windows the optimizer
        asks to replay after a rollback (``last_rollback.replay``) before anything new."""
        qr, ctx, adv = exp.rollout.query_responses, exp.rollout.queries.shape[1], exp.adv
        mb, micro = self.args.local_mini_batch_size, self.args.per_device_train_batch_size
        window_rows = self.__dict__.setdefault("_window_rows", {})  # optimizer step -> its window
        queue = list(windows)
        budget = 4 * max(1, self.args.num_ppo_epochs * self.args.num_mini_batches)  # replays per call
        while queue:
            epoch, m, mb_idx = queue.pop(0)
            if self._rf_opt is not None:
                window_rows[self._rf_opt.stats()["steps"]] = (epoch, m, mb_idx)
            for u, start in enumerate(range(0, mb, micro)):
                idx = mb_idx[start : start + micro].to(qr.device)
                out, ent = self._micro_step(qr[idx], ctx, adv, idx)
                values = (out.approx_kl, out.pg_clipfrac, out.pg_loss, out.vf_loss, out.vf_clipfrac, ent)
                for key, value in zip(_STAT_KEYS, (*values, out.ratio_mean)):
                    stats[key][epoch, m, u] = value
            replays = self._replays(getattr(self._rf_opt, "last_rollback", None))
            if replays and budget > 0:
                budget -= len(replays)
                queue[:0] = replays

    def _replays(self, report) -> list:
        """The windows ``(epoch, mini-batch, rows)`` a rollback report asks to run again, in order."""
        if report is None:
            return []
        rows = self.__dict__.get("_window_rows", {})
        return [rows[s] for s in report.replay if s in rows]

    def _micro_step(self, query_responses, ctx, adv, idx):
        """Forward, loss and backward of one micro-batch; the optimizer steps when its window closes.

        A CUDA out-of-memory error splits the micro-batch in halves (recursively, up to
        ``max_oom_splits`` times) with every piece normalised by the whole micro-batch's token counts,
        so the accumulated gradient is the one the whole batch gives and no sample is dropped.
        """
        with self.accelerator.accumulate(self.model):
            out, entropy = self._forward_backward_recovering(query_responses, ctx, adv, idx)
            if self._rf_opt is not None:  # device tensors only: verified at the end of the window
                self._rf_opt.observe_loss(out.loss)
                self._rf_opt.record("approx_kl", out.approx_kl, reduce="max")
            elif self._step_guard is not None:
                self._step_guard.observe_loss(out.loss)
            self._optimizer_step()
        return out, entropy.mean()

    def _forward_backward(self, query_responses, ctx, adv, idx, counts=None):
        args = self.args
        lp, vpred, entropy = self.model(
            query_responses, self.pad_token_id, ctx, args.temperature, with_entropy=True
        )
        out = ppo_loss(
            lp,
            adv.logprobs[idx],
            adv.advantages[idx],
            vpred,
            adv.values[idx],
            adv.returns[idx],
            adv.padding_mask[idx],
            adv.padding_mask_p1[idx],
            cliprange=args.cliprange,
            cliprange_value=args.cliprange_value,
            vf_coef=args.vf_coef,
            counts=counts,
        )
        self.accelerator.backward(out.loss)
        out.loss = out.loss.detach()
        return out, entropy.detach()

    def _to_telemetry(self, step: int, metrics: dict) -> None:
        """Feed `rapidfire monitor`: tokens/s every update, and rollback / OOM-split events as they happen."""
        if self.memory_callback is None:
            return
        from rapidfire_hf.memory import get_telemetry

        telemetry = get_telemetry()
        telemetry.metrics(
            step,
            {
                "tokens_per_s": metrics["tokens_per_second"],
                "kl": metrics["objective/kl"],
                "reward": metrics["objective/scores"],
            },
        )
        seen = self._telemetry_seen
        for key, event in (("rapidfire/rollbacks", "rollback"), ("rapidfire/oom_splits", "oom_split")):
            new = int(metrics.get(key, 0)) - seen.get(key, 0)
            if new > 0:
                telemetry.event(event, step=step, count=new)
                seen[key] = int(metrics[key])

    def _make_step_guard(self):
        """A :class:`NonFiniteGuard` for an optimizer that does not verify its own steps (None for a
        RapidFireOptimizer, under DeepSpeed, whose engine owns the step, and under fp16 loss scaling,
        whose GradScaler already skips non-finite steps)."""
        from rapidfire_hf.optim.guard import NonFiniteGuard

        acc = self.accelerator
        if self._rf_opt is not None or acc.distributed_type == DistributedType.DEEPSPEED:
            return None
        if getattr(acc, "scaler", None) is not None:
            return None
        return NonFiniteGuard(self.args.max_consecutive_skips, owner="PPOTrainer")

    def _skipped_steps(self) -> int:
        """Optimizer steps skipped so far as unhealthy; reads the guard's flags of this update (one host
        read) and raises ConsecutiveSkipsError after ``max_consecutive_skips`` in a row."""
        if self._rf_opt is not None:
            stats = self._rf_opt.stats()
            return stats["skipped"] - stats["clip_misses"]
        if self._step_guard is not None:
            self._step_guard.drain()
            return self._step_guard.skipped
        return 0

    def _optimizer_step(self):
        acc, args = self.accelerator, self.args
        if acc.sync_gradients:
            self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
            grad_norm = None
            if args.max_grad_norm and args.max_grad_norm > 0 and not self._optimizer_clips:
                grad_norm = acc.clip_grad_norm_(self.model.parameters(), args.max_grad_norm)
            if self.precision_plugin is not None:
                self.precision_plugin.observe_gradients()
        if acc.sync_gradients and self._step_guard is not None and self._rf_opt is None:
            # a NaN/inf loss or gradient never reaches the weights (skipped on the device when it can be)
            self._step_guard.step(self.optimizer, self._trainable, grad_norm)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if acc.sync_gradients:
            self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)

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
        rollout = self.rollout(self._next_batch(update))
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


def _disable_dropout(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
