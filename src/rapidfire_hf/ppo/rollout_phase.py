"""The rollout phase of PPOTrainer (:class:`Roller`): responses generated for a batch of prompts with the
current policy by ``rapidfire_hf.rollout``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rapidfire_hf.distributed.features import Engine
from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.ppo.recovery import NoGradChunks
from rapidfire_hf.ppo.types import Rollout

if TYPE_CHECKING:
    from accelerate import Accelerator

    from rapidfire_hf.distributed.features import EngineSupport
    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.ppo.modeling import PolicyAndValue
    from rapidfire_hf.ppo.speedups import KernelPatches


def sampling_params(args, sampling: bool = True):
    """The rollout's ``SamplingParams`` from a PPOConfig: ``response_length`` new tokens at its temperature
    (+1e-7, so that 0 stays finite), top-k and top-p; greedy when not ``sampling``."""
    from rapidfire_hf.rollout import SamplingParams

    return SamplingParams(
        max_new_tokens=args.response_length,
        temperature=args.temperature + 1e-7,
        top_k=args.top_k,
        top_p=args.top_p,
        do_sample=sampling,
    )


class Roller:
    """The rollout phase: responses generated for a batch of prompts with the current policy.

    Args:
        args: the PPOConfig (sampling settings, rollout backend and decode mode).
        accelerator: the trainer's accelerator.
        model: the prepared policy-and-value module (generation runs its policy alone).
        pad_token_id, stop_token_id: the tokenizer's pad token and the token that ends a response.
        kernel_patches: the trainer's kernel patches (generation runs the models' own kernels).
        engine_support: what the distributed engine supports (under FSDP2 the engine runs on the policy gathered
            once per rollout; under ZeRO-3 "auto" is "hf": :func:`rollout_backend`).
        chunks: runs generation in chunks of prompts, smaller after an OOM.

    The :class:`rapidfire_hf.rollout.RolloutEngine` is built at the first rollout and kept in :attr:`engine`.
    """

    def __init__(
        self,
        args: PPOConfig,
        accelerator: Accelerator,
        model: PolicyAndValue,
        pad_token_id: int,
        stop_token_id: int | None,
        kernel_patches: KernelPatches,
        engine_support: EngineSupport,
        chunks: NoGradChunks,
    ):
        self.args = args
        self.accelerator = accelerator
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_id = stop_token_id
        self.kernel_patches = kernel_patches
        self.engine_support = engine_support
        self.chunks = chunks
        self.engine = None
        # the sampling settings of a rollout (True) and of a greedy one (False): built once from the config,
        # which a trainer never changes after construction (train() refuses it)
        self.sampling = {s: sampling_params(args, s) for s in (True, False)}

    def rollout(
        self,
        batch: dict,
        generation_rows: int | None,
        sampling: bool = True,
        generator: torch.Generator | None = None,
        fuse_projections: bool = False,
        kv_cache_dtype: str | None = None,
    ) -> Rollout:
        """Generate responses for a batch of prompts (greedy when not ``sampling``), ``generation_rows``
        prompts at a time (all at once when None), the noise drawn from ``generator`` (chunk after chunk;
        None: the global RNG). ``fuse_projections``: the engine's ``decode_fuse_projections`` when this call
        builds it (the plan's decision, ``Plan.fuse_projections``); ``kv_cache_dtype`` likewise its
        ``kv_cache_dtype`` (``Plan.engine_kv_cache_dtype``: the user's ``rollout_kv_cache_dtype``, or what
        ``"auto"`` chose)."""
        device = self.accelerator.device
        policy = self.accelerator.unwrap_model(self.model).policy
        queries = batch["input_ids"].to(device)
        params = self.sampling[bool(sampling)]
        # rollout_generation_batch_size (or the plan) bounds the KV cache: chunks of prompts, one after another
        chunk = generation_rows or queries.shape[0]
        replay = _ChunkReplay(generator)

        def generate_rows(start, stop):
            replay.begin(start)
            part = queries[start:stop]
            out = self.engine.generate(part, part != self.pad_token_id, params, generator=generator)
            return out.responses, out.logprobs.float()

        # generation runs the policy alone: a separate value model stays sharded (ZeRO-3 / FSDP2). Under FSDP2
        # the policy's units are gathered here once for the whole rollout (every chunk; the engine's own gather,
        # rollout/sharded.py, finds them held) and resharded after it
        # the rollout engine runs the models' own kernels (its decode step is compiled and recorded on its own)
        with (
            torch.no_grad(),
            gathered_for_generation(self.accelerator, self.model, policy),
            self.kernel_patches.original(),
        ):
            if self.engine is None:  # built on gathered weights (the generic path probes the model's forward)
                self.engine = self._build_engine(policy, fuse_projections, kv_cache_dtype)
            engine = self.engine
            # an OOM halves the chunk and retries (ppo/recovery.py)
            parts = self.chunks.run(
                generate_rows,
                queries.shape[0],
                chunk,
                "generation",
                "rollout_generation_batch_size",
                on_oom=engine.release,
            )
        responses, logprobs = zip(*parts)
        extra = {k: v for k, v in batch.items() if k != "input_ids"}
        return Rollout(
            queries=queries, responses=torch.cat(responses), logprobs=torch.cat(logprobs), extra=extra
        )

    def _build_engine(self, policy, fuse_projections: bool, kv_cache_dtype: str | None):
        from rapidfire_hf.rollout import RolloutEngine

        args = self.args
        # fused projections are copies of the weights kept for the engine's life: under FSDP2 a whole policy's
        # q/k/v and gate/up on every rank, outside the sharding; the gathered modules run as they are instead
        fuse = bool(fuse_projections) and self.engine_support.engine is not Engine.FSDP2
        stops = [self.stop_token_id] if self.stop_token_id is not None else []
        return RolloutEngine(
            policy,
            self.pad_token_id,
            stops,
            backend=rollout_backend(args, self.engine_support),
            decode_mode=args.rollout_decode_mode,
            decode_attention=args.rollout_decode_attention,
            decode_sampler=args.rollout_decode_sampler,
            decode_fuse_projections=fuse,
            decode_linear=args.rollout_decode_linear,
            # LoRA layers join the fused projections only where the plan fuses at all
            decode_fuse_lora=fuse and args.rollout_decode_fuse_lora,
            # an 8-bit cache the engine cannot keep was refused at start (ppo/settings_check.py); the engine
            # refuses it again by name if its path changed since
            kv_cache_dtype=kv_cache_dtype,
        )


class _ChunkReplay:
    """Puts ``generator`` back to where it was when a chunk is run again from the same row (a retry in
    smaller pieces after an OOM), so the retry draws what a run with the smaller chunk draws; the chunk
    runner puts the global RNG back the same way."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.start: int | None = None
        self.state: torch.Tensor | None = None

    def begin(self, start: int) -> None:
        if self.generator is None:
            return
        if start == self.start:
            self.generator.set_state(self.state)
        else:
            self.start, self.state = start, self.generator.get_state()


# why PPO's rollout runs model.generate under ZeRO-3 (the start table says it)
ZERO3_ROLLOUT = (
    "DeepSpeed ZeRO-3: model.generate runs on the policy gathered once per rollout (GatheredParameters); "
    "rollout_backend='static' runs the engine inside that gather (checked on the CPU in a PPO run, not yet on GPUs)"
)


def rollout_backend(args, engine_support) -> str:
    """The configured backend, except "hf" for "auto" under ZeRO-3 (:data:`ZERO3_ROLLOUT`). Under FSDP2 the
    engine runs on the policy gathered once per rollout (recorded graphs are keyed by the gathered weights'
    addresses, so a rollout whose gather lands elsewhere records anew)."""
    zero3 = engine_support.engine is Engine.ZERO3
    return "hf" if zero3 and args.rollout_backend == "auto" else args.rollout_backend
