"""Analytic memory of a PPO run on a Llama-like decoder: no model, no device, only its shape.

The throughput planner (:mod:`rapidfire_hf.memory.planner`) needs, for each phase of an update, what the
run holds (weights, optimizer state, gradients) and what one row adds (activations kept for backward, a
generated row's KV cache, a scoring forward's working set). PPOTrainer measures the activation bytes of one
row on the device it trains on; ``rapidfire plan --gpu-memory`` plans for a card it does not have, from the
numbers here, on the meta device.

Activations kept for backward, per layer and token, in elements of the compute dtype (``h`` hidden, ``kv``
key/value width, ``i`` MLP width):

- no recompute (``none``): two RMSNorms keep their fp32 input and bf16 output (``3h`` each); attention keeps
  the rotated q and k, v, its output and the output's contiguous copy (``3h + 2kv``; grouped-query heads are
  not repeated); the MLP keeps gate, silu(gate), up and their product (``4i``): ``9h + 2kv + 4i``;
- ``elementwise``: every matmul and attention output is kept, element-wise work is recomputed:
  ``4h + 2kv + 2i``;
- ``matmuls``: the matmuls whose contraction costs at least the aggressive threshold per byte are kept
  (:data:`rapidfire_hf.memory.checkpointing.RECOMPUTE_BELOW`), attention and the rest recomputed: the layer
  input plus the kept outputs, less one ``h`` (the 7B probe below keeps ``3h + 2kv + 2i``).

Each row also keeps the log-prob head's fp32 tensors over the response (about four ``vocab``-wide rows per
response token). A separate value model keeps its own layers' activations (its head is one number a token).

Calibrated against the probes the H200 runs printed (``benchmarks/presets/results/h200``, 128 + 384 tokens,
bf16, no Liger): 7B, fused value head, 2.92 GiB a row without recompute (here 2.91), 1.49 GiB with
``matmuls`` (here 1.49); 1.1B, separate value model, 1.89 GiB a row (here 1.93). Liger's kernels keep less
(the 1.1B batch-256 runs measured 0.76 GiB a row): the trainer's own probe, not this, plans those.
"""

from __future__ import annotations

from dataclasses import dataclass

from rapidfire_hf.kernels.kv_quant import vector_bytes
from rapidfire_hf.models.plumbing import layer_windows

GIB = 1024**3

# FLOPs per byte above which the aggressive policy keeps a matmul's output (checkpointing.RECOMPUTE_BELOW)
MATMULS_THRESHOLD = 4096.0
# fp32 vocab-wide rows the log-prob head keeps per response token (logits, log-softmax, probabilities, ...)
HEAD_ROWS = 4
# bytes of AdamW state per trained parameter in bitsandbytes' 8-bit AdamW (two uint8 moments + block scales)
EIGHT_BIT_STATE_BYTES = 2


@dataclass(frozen=True)
class DecoderShape:
    """The shape of a Llama-like decoder (what its memory depends on)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False  # the LM head shares the embedding matrix
    # per layer its sliding window, None for full attention; () when no layer has one (models/plumbing.py)
    windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        """The shape of a HF config (``LlamaConfig`` and its kin: grouped-query heads, ``head_dim``, the sliding
        windows of its local layers)."""
        heads = config.num_attention_heads
        windows = tuple(layer_windows(config))
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            intermediate=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            windows=windows if any(w is not None for w in windows) else (),
        )

    @property
    def kv(self) -> int:
        """Width of K (and of V) for one token."""
        return self.kv_heads * self.head_dim

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    def layer_params(self) -> int:
        h, i = self.hidden, self.intermediate
        return h * (self.q + 2 * self.kv) + self.q * h + 3 * h * i + 2 * h

    def params(self, head: str = "lm") -> int:
        """Parameters of the model with ``head``: ``"lm"`` (a causal LM), ``"value"`` (a causal LM with a
        fused value head, one number per token), ``"score"`` (a sequence-classification model, one label:
        a separate value or reward model)."""
        body = self.vocab * self.hidden + self.layers * self.layer_params() + self.hidden
        if head == "score":
            return body + self.hidden
        lm = 0 if self.tied else self.vocab * self.hidden
        return body + lm + (self.hidden + 1 if head == "value" else 0)

    def kv_bytes_per_token(self, itemsize: int, kv_cache_dtype: str | None = None) -> int:
        """K and V of every layer for one token of one row: ``itemsize`` bytes per element, or an 8-bit cache
        (``"fp8"`` / ``"int8"``) with one fp32 scale per head vector (``kernels/kv_quant.py``)."""
        return 2 * self.layers * self.kv_heads * vector_bytes(kv_cache_dtype, itemsize, self.head_dim)


def _kept_matmul_outputs(shape: DecoderShape, itemsize: int, threshold: float) -> int:
    """Elements a token keeps of the matmul outputs whose recompute costs at least ``threshold`` FLOPs per
    byte (``2K / itemsize`` for a contraction of ``K``)."""
    h, i = shape.hidden, shape.intermediate
    # (output width, contraction) of q, k, v, o, gate, up, down
    matmuls = [(shape.q, h), (shape.kv, h), (shape.kv, h), (h, shape.q), (i, h), (i, h), (h, i)]
    return sum(width for width, k in matmuls if 2.0 * k / itemsize >= threshold)


def layer_saved_elements(
    shape: DecoderShape, itemsize: int, policy: str, lora_targets: tuple[str, ...] | None = None
) -> int:
    """Elements one token keeps for backward in one decoder layer under ``policy`` (module docstring).

    ``lora_targets``: the projections with LoRA adapters on frozen weights (None: full fine-tuning). A frozen
    projection without an adapter needs its weight, not its input, for backward; a frozen norm weight needs
    not its normalised output: without recompute, LoRA on q/k/v/o keeps ``8h + 2kv + 3i`` (7B: 0.83 of full
    fine-tuning; the H200's LoRA run at 16 rows measured 42.9 GiB of activations, this 43.2)."""
    h, kv, i = shape.hidden, shape.kv, shape.intermediate
    if policy == "none":
        if lora_targets is None:
            return 9 * h + 2 * kv + 4 * i

        def has(*names):
            return any(n in lora_targets for n in names)

        norms = 2 * (2 * h) + h * has("q_proj", "k_proj", "v_proj") + h * has("gate_proj", "up_proj")
        attention = shape.q + 2 * kv + h + h * has("o_proj")
        return norms + attention + 3 * i + i * has("down_proj")
    if policy == "elementwise":
        return 4 * h + 2 * kv + 2 * i
    if policy == "matmuls":
        return max(h, h + _kept_matmul_outputs(shape, itemsize, MATMULS_THRESHOLD) - h)
    raise ValueError(f"checkpointing policy {policy!r}: expected none, elementwise or matmuls")


def activation_row_bytes(
    shape: DecoderShape,
    tokens: int,
    response_tokens: int,
    itemsize: int,
    policy: str,
    separate_value: bool = False,
    lora_targets: tuple[str, ...] | None = None,
) -> int:
    """Bytes one training row of ``tokens`` tokens keeps for backward under ``policy``: the policy's layers
    and log-prob head, and a separate value model's layers (same shape) when there is one (with LoRA, the
    value model is trained in full)."""
    per_token = layer_saved_elements(shape, itemsize, policy, lora_targets)
    value = layer_saved_elements(shape, itemsize, policy) if separate_value else 0
    layers = shape.layers * tokens * (per_token + value) * itemsize
    head = HEAD_ROWS * response_tokens * shape.vocab * 4 + 3 * shape.hidden * tokens * itemsize
    return layers + head


def analytic_probe(
    shape: DecoderShape,
    tokens: int,
    response_tokens: int,
    itemsize: int,
    policies: tuple[str, ...],
    separate_value: bool = False,
    lora_targets: tuple[str, ...] | None = None,
) -> dict[str, int]:
    """:func:`activation_row_bytes` of each of ``policies`` (what PPOTrainer's probe measures)."""
    return {
        p: activation_row_bytes(shape, tokens, response_tokens, itemsize, p, separate_value, lora_targets)
        for p in policies
    }


@dataclass(frozen=True)
class RunMemory:
    """What a PPO run holds on its device besides activations, in bytes.

    Args:
        weights: every model's weights (policy, value, reference, reward; LoRA adapters included).
        gradients: the trained parameters' gradients (held in training only: freed after each step).
        state: the optimizer's state (held from the first step on, in every phase).
        state_full: the state in the parameters' own precision (what 8-bit state was chosen against).
        state_8bit: the state in 8 bits.
    """

    weights: int
    gradients: int
    state: int
    state_full: int
    state_8bit: int


def run_memory(
    shape: DecoderShape,
    *,
    value_mode: str = "fused",
    peft: bool = False,
    lora_params: int = 0,
    reward_model: bool = False,
    itemsize: int = 2,
    eight_bit_state: bool = False,
    ref_quantization: str | None = None,
    reward_quantization: str | None = None,
) -> RunMemory:
    """The :class:`RunMemory` of PPO on a policy of ``shape``: a fused value head or a separate value model
    of the same shape; full fine-tuning (a frozen reference copy) or LoRA (the reference is the base with
    the adapter off: no copy; ``lora_params`` trained, plus the value head or model); a reward model of the
    same shape or a rule. AdamW's two moments are in the parameters' dtype (``itemsize``), or in 8 bits.
    ``ref_quantization`` / ``reward_quantization``: the frozen model held in ``"8bit"`` or ``"4bit"``
    (PPOConfig's ``ref_model_quantization`` / ``reward_model_quantization``, :func:`frozen_bytes`)."""
    policy = shape.params("value" if value_mode == "fused" else "lm")
    value = shape.params("score") if value_mode == "separate" else 0
    ref = 0 if peft else frozen_bytes(shape, "lm", ref_quantization, itemsize) // itemsize
    reward = frozen_bytes(shape, "score", reward_quantization, itemsize) // itemsize if reward_model else 0
    if peft:
        trained = lora_params + (value if value else shape.hidden + 1)
    else:
        trained = policy + value
    weights = (policy + value + ref + reward + (lora_params if peft else 0)) * itemsize
    full, small = 2 * trained * itemsize, EIGHT_BIT_STATE_BYTES * trained
    return RunMemory(
        weights=weights,
        gradients=trained * itemsize,
        state=small if eight_bit_state else full,
        state_full=full,
        state_8bit=small,
    )


# bytes per weight of a quantized linear layer: int8 with fp32 row scales; NF4 with double-quantized scales
QUANTIZED_BYTES = {"8bit": 1.0, "4bit": 0.52}


def frozen_bytes(shape: DecoderShape, head: str, quantization: str | None, itemsize: int = 2) -> int:
    """Bytes of a frozen model of ``shape`` with ``head`` (:meth:`DecoderShape.params`), its decoder layers'
    linear weights in ``quantization`` (bitsandbytes keeps the embeddings, norms and the head in ``itemsize``)."""
    total = shape.params(head)
    if quantization is None:
        return total * itemsize
    if quantization not in QUANTIZED_BYTES:
        raise ValueError(f"quantization {quantization!r}: expected None, '8bit' or '4bit'")
    linear = shape.layers * (shape.layer_params() - 2 * shape.hidden)
    return int(linear * QUANTIZED_BYTES[quantization]) + (total - linear) * itemsize


def lora_params(shape: DecoderShape, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of a LoRA adapter of ``rank`` on the ``targets`` projections of every layer."""
    h, i = shape.hidden, shape.intermediate
    dims = {
        "q_proj": (h, shape.q),
        "k_proj": (h, shape.kv),
        "v_proj": (h, shape.kv),
        "o_proj": (shape.q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    unknown = [t for t in targets if t not in dims]
    if unknown:
        raise ValueError(f"LoRA targets {unknown}: expected some of {', '.join(dims)}")
    return shape.layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)
