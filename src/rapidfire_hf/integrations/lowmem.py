"""``memory.lowmem`` of ``enable_rapidfire``: its options, the checks a trainer must pass, and the install.

``enable_rapidfire(trainer, config={"memory": {"lowmem": "on"}})`` on a TRL ``GRPOTrainer`` or
``RLOOTrainer`` applies, through ``install_lowmem``, mechanisms that live in their own parts:

- chunked, host-offloaded checkpointing of the decoder layers
  (``rapidfire_hf.memory.chunked_checkpoint.apply_chunked_checkpointing``, ``memory.offload.HostOffloader``);
- the rollout engine's prefill in chunks and its release after every rollout
  (``RolloutEngine(prefill_chunk_rows=...)``, ``memory.stats.clear_cublas_workspaces``);
- bitsandbytes without per-parameter syncs on the default stream, and optionally the embedding's AdamW
  state in 8 bits (``rapidfire_hf.optim.bnb``);
- TRL's fused LM-head vocabulary tile.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.chunked_checkpoint import apply_chunked_checkpointing
from rapidfire_hf.memory.offload import HostOffloader
from rapidfire_hf.models import decoder_layers
from rapidfire_hf.optim.bnb import skip_bitsandbytes_sync_on_default_stream, use_8bit_embedding_state
from rapidfire_hf.utils.units import GIB

# Chunk sizes of ``memory.lowmem`` (``enable_rapidfire(..., lowmem_options=...)`` overrides them), sized for
# 64 sequences x 384 tokens of a 1.1B Llama on an H200 (benchmarks/grpo/memory_model.py). A batch of at most
# ``rows`` sequences is one chunk.
LOWMEM_DEFAULTS: dict[str, int] = {
    "rows": 16,  # sequences per backward (recompute) chunk of each decoder layer
    "forward_rows": 32,  # sequences per forward chunk (no_grad: saves nothing)
    "prefill_rows": 16,  # prompts per rollout prefill chunk (static engine)
    "lm_head_chunk": 4096,  # vocabulary width of TRL's fused LM-head tile (TRL's default: 32768)
}
# TrainingArguments.optim values that build a non-paged 8-bit bitsandbytes AdamW
EIGHT_BIT_OPTIMS = ("adamw_8bit", "adamw_bnb_8bit")


def lowmem_options(options: dict | None) -> dict[str, int]:
    """``LOWMEM_DEFAULTS`` updated with ``options``; unknown keys and values other than ints >= 1 raise ValueError."""
    out = dict(LOWMEM_DEFAULTS)
    for key, value in (options or {}).items():
        if key not in LOWMEM_DEFAULTS:
            raise ValueError(f"lowmem_options: unknown key {key!r}; allowed: {', '.join(LOWMEM_DEFAULTS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"lowmem_options[{key!r}]={value!r}: an int >= 1")
        out[key] = value
    return out


def _optim_name(args) -> str:
    return str(to_plain(args.optim))  # transformers' OptimizerNames (a str enum) or a string


def _explicit_optimizer(trainer) -> bool:
    """The user chose the optimizer object or class (``optimizers=`` / ``optimizer_cls_and_kwargs=``)."""
    return trainer.optimizer is not None or getattr(trainer, "optimizer_cls_and_kwargs", None) is not None


def lowmem_problems(trainer, mode: str, rollout: bool | str = True) -> list[str]:
    """Why ``memory.lowmem=mode`` cannot be applied to ``trainer`` (empty: it can).

    The option never changes the user's math on its own: the two settings that change it against stock
    TRL and that the measured memory depends on must be set in the trainer's arguments.
    """
    name = type(trainer).__name__
    if not hasattr(trainer, "_generate_single_turn"):
        return [
            f"memory.lowmem={mode!r} applies to TRL's GRPOTrainer and RLOOTrainer only (their rollout, "
            f"loss and backward); {name} is not one: set memory.lowmem to 'off'"
        ]
    problems = []
    if trainer.is_deepspeed_enabled or getattr(trainer, "is_fsdp_enabled", False):
        problems.append(
            f"memory.lowmem={mode!r} is not supported with DeepSpeed or FSDP (it was built and measured on one "
            "GPU; it wraps the decoder layers and needs RapidFireOptimizer's gradient pipeline)"
        )
    try:
        decoder_layers(trainer.model)
    except TypeError as err:
        problems.append(f"memory.lowmem={mode!r}: {err} (it checkpoints an HF causal LM's decoder layers)")
    args = trainer.args
    if args.max_grad_norm and args.max_grad_norm > 0:
        problems.append(
            f"memory.lowmem needs gradient clipping off: set max_grad_norm=0.0 in the trainer's arguments "
            f"(now {args.max_grad_norm}). With clipping, RapidFireOptimizer must hold every gradient until "
            "the norm is known in windows where clipping may bind (always the first), which costs the "
            "gradients' full size in memory. This changes the update against stock (no clipping)"
        )
    optim = _optim_name(args)
    if mode == "on_8bit_embedding":
        if _explicit_optimizer(trainer):
            problems.append(
                "memory.lowmem='on_8bit_embedding' builds the optimizer from the trainer's optim='adamw_8bit'; "
                "it cannot be combined with optimizers= or optimizer_cls_and_kwargs= (use lowmem 'on')"
            )
        elif optim not in EIGHT_BIT_OPTIMS:
            problems.append(
                f"memory.lowmem='on_8bit_embedding' needs optim='adamw_8bit' in the trainer's arguments (now "
                f"{optim!r}): 8-bit AdamW state (bitsandbytes) instead of stock's bf16/fp32 state changes the math"
            )
    elif not _explicit_optimizer(trainer) and optim not in EIGHT_BIT_OPTIMS:
        problems.append(
            f"memory.lowmem='on' needs an 8-bit optimizer: set optim='adamw_8bit' in the trainer's arguments "
            f"(now {optim!r}; 8-bit AdamW state changes the math against stock), or choose the optimizer "
            "yourself with optimizers= / optimizer_cls_and_kwargs= (then its state takes what it takes)"
        )
    return problems


@dataclass
class LowMemParts:
    """What ``install_lowmem`` applied (``trainer._rapidfire.parts["lowmem"]``).

    Attributes:
        mode: ``"on"`` or ``"on_8bit_embedding"``.
        options: the chunk sizes used (``LOWMEM_DEFAULTS`` and overrides).
        offloader: the ``HostOffloader`` of the chunked checkpointing (its ``stats``, ``pooled_bytes()``).
        applied: human-readable list of what was changed, each with whether it changes the math.
        embedding_8bit: ``use_8bit_embedding_state``'s answer (``on_8bit_embedding``), else ``None``.
        bnb_sync_skipped: whether bitsandbytes' per-parameter syncs are skipped on the default stream.
    """

    mode: str
    options: dict[str, int]
    offloader: HostOffloader
    applied: list[str] = field(default_factory=list)
    embedding_8bit: dict | None = None
    bnb_sync_skipped: bool = False

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            **self.options,
            "activation_offload": self.offloader.stats.as_dict(),
            "host_buffer_pool_gib": self.offloader.pooled_bytes() / GIB,
            "bnb_sync_skipped_on_default_stream": self.bnb_sync_skipped,
        }


def _bnb_unpaged(trainer, mode: str) -> bool:
    """The optimizer the trainer will build (or holds) is a non-paged bitsandbytes 8-bit one."""
    if trainer.optimizer is not None:
        opt = trainer.optimizer
        return type(opt).__module__.startswith("bitsandbytes") and not getattr(opt, "is_paged", False)
    cls_kwargs = getattr(trainer, "optimizer_cls_and_kwargs", None)
    if cls_kwargs is not None:
        cls, kwargs = cls_kwargs
        return cls.__module__.startswith("bitsandbytes") and not kwargs.get("is_paged", False)
    return mode == "on_8bit_embedding" or _optim_name(trainer.args) in EIGHT_BIT_OPTIMS


def install_lowmem(trainer, mode: str, options: dict | None = None, rollout_patch=None) -> LowMemParts:
    """Apply ``memory.lowmem`` to a GRPO/RLOO trainer that passed ``lowmem_problems`` (``enable_rapidfire``
    calls this; the optimizer wrapping, ``rollback="off"`` default and the rollout engine are set up there).

    1. ``on_8bit_embedding``: ``use_8bit_embedding_state`` (the embedding's AdamW state in 8 bits too).
    2. HF gradient checkpointing off (``args.gradient_checkpointing=False``): replaced by 3.
    3. ``apply_chunked_checkpointing(model, rows, forward_rows, offload=True, reuse_host_buffers=True)``.
    4. ``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = lm_head_chunk`` (process-wide TRL constant).
    5. ``skip_bitsandbytes_sync_on_default_stream()`` when the optimizer is non-paged bitsandbytes
       (process-wide: do not use paged bitsandbytes optimizers in the same process).
    6. The rollout engine (``rollout_patch``, a ``RolloutPatch``): prefill in ``prefill_rows`` chunks, the
       engine released after every rollout and cuBLAS workspaces cleared.
    """
    if mode == "on_8bit_embedding" or _optim_name(trainer.args) in EIGHT_BIT_OPTIMS:
        from rapidfire_hf.utils.imports import require

        require("bitsandbytes", f"memory.lowmem={mode!r} with optim='adamw_8bit' (8-bit AdamW; needs a GPU)")
    opts = lowmem_options(options)
    applied = []
    embedding = None
    if mode == "on_8bit_embedding":
        embedding = use_8bit_embedding_state(trainer)
        applied.append(
            "embedding AdamW state 8-bit too (AdamW8bit via optimizer_cls_and_kwargs; changes math)"
        )
    model = trainer.model
    if trainer.args.gradient_checkpointing or getattr(model, "is_gradient_checkpointing", False):
        trainer.args.gradient_checkpointing = (
            False  # the Trainer would enable it at train(); ours replaces it
        )
        if getattr(model, "is_gradient_checkpointing", False):
            model.gradient_checkpointing_disable()
        applied.append("HF gradient checkpointing replaced")
    offloader = apply_chunked_checkpointing(
        model, rows=opts["rows"], forward_rows=opts["forward_rows"], offload=True, reuse_host_buffers=True
    )
    applied.append(
        f"chunked checkpointing ({opts['rows']} rows backward / {opts['forward_rows']} forward, "
        "inputs in pooled pinned host memory; bf16 weight-gradient partials summed in fp32)"
    )
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:  # pragma: no cover - TRL trainers imply TRL
        trl_utils = None
    if trl_utils is not None and hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE"):
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = opts["lm_head_chunk"]  # read by TRL's fused LM head each call
        applied.append(f"TRL LM-head vocabulary tile {opts['lm_head_chunk']}")
    bnb_skipped = False
    if _bnb_unpaged(trainer, mode):
        bnb_skipped = skip_bitsandbytes_sync_on_default_stream()
        if bnb_skipped:
            applied.append("bitsandbytes per-parameter syncs skipped on the default stream")
    if rollout_patch is not None:
        rollout_patch.configure_lowmem(prefill_rows=opts["prefill_rows"])
        applied.append(
            f"rollout engine released after each rollout, prefill in {opts['prefill_rows']}-prompt chunks"
        )
    return LowMemParts(mode, opts, offloader, applied, embedding, bnb_skipped)
