"""The rollout phase of PPOTrainer (:class:`Roller`): responses generated for a batch of prompts with the
current policy by ``rapidfire_hf.rollout``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
        engine_support: what the distributed engine supports (the backend is "hf" under ZeRO-3 / FSDP2).
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

    def rollout(
        self,
        batch: dict,
        generation_rows: int | None,
        sampling: bool = True,
        generator: torch.Generator | None = None,
        fuse_projections: bool = False,
    ) -> Rollout:
        """Generate responses for a batch of prompts (greedy when not ``sampling``), ``generation_rows``
        prompts at a time (all at once when None), the noise drawn from ``generator`` (chunk after chunk;
        None: the global RNG). ``fuse_projections``: the engine's ``decode_fuse_projections`` when this call
        builds it (the plan's decision, ``Plan.fuse_projections``)."""
        from rapidfire_hf.rollout import RolloutEngine

        args, device = self.args, self.accelerator.device
        policy = self.accelerator.unwrap_model(self.model).policy
        queries = batch["input_ids"].to(device)
        if self.engine is None:
            stops = [self.stop_token_id] if self.stop_token_id is not None else []
            self.engine = RolloutEngine(
                policy,
                self.pad_token_id,
                stops,
                backend=rollout_backend(args, self.engine_support),
                decode_mode=args.rollout_decode_mode,
                decode_attention=args.rollout_decode_attention,
                decode_sampler=args.rollout_decode_sampler,
                decode_fuse_projections=fuse_projections,
                decode_linear=args.rollout_decode_linear,
                # LoRA layers join the fused projections only where the plan fuses at all
                decode_fuse_lora=bool(fuse_projections) and args.rollout_decode_fuse_lora,
            )
        params = sampling_params(args, sampling)
        # generation runs the policy alone: a separate value model stays sharded (ZeRO-3 / FSDP2)
        # the rollout engine runs the models' own kernels (its decode step is compiled and recorded on its own)
        # rollout_generation_batch_size (or the plan) bounds the KV cache: chunks of prompts, one after another
        chunk = generation_rows or queries.shape[0]
        engine = self.engine

        replay = _ChunkReplay(generator)

        def generate_rows(start, stop):
            replay.begin(start)
            part = queries[start:stop]
            out = engine.generate(part, part != self.pad_token_id, params, generator=generator)
            return out.responses, out.logprobs.float()

        with (
            torch.no_grad(),
            gathered_for_generation(self.accelerator, self.model, policy),
            self.kernel_patches.original(),
        ):  # an OOM halves the chunk and retries (ppo/recovery.py)
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


def rollout_backend(args, engine_support) -> str:
    """The configured backend, except "hf" for sharded weights (recorded graphs would keep pointers
    to weights that ZeRO-3/FSDP2 free again after the rollout)."""
    from rapidfire_hf.distributed import Engine

    sharded = engine_support.engine in (Engine.ZERO3, Engine.FSDP2)
    return "hf" if sharded and args.rollout_backend == "auto" else args.rollout_backend
