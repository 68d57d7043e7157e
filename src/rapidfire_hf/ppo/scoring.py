"""Scoring for PPOTrainer (:class:`Scorer`): reference log-probs, values and rewards of a rollout, all without
gradients in large batches, then KL-shaped rewards and advantages (``rapidfire_hf.ppo.core``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.ppo.core import compute_advantages, first_true_indices, truncate_after_stop
from rapidfire_hf.ppo.modeling import policy_logprobs, reward_model_scores
from rapidfire_hf.ppo.recovery import NoGradChunks
from rapidfire_hf.ppo.rewards import reward_funcs_scores
from rapidfire_hf.ppo.types import Experience, Rollout

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.ppo.modeling import PolicyAndValue


class Scorer:
    """Scoring of ``PPOTrainer``: a :class:`Rollout` in, an :class:`Experience` out.

    Args:
        args: the PPOConfig (temperature, reward shaping, GAE settings, ``ref_adapter_name``).
        accelerator: the trainer's accelerator.
        processing_class: the tokenizer (EOS, decoding for reward functions).
        pad_token_id, stop_token_id: the pad token and the token that ends a response.
        chunks: runs scoring in chunks of rows, smaller after an OOM.

    The models are the owner's to set (PPOTrainer's ``ref_model``, ``reward_model`` and ``reward_funcs``
    are these attributes, so replacing one on the trainer replaces it here):

    Attributes:
        model: the prepared policy-and-value module (values; the policy is its own reference with LoRA).
        ref_model: the separate frozen reference, or None (the adapter-disabled or ``ref_adapter_name`` policy).
        reward_model: a sequence-classification reward model, or None (``reward_funcs`` score).
        reward_funcs: reward callables (weighted by ``args.reward_weights``).
        train_adapter: the LoRA adapter trained (made active again after a ``ref_adapter_name`` pass).
    """

    def __init__(
        self, args: PPOConfig, accelerator: Accelerator, processing_class, pad_token_id: int,
        stop_token_id: int | None, chunks: NoGradChunks,
    ):  # fmt: skip
        self.args = args
        self.accelerator = accelerator
        self.processing_class = processing_class
        self.pad_token_id = pad_token_id
        self.stop_token_id = stop_token_id
        self.chunks = chunks
        self.model: PolicyAndValue | None = None
        self.ref_model: torch.nn.Module | None = None
        self.reward_model: torch.nn.Module | None = None
        self.reward_funcs: list = []
        self.train_adapter: str | None = None
        # called with "reference" / "reward" before that model runs (its offloaded weights copied in)
        self.ready: Callable[[str], None] | None = None

    @property
    def policy(self):
        return self.accelerator.unwrap_model(self.model).policy

    def reference(self) -> AbstractContextManager[torch.nn.Module]:
        """A context yielding the reference policy: the separate reference model (a plain ``nullcontext``:
        nothing to switch); with LoRA, the policy with the ``ref_adapter_name`` adapter active (the training
        adapter again afterwards), or with its adapters off."""
        return nullcontext(self.ref_model) if self.ref_model is not None else self._adapter_reference()

    @contextmanager
    def _adapter_reference(self) -> Iterator[torch.nn.Module]:
        if self.args.ref_adapter_name is not None:
            self.policy.set_adapter(self.args.ref_adapter_name)
            try:
                yield self.policy
            finally:
                self.policy.set_adapter(self.train_adapter)
        else:
            with self.policy.disable_adapter():
                yield self.policy

    @torch.no_grad()
    def score(self, rollout: Rollout, scoring_rows: int) -> Experience:
        """Reference log-probs, values and scores of a rollout, ``scoring_rows`` rows per forward, then
        KL-shaped rewards and advantages."""
        args = self.args
        pad, ctx = self.pad_token_id, rollout.queries.shape[1]
        qr = rollout.query_responses
        post = truncate_after_stop(rollout.responses, self.stop_token_id, pad)
        post_qr = torch.cat([rollout.queries, post], dim=1)
        unwrapped = self.accelerator.unwrap_model(self.model)
        # what scoring runs of the trained module: with a separate reference model, only the value model
        # (a separate 7B policy then stays sharded under ZeRO-3 / FSDP2); the policy too when it is its
        # own reference (LoRA) or carries the value head
        needed = unwrapped.value_model if not unwrapped.fused and self.ref_model is not None else None
        with gathered_for_generation(self.accelerator, self.model, needed), self.accelerator.autocast():

            def score_rows(start, stop):
                chunk = qr[start:stop]
                # the values first: the policy's forward runs while offloaded frozen weights are copied in
                values = unwrapped.values(chunk, pad, ctx)
                # only the reference log-probs run with the adapter off (LoRA); the values, from the fused
                # head on the policy's hidden states, need the adapter on, as in training
                if self.ready is not None and self.ref_model is not None:
                    self.ready("reference")
                with self.reference() as ref:
                    lp = policy_logprobs(ref, chunk, pad, ctx, args.temperature, unwrapped.full_mask)
                rm = None
                if self.reward_model is not None:
                    if self.ready is not None:
                        self.ready("reward")
                    rm = reward_model_scores(self.reward_model, post_qr[start:stop], pad, ctx)
                return lp, values, rm

            # an OOM halves the forward batch and retries (ppo/recovery.py)
            parts = self.chunks.run(
                score_rows, qr.shape[0], scoring_rows, "scoring", "local_rollout_forward_batch_size"
            )
        ref_lp, values, scores = (list(col) for col in zip(*parts))
        scores = (
            torch.cat(scores) if self.reward_model is not None else self.reward_funcs_scores(rollout, post)
        )
        return scored_experience(
            args, rollout, post, torch.cat(ref_lp).float(), torch.cat(values).float(), scores,
            self.processing_class.eos_token_id, pad,
        )  # fmt: skip

    def reward_funcs_scores(self, rollout: Rollout, post: torch.Tensor) -> torch.Tensor:
        texts = reward_texts(self.processing_class, rollout.queries, post, self.pad_token_id)
        total = reward_funcs_scores(self.reward_funcs, self.args.reward_weights, *texts, rollout.extra)
        # each function's scores checked (type, shape, count), naming the function
        return total.to(rollout.queries.device)


def reward_texts(
    tokenizer, queries: torch.Tensor, post: torch.Tensor, pad_token_id: int
) -> tuple[list, list, list]:
    """What reward functions are given: ``(prompts, completions, completion_ids)`` of left-padded prompts
    ``[B, P]`` and responses truncated after the stop token ``[B, R]``."""
    prompts = tokenizer.batch_decode(queries, skip_special_tokens=True)
    completions = tokenizer.batch_decode(post, skip_special_tokens=True)
    completion_ids = [row[row != pad_token_id].tolist() for row in post.cpu()]
    return prompts, completions, completion_ids


def scored_experience(
    args: PPOConfig,
    rollout: Rollout,
    post: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    eos_token_id: int | None,
    pad_token_id: int,
) -> Experience:
    """A scored rollout's :class:`Experience`: ``missing_eos_penalty`` taken from the scores of responses
    without EOS, then KL-shaped rewards, GAE and whitened advantages with ``args``' settings.

    Args:
        post: the responses truncated after the stop token ``[B, R]``.
        ref_logprobs, values: ``[B, R]`` float32; scores: ``[B]`` (weighted reward functions or reward model).
    """
    if args.missing_eos_penalty is not None and eos_token_id is not None:
        scores = scores - args.missing_eos_penalty * (~(post == eos_token_id).any(-1)).float()
    sequence_lengths = first_true_indices(post == pad_token_id) - 1
    adv = compute_advantages(
        rollout.logprobs,
        ref_logprobs,
        values,
        scores.float(),
        sequence_lengths,
        kl_coef=args.kl_coef,
        kl_estimator=args.kl_estimator,
        gamma=args.gamma,
        lam=args.lam,
        whiten_rewards=args.whiten_rewards,
    )
    return Experience(rollout=rollout, adv=adv, postprocessed_responses=post)
