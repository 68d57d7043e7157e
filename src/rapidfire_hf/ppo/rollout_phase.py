"""The rollout phase of PPOTrainer (a mixin): the prompt batch of an update, and responses generated
for it with the current policy by ``rapidfire_hf.rollout``."""

from __future__ import annotations

import torch

from rapidfire_hf.distributed.generation import gathered_for_generation
from rapidfire_hf.ppo.types import Rollout


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


class RolloutMixin:
    """Prompt batches and generation of ``PPOTrainer``."""

    def next_prompts(self, batch_index: int) -> dict:
        rows = [self.train_dataset[i] for i in self.prompt_order.indices(batch_index)]
        return self.data_collator(rows)

    def _next_batch(self, update: int) -> dict:
        """The prompt batch of ``update``: from the prefetcher while ``train()`` runs, else collated now."""
        prompts = getattr(self, "_prompts", None)
        return prompts.take(update) if prompts is not None else self.next_prompts(update)

    def rollout(self, batch: dict, sampling: bool = True) -> Rollout:
        """Generate responses for a batch of prompts with the current policy (greedy when not ``sampling``)."""
        from rapidfire_hf.ppo.planning import unplanned_run
        from rapidfire_hf.rollout import RolloutEngine

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
        params = sampling_params(args, sampling)
        # generation runs the policy alone: a separate value model stays sharded (ZeRO-3 / FSDP2)
        # the rollout engine runs the models' own kernels (its decode step is compiled and recorded on its own)
        # rollout_generation_batch_size (or the plan) bounds the KV cache: chunks of prompts, one after another
        plan = self.plan or unplanned_run(self, queries.shape[1])
        chunk = plan.generation_rows or queries.shape[0]

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
