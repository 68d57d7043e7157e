"""Model-side pieces of PPO: the policy+value module the optimizer trains, the value head, and the
no-grad scoring forwards (reference log-probs, values, reward-model scores).

Log-probs are computed from the backbone's hidden states of the response positions only, so the
``[B, P+R, V]`` logits of a full forward never exist. :func:`response_logprobs` gives the response
log-probs and entropy with ``rapidfire_hf.kernels.chunked_logprobs_and_entropy`` (``LOGPROB_CHUNK_TOKENS``
rows of logits at a time, recomputed in backward), so training holds no ``[micro-batch, R, V]`` logits
tensor either; LM heads the kernel cannot read directly fall back to row chunks through the module.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from rapidfire_hf.kernels import chunked_logprobs, chunked_logprobs_and_entropy
from rapidfire_hf.models.plumbing import causal_lm_parts, classifier_parts
from rapidfire_hf.models.value_head import ValueHead

# Tokens whose logits exist at once in response_logprobs' kernel path: about 3 x 512 x V x 4 bytes of
# transient fp32 (0.2 GB at V = 32000) instead of the B x R x V x 4 saved for backward by full logits.
LOGPROB_CHUNK_TOKENS = 512


def sequence_inputs(
    query_responses: torch.Tensor, pad_token_id: int, full_mask: bool = False
) -> dict[str, torch.Tensor]:
    """Attention mask, position ids and input ids of left-padded prompt+response rows (TRL 1.12's convention:
    every pad token is masked out and positions count real tokens only).

    Args:
        full_mask: give the ``[B, 1, L, L]`` boolean causal-and-padding mask that transformers' SDPA path
            builds from the ``[B, L]`` one when a row is padded, for every batch. transformers drops the mask
            (``is_causal`` attention) when no token is padded, so compiled decoder layers would see ``None``
            one batch and a tensor the next: a recompilation, possibly inside a timed update. SDPA models only.
    """
    attention_mask = query_responses != pad_token_id
    position_ids = attention_mask.cumsum(1) - attention_mask.long()
    input_ids = query_responses.masked_fill(~attention_mask, 0)
    if full_mask:
        n = query_responses.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=query_responses.device).tril()
        attention_mask = causal[None, None] & attention_mask[:, None, None, :]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def _kernel_head(lm_head: nn.Module):
    """``(weight, context, input dtype)`` when ``lm_head`` is a projection the chunked kernel can compute
    from its weight, else ``None`` (the module is then called: a bias, LoRA or quantized head, module
    hooks (the precision sensitivity pass), a weight sharded outside forward (DeepSpeed ZeRO-3: empty;
    FSDP2: a DTensor))."""
    if type(lm_head) is not nn.Linear or lm_head.bias is not None:
        return None
    weight = lm_head.weight
    if (
        not weight.is_floating_point()
        or tuple(weight.shape) != (lm_head.out_features, lm_head.in_features)
        or type(weight.data) is not torch.Tensor
        or lm_head._forward_hooks
        or lm_head._forward_pre_hooks
    ):
        return None
    patched = lm_head.__dict__.get("forward")
    if patched is None:
        return weight, nullcontext(), None
    from rapidfire_hf.precision.schedule import LayerPrecision, Precision

    if not isinstance(patched, LayerPrecision):
        return None
    # as LayerPrecision runs the head: fp32 inputs, autocast off (fp32) or at the layer's precision
    if patched.precision is Precision.FP32:
        ctx = torch.autocast(patched.device_type, enabled=False)
    else:
        ctx = torch.autocast(patched.device_type, dtype=patched.precision.dtype)
    return weight, ctx, torch.float32


def response_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    responses: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
    chunk_rows: int = 8,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropy) of ``responses`` from the hidden states that predict them.

    Equal to ``log_softmax(lm_head(hidden).float() / (temperature + 1e-7))`` gathered at ``responses``
    (within 1e-5 in fp32 on CPU: the log-sum-exp is computed per chunk of tokens), without a
    ``[B, R, V]`` logits tensor: forward keeps one log-sum-exp per token and backward recomputes each
    chunk's logits.

    Args:
        hidden: [B, R, H] hidden states at positions ``context_length-1 .. -2``.
        lm_head: the output projection.
        responses: [B, R] token ids.
        temperature: logits are divided by ``temperature + 1e-7`` as in TRL.
        with_entropy: also return the entropy of each position's distribution (no grad).
        chunk_rows: for heads the kernel cannot read (see ``_kernel_head``): batch rows projected at once
            through the module; their logits are then saved for backward.

    Returns:
        ``(logprobs [B, R] float32, entropy [B, R] float32 or None)``.
    """
    head = _kernel_head(lm_head)
    if head is not None:
        weight, ctx, in_dtype = head
        h = hidden if in_dtype is None else hidden.to(in_dtype)
        with ctx:
            if not with_entropy:
                return chunked_logprobs(h, weight, responses, temperature + 1e-7, LOGPROB_CHUNK_TOKENS), None
            logps, ents = chunked_logprobs_and_entropy(
                h, weight, responses, temperature + 1e-7, LOGPROB_CHUNK_TOKENS
            )
        return logps, ents.detach()
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = lm_head(hidden[start : start + chunk_rows]).float() / (temperature + 1e-7)
        tokens = responses[start : start + chunk_rows]
        logp_all = torch.log_softmax(logits, dim=-1)
        logps.append(torch.gather(logp_all, -1, tokens.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            with torch.no_grad():
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def value_head_dtype(policy: nn.Module, mixed_precision: str) -> torch.dtype:
    """The fused value head's dtype: fp32 under mixed precision (the policy's weights are then fp32 or
    upcast); without mixed precision, a policy held in one dtype (pure bf16 training) gets a head in that
    dtype. FSDP2 needs this: it flattens the root unit (embeddings, LM head, value head) into one dtype and
    refuses a mix ("FSDP expects uniform original parameter dtype"), and one GPU then trains the same
    numerics as the sharded run."""
    dtypes = {p.dtype for p in policy.parameters()}
    if mixed_precision == "no" and len(dtypes) == 1:
        return dtypes.pop()
    return torch.float32


def check_value_model(value_model: nn.Module, policy: nn.Module) -> None:
    """Raise a clear error when ``value_model`` cannot give one value per position."""
    try:
        _, score = classifier_parts(value_model, "value_model")
    except TypeError:
        raise TypeError(
            f"value_model ({type(value_model).__name__}) must be a transformers sequence-classification model "
            "(e.g. AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)) with a `score` head, "
            "or pass value_model=None with PPOConfig(value_mode='fused')."
        ) from None
    out = getattr(score, "out_features", None)
    if out != 1:
        raise ValueError(
            f"value_model must output one value per position, but its score head has out_features={out}: "
            "load it with num_labels=1."
        )


class PolicyAndValue(nn.Module):
    """The trainable module of PPO: the policy plus its value function (a separate model or a head).

    One ``forward`` returns the response log-probs, values and (optionally) entropy, so that a single
    ``accelerator.prepare`` (DDP, DeepSpeed, FSDP) covers both and gradient sync happens once.
    """

    def __init__(
        self, policy: nn.Module, value_model: nn.Module | None = None, value_head: ValueHead | None = None
    ):
        super().__init__()
        if (value_model is None) == (value_head is None):
            raise ValueError("PolicyAndValue needs exactly one of value_model and value_head")
        self.policy = policy
        self.value_model = value_model
        self.value_head = value_head
        self.full_mask = False  # see sequence_inputs; set by the trainer when its layers are compiled
        # the models' parts, looked up at the first forward instead of at every one (a plain tuple: not
        # registered as submodules); the lookup raises there, as before, for a model that is not a causal LM
        self._parts: tuple[nn.Module, nn.Module, tuple[nn.Module, nn.Module] | None] | None = None

    @property
    def fused(self) -> bool:
        return self.value_head is not None

    def parts(self) -> tuple[nn.Module, nn.Module, tuple[nn.Module, nn.Module] | None]:
        """``(decoder, lm_head, (backbone, score) of the value model or None when fused)``, found once."""
        if self._parts is None:
            decoder, lm_head = causal_lm_parts(self.policy)
            value = None if self.fused else classifier_parts(self.value_model, "value_model")
            self._parts = (decoder, lm_head, value)
        return self._parts

    def forward(
        self,
        query_responses: torch.Tensor,
        pad_token_id: int,
        context_length: int,
        temperature: float,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns ``(logprobs [B, R], values [B, R], entropy [B, R] or None)`` for the response part."""
        decoder, lm_head, _ = self.parts()
        inputs, resp_hidden, logprobs, entropy = policy_outputs(
            decoder, lm_head, query_responses, pad_token_id, context_length, temperature, self.full_mask,
            with_entropy,
        )  # fmt: skip
        return logprobs, self._values(inputs, context_length, resp_hidden).float(), entropy

    def values(self, query_responses: torch.Tensor, pad_token_id: int, context_length: int) -> torch.Tensor:
        """The values alone (scoring): the same numbers ``forward`` gives, without the log-probs. [B, R]"""
        inputs = sequence_inputs(query_responses, pad_token_id, self.full_mask)
        return self._values(inputs, context_length)

    def _values(
        self, inputs: dict[str, torch.Tensor], context_length: int, resp_hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The one place values are computed: the value head on the policy's hidden states of the response
        positions (``resp_hidden`` when the caller already ran the policy), or the separate value model."""
        decoder, _, value_parts = self.parts()
        if value_parts is not None:
            return classifier_positions(*value_parts, inputs, context_length)
        if resp_hidden is None:
            resp_hidden = response_hidden(decoder, inputs, context_length)
        return block_values([self.value_head], [resp_hidden.shape[0]], resp_hidden)


def response_hidden(decoder: nn.Module, inputs: dict[str, torch.Tensor], context_length: int) -> torch.Tensor:
    """The decoder's last hidden states of the positions that predict the response tokens. [B, R, H]"""
    hidden = decoder(**inputs, use_cache=False, return_dict=True).last_hidden_state
    return hidden[:, context_length - 1 : -1]


def policy_outputs(
    decoder: nn.Module,
    lm_head: nn.Module,
    query_responses: torch.Tensor,
    pad_token_id: int,
    context_length: int,
    temperature: float,
    full_mask: bool = False,
    with_entropy: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One training forward of a policy: ``(inputs, response hidden states [B, R, H], log-probs [B, R],
    entropy [B, R] or None)``; the fused values come from the same hidden states (:func:`block_values`)."""
    inputs = sequence_inputs(query_responses, pad_token_id, full_mask)
    resp_hidden = response_hidden(decoder, inputs, context_length)
    responses = query_responses[:, context_length:]
    logprobs, entropy = response_logprobs(resp_hidden, lm_head, responses, temperature, with_entropy)
    return inputs, resp_hidden, logprobs, entropy


def block_values(heads: list[ValueHead], rows: list[int], resp_hidden: torch.Tensor) -> torch.Tensor:
    """The fused values: each block of ``rows[i]`` consecutive rows from its own head ``heads[i]`` (one
    head: PPOTrainer; one per trial: a sweep). ``[sum(rows), R, H]`` -> ``[sum(rows), R]``."""
    if len(heads) == 1:
        return heads[0](resp_hidden)
    parts, start = [], 0
    for head, n in zip(heads, rows):
        parts.append(head(resp_hidden[start : start + n]))
        start += n
    return torch.cat(parts)


def value_positions(
    value_model: nn.Module, inputs: dict[str, torch.Tensor], context_length: int
) -> torch.Tensor:
    """Values of the states before each response token from a sequence-classification model. [B, R]"""
    return classifier_positions(*classifier_parts(value_model, "value_model"), inputs, context_length)


def classifier_positions(
    backbone: nn.Module, score: nn.Module, inputs: dict[str, torch.Tensor], context_length: int
) -> torch.Tensor:
    """:func:`value_positions` from the model's parts (:func:`~rapidfire_hf.models.plumbing.classifier_parts`)."""
    hidden = backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state
    return score(hidden[:, context_length - 1 : -1]).squeeze(-1)


@torch.no_grad()
def reward_model_scores(
    reward_model: nn.Module,
    query_responses: torch.Tensor,
    pad_token_id: int,
    context_length: int,
    full_mask: bool = False,
    pieces: list[int] | None = None,
) -> torch.Tensor:
    """Score of each row at its last real token (the token before the first response pad). [B]

    Args:
        full_mask: give the backbone the 4-D mask (:func:`sequence_inputs`).
        pieces: row counts of consecutive pieces whose one-output head runs apart (a sweep's trials: CPU
            GEMMs over a few rows round differently inside a larger batch); None: all rows at once.
    """
    inputs = sequence_inputs(query_responses, pad_token_id, full_mask)
    backbone, score = classifier_parts(reward_model, "reward_model")
    hidden = backbone(**inputs, use_cache=False, return_dict=True).last_hidden_state
    responses = query_responses[:, context_length:]
    from rapidfire_hf.ppo.core import first_true_indices

    last = first_true_indices(responses == pad_token_id) - 1 + context_length
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    final = hidden[rows, last]  # [B, H]
    if pieces is None:
        return score(final).squeeze(-1).float()
    return torch.cat([score(x).squeeze(-1).float() for x in final.split(pieces)])


@torch.no_grad()
def policy_logprobs(
    model: nn.Module,
    query_responses: torch.Tensor,
    pad_token_id: int,
    context_length: int,
    temperature: float,
    full_mask: bool = False,
) -> torch.Tensor:
    """Response log-probs of a frozen causal LM (the reference policy). [B, R]"""
    decoder, lm_head = causal_lm_parts(model)
    inputs = sequence_inputs(query_responses, pad_token_id, full_mask)
    hidden = decoder(**inputs, use_cache=False, return_dict=True).last_hidden_state
    responses = query_responses[:, context_length:]
    return response_logprobs(hidden[:, context_length - 1 : -1], lm_head, responses, temperature)[0]
