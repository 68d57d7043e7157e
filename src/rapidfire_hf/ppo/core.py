"""PPO math as pure functions of tensors: masks, KL-shaped rewards, GAE, whitening and the losses.

Each function is the formula of TRL 1.12's ``trl.experimental.ppo`` PPO (the parity test in
``tests/ppo/test_parity_trl112.py`` checks this against values stock TRL produced), written so the
trainer can run it without host-device synchronisation: no ``.item()``, no Python branches on
tensor values. Conventions for a batch of ``B`` rollouts with ``R`` response tokens:

* ``padding_mask``    [B, R] bool, True *after* the last real response token (the stop token is real).
* ``padding_mask_p1`` [B, R] bool, True after the last real token + 1 (values keep one more slot,
  as in TRL: the value of the state after the stop token is still learned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Log-prob written into padded positions (never used in a loss: every use is masked).
INVALID_LOGPROB = 1.0


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim; the row length where a row has none.

    Args:
        bools: [..., T] bool.

    Returns:
        [...] long.
    """
    row_len = bools.size(-1)
    idx = torch.arange(row_len, device=bools.device)
    return torch.where(bools, idx, row_len).min(dim=-1).values


def truncate_after_stop(
    responses: torch.Tensor, stop_token_id: int | None, pad_token_id: int
) -> torch.Tensor:
    """Replace every token after the first ``stop_token_id`` of each row with ``pad_token_id``.

    Args:
        responses: [B, R] token ids.
        stop_token_id: the stop token, or None to keep responses unchanged.
        pad_token_id: the pad token id.
    """
    if stop_token_id is None:
        return responses
    keep = lengths_through_stop(responses, [stop_token_id]).unsqueeze(-1)  # [B, 1]
    idx = torch.arange(responses.shape[1], device=responses.device)
    return responses.masked_fill(idx >= keep, pad_token_id)


def lengths_through_stop(responses: torch.Tensor, stop_token_ids: list[int]) -> torch.Tensor:
    """Per row, the number of tokens up to and including the first stop token (``R`` where there is none).

    Args:
        responses: [B, R] token ids.
        stop_token_ids: the token ids that end a response.

    Returns:
        [B] long.
    """
    is_stop = torch.isin(
        responses, torch.tensor(stop_token_ids, dtype=responses.dtype, device=responses.device)
    )
    return (first_true_indices(is_stop) + 1).clamp_max(responses.shape[1])


def response_masks(sequence_lengths: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two padding masks of a batch from the index of each row's last real token.

    Args:
        sequence_lengths: [B] index of the last real response token (-1 for an empty response).
        response_length: R.

    Returns:
        ``(padding_mask, padding_mask_p1)``, both [B, R] bool.
    """
    idx = torch.arange(response_length, device=sequence_lengths.device).unsqueeze(0)
    return idx > sequence_lengths.unsqueeze(1), idx > (sequence_lengths + 1).unsqueeze(1)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, dim: int | None = None, *, axis: int | None = None
) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is True (over ``dim``, or over everything); ``axis`` is TRL's
    name for ``dim``."""
    if axis is not None:
        if dim is not None:
            raise TypeError("masked_mean got both dim and axis: pass one")
        dim = axis
    mask = mask.to(values.dtype)
    # An empty mask (every response empty) gives 0 instead of NaN; otherwise this is the plain mean.
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` where ``mask`` is True, with Bessel's correction when ``unbiased``.

    With fewer than two unmasked elements the variance is 0 (TRL raises there; a batch of empty
    responses must not stop training).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum().to(values.dtype)
        var = var * count / (count - 1).clamp_min(1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to unit variance (and zero mean when ``shift_mean``) over the masked entries."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens (http://joschu.net/blog/kl-approx.html).

    ``k1`` is ``logp - logp_ref``; ``k3`` is ``exp(logp_ref - logp) - 1 - (logp_ref - logp)``.
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def kl_shaped_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    sequence_lengths: torch.Tensor,
    kl_coef: float,
    kl_estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-kl_coef * KL`` on every token plus the score on the token after the last.

    The score lands on index ``sequence_length + 1`` (the first padded slot, which keeps a value
    target), or on the last real token when the response fills all R slots.

    Args:
        scores: [B] sequence-level scores.
        logprobs, ref_logprobs: [B, R] sampled-token log-probs of policy and reference (padded slots
            hold INVALID_LOGPROB in both, so their KL is 0).
        sequence_lengths: [B] index of the last real response token.

    Returns:
        ``(rewards, non_score_reward, kl)``, each [B, R].
    """
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    response_length = rewards.shape[1]
    p1 = sequence_lengths + 1
    end = torch.where(p1 < response_length, p1, sequence_lengths)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, end] += scores.to(rewards.dtype)
    return rewards, non_score_reward, kl


def gae(
    rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens (no bootstrap after the last slot).

    Args:
        rewards, values: [B, R].

    Returns:
        ``(advantages, returns)``, each [B, R], with ``returns = advantages + values``.
    """
    response_length = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    out = [None] * response_length
    for t in reversed(range(response_length)):
        next_value = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        out[t] = last
    advantages = torch.stack(out, dim=1)
    return advantages, advantages + values


@dataclass
class AdvantageOutput:
    """Everything the PPO epochs need from a scored rollout (all [B, R] unless noted)."""

    advantages: torch.Tensor  # whitened, 0 on padding
    returns: torch.Tensor
    values: torch.Tensor  # 0 after padding_mask_p1
    logprobs: torch.Tensor  # INVALID_LOGPROB on padding
    ref_logprobs: torch.Tensor
    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    kl: torch.Tensor
    scores: torch.Tensor  # [B], after the missing-EOS penalty
    padding_mask: torch.Tensor
    padding_mask_p1: torch.Tensor


def compute_advantages(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    values: torch.Tensor,
    scores: torch.Tensor,
    sequence_lengths: torch.Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_rewards: bool = False,
) -> AdvantageOutput:
    """The scoring-to-advantages step of one PPO update, as TRL 1.12 computes it.

    Args:
        logprobs, ref_logprobs: [B, R] sampled-token log-probs (any values in padded slots).
        values: [B, R] value predictions for the state before each response token.
        scores: [B] scores (penalties already applied).
        sequence_lengths: [B] index of the last real response token.
    """
    padding_mask, padding_mask_p1 = response_masks(sequence_lengths, logprobs.shape[1])
    logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    values = values.masked_fill(padding_mask_p1, 0)
    rewards, non_score_reward, kl = kl_shaped_rewards(
        scores, logprobs, ref_logprobs, sequence_lengths, kl_coef, kl_estimator
    )
    if whiten_rewards:
        rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
    advantages, returns = gae(rewards, values, gamma, lam)
    advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
    return AdvantageOutput(
        advantages=advantages,
        returns=returns,
        values=values,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        rewards=rewards,
        non_score_reward=non_score_reward,
        kl=kl,
        scores=scores,
        padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1,
    )


@dataclass
class LossOutput:
    """Loss of one micro-batch and the statistics PPO logs (0-dim tensors, still on device)."""

    loss: torch.Tensor
    pg_loss: torch.Tensor
    vf_loss: torch.Tensor
    pg_clipfrac: torch.Tensor
    vf_clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    ratio_mean: torch.Tensor


def ppo_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    vpred: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    padding_mask: torch.Tensor,
    padding_mask_p1: torch.Tensor,
    *,
    cliprange: float,
    cliprange_value: float,
    vf_coef: float,
    counts: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> LossOutput:
    """Clipped policy loss plus ``vf_coef`` times the clipped value loss of one micro-batch.

    Args:
        new_logprobs: [b, R] log-probs of the sampled tokens under the current policy.
        old_logprobs, advantages, old_values, returns: [b, R] from the rollout.
        vpred: [b, R] current value predictions.
        padding_mask, padding_mask_p1: [b, R] bool.
        counts: ``(tokens, value_tokens, slots)`` of a whole micro-batch, to divide this piece's masked
            sums by: the losses and statistics of the pieces of a split micro-batch then add up to
            those of the whole (OOM recovery).
    """
    if counts is None:  # this micro-batch alone (the plain masked means)
        counts = (
            (~padding_mask).sum().clamp_min(1),
            (~padding_mask_p1).sum().clamp_min(1),
            padding_mask.numel(),
        )
    tokens, value_tokens, slots = counts
    token_mask, value_mask = ~padding_mask, ~padding_mask_p1

    def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x * mask.to(x.dtype)).sum()

    new_logprobs = new_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
    vpred = vpred.masked_fill(padding_mask_p1, 0)
    vpred_clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = torch.square(vpred - returns)
    vf_losses2 = torch.square(vpred_clipped - returns)
    vf_loss = 0.5 * (masked_sum(torch.max(vf_losses1, vf_losses2), value_mask) / value_tokens)

    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_sum(torch.max(pg_losses, pg_losses2), token_mask) / tokens
    loss = pg_loss + vf_coef * vf_loss
    with torch.no_grad():
        stats = dict(
            pg_clipfrac=masked_sum((pg_losses2 > pg_losses).float(), token_mask) / tokens,
            vf_clipfrac=masked_sum((vf_losses2 > vf_losses1).float(), value_mask) / value_tokens,
            # As TRL 1.12 logs it: over all slots (padded slots have log_ratio 0).
            approx_kl=0.5 * (log_ratio**2).sum() / slots,
            ratio_mean=ratio.sum() / slots,
        )
    return LossOutput(loss=loss, pg_loss=pg_loss.detach(), vf_loss=vf_loss.detach(), **stats)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution of each row of ``logits`` ([..., V] -> [...])."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)
