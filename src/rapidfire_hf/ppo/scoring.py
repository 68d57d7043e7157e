"""Scoring for PPOTrainer (a mixin): reference log-probs, values and rewards of a rollout, all without
gradients in large batches, then KL-shaped rewards and advantages (``rapidfire_hf.ppo.core``)."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.ppo.core import compute_advantages, first_true_indices, truncate_after_stop
from rapidfire_hf.ppo.modeling import policy_logprobs, reward_model_scores
from rapidfire_hf.ppo.planning import unplanned_run
from rapidfire_hf.ppo.rewards import reward_funcs_scores
from rapidfire_hf.ppo.types import Experience, Rollout


class ScoringMixin:
    """Scoring of ``PPOTrainer``: a :class:`Rollout` in, an :class:`Experience` out."""

    @contextmanager
    def _reference_context(self):
        """The reference policy: the separate reference model; with LoRA, the policy with the
        ``ref_adapter_name`` adapter active (the training adapter again afterwards), or with its adapters off."""
        if self.ref_model is not None:
            yield self.ref_model
        elif self.args.ref_adapter_name is not None:
            self.policy.set_adapter(self.args.ref_adapter_name)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter(self._train_adapter)
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @torch.no_grad()
    def score(self, rollout: Rollout) -> Experience:
        """Reference log-probs, values and scores of a rollout, then KL-shaped rewards and advantages."""
        args = self.args
        pad, ctx = self.pad_token_id, rollout.queries.shape[1]
        qr = rollout.query_responses
        post = truncate_after_stop(rollout.responses, self.stop_token_id, pad)
        post_qr = torch.cat([rollout.queries, post], dim=1)
        unwrapped = self.accelerator.unwrap_model(self.model)
        step = (self.plan or unplanned_run(self, ctx)).scoring_rows
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
                rm = None
                if self.reward_model is not None:
                    rm = reward_model_scores(self.reward_model, post_qr[start:stop], pad, ctx)
                return lp, unwrapped.values(chunk, pad, ctx), rm

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

    def _reward_funcs_scores(self, rollout: Rollout, post: torch.Tensor) -> torch.Tensor:
        tok = self.processing_class
        prompts = tok.batch_decode(rollout.queries, skip_special_tokens=True)
        completions = tok.batch_decode(post, skip_special_tokens=True)
        completion_ids = [row[row != self.pad_token_id].tolist() for row in post.cpu()]
        total = reward_funcs_scores(
            self.reward_funcs, self.args.reward_weights, prompts, completions, completion_ids, rollout.extra
        )  # each function's scores checked (type, shape, count), naming the function
        return total.to(rollout.queries.device)
