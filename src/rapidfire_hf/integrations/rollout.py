"""The rollout engine in place of ``model.generate`` inside TRL's GRPOTrainer and RLOOTrainer (trl 1.16).

Both trainers generate in ``_generate_single_turn``; its plain-transformers branch left-pads the prompt
ids, calls ``unwrapped_model.generate`` and returns, per sequence, the completion ids up to and including
the first EOS (GRPO also returns ``logprobs``, ``None`` on that branch). The replacement below keeps that
contract exactly and falls back to TRL's own method whenever a case is outside it (vLLM, continuous
batching, multimodal inputs, or sampling options the engine does not implement).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time

import torch

logger = logging.getLogger(__name__)

# GenerationConfig fields the engine reproduces (sampling) or that do not change what is sampled.
_HANDLED = {
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "pad_token_id", "bos_token_id",
    "eos_token_id", "cache_implementation", "disable_compile", "use_cache", "transformers_version",
}  # fmt: skip
# Fields TRL always sets, harmless at these values. Any other field away from its default (min_p,
# repetition_penalty, no_repeat_ngram_size, min_new_tokens, ...) sends the call back to HF generate,
# so the sampled distribution never silently changes.
_NEUTRAL = {"min_p": (None, 0.0), "repetition_penalty": (None, 1.0), "suppress_tokens": (None, [])}


# SDPA, named: the engine's "auto" (the Triton flash-decoding kernel on a GPU) was measured for PPOTrainer
# only (benchmarks/kernels, fifth and sixth calls); every GRPO number (benchmarks/grpo) is SDPA's
DECODE_ATTENTION = "sdpa"


def supports_rollout(trainer) -> str | None:
    """``None`` when the trainer's generation can run on the engine, else the reason it cannot."""
    if not hasattr(trainer, "_generate_single_turn"):
        return "the trainer has no _generate_single_turn (not a GRPO/RLOO trainer of trl 1.16)"
    if getattr(trainer, "use_vllm", False):
        return "the trainer generates with vLLM"
    if getattr(trainer, "use_transformers_continuous_batching", False):
        return "the trainer uses transformers continuous batching"
    return _unsupported_sampling(trainer)


def _unsupported_sampling(trainer) -> str | None:
    gen = getattr(trainer, "generation_config", None)
    if gen is None:
        return "the trainer has no generation_config"
    for name, value in gen.to_diff_dict().items():
        if name not in _HANDLED and value not in _NEUTRAL.get(name, ()):
            return f"generation_config.{name}={value!r} is not implemented by the rollout engine"
    return None


def sampling_params(trainer):
    """The engine's ``SamplingParams`` equal to the trainer's ``generation_config``."""
    from rapidfire_hf.rollout import SamplingParams

    gen = trainer.generation_config
    return SamplingParams(
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature if gen.temperature is not None else 1.0,
        top_k=gen.top_k or 0,
        top_p=gen.top_p if gen.top_p is not None else 1.0,
        do_sample=bool(gen.do_sample),
    )


def truncate_after_eos(responses: torch.Tensor, eos_ids: list[int]) -> list[list[int]]:
    """Per row, the tokens up to and including the first EOS (all of them when there is none).

    The same rule as TRL's plain-generate branch, so completions have the same format.
    """
    from rapidfire_hf.ppo.core import lengths_through_stop

    responses = responses.cpu()
    lengths = lengths_through_stop(responses, eos_ids)
    return [row[:n].tolist() for row, n in zip(responses, lengths.tolist())]


def _left_pad(prompt_ids: list[list[int]], pad_id: int, multiple: int | None):
    width = max(len(p) for p in prompt_ids)
    if multiple:
        width = -(-width // multiple) * multiple
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompt_ids):
        if p:
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
    return ids, mask


class RolloutPatch:
    """Replaces ``trainer._generate_single_turn`` (instance attribute) with a rollout-engine version.

    Attributes:
        calls: generation calls served by the engine.
        fallbacks: calls handed back to TRL's own method.
        release_after_rollout: drop the engine's KV cache, buffers and graphs after every rollout, and
            free cuBLAS's workspaces (``configure_lowmem``; ``memory.lowmem``).
        prefill_rows: run the static engine's prompt prefill that many prompts at a time (``None``: all).
        timings: with ``release_after_rollout``, per rollout: ``engine_s`` (host seconds of the engine
            call, which ends reading the completions on the host), ``release_s`` (the release) and
            ``prefill_chunked_rollouts`` (whether the prefill was chunked).
    """

    def __init__(self, trainer, backend: str = "auto"):
        self.trainer = trainer
        self.backend = backend
        self.calls = 0
        self.fallbacks = 0
        self._engine = None
        self._engine_model = None
        self.release_after_rollout = False
        self.prefill_rows: int | None = None
        self.timings: dict[str, list] = {}
        self.original = trainer._generate_single_turn
        # GRPO returns (completion_ids, logprobs); RLOO returns completion_ids only.
        self.returns_logprobs = "num_generations" in inspect.signature(self.original).parameters

        @functools.wraps(self.original)
        def generate_single_turn(*args, **kwargs):
            return self.generate_single_turn(*args, **kwargs)

        trainer._generate_single_turn = generate_single_turn

    def stats(self) -> dict[str, int]:
        return {"engine_calls": self.calls, "fallbacks": self.fallbacks}

    def configure_lowmem(self, prefill_rows: int | None) -> None:
        """Release the engine after every rollout (and free cuBLAS workspaces); chunk its prefill."""
        self.release_after_rollout = True
        self.prefill_rows = prefill_rows
        for key in ("engine_s", "release_s", "prefill_chunked_rollouts"):
            self.timings.setdefault(key, [])

    def _chunk_prefill(self) -> bool:
        """Chunk the current engine's prefill (``RolloutEngine.chunk_prefill``); whether it is chunked."""
        if self.prefill_rows is None or self._engine is None:
            return False
        return self._engine.chunk_prefill(self.prefill_rows)

    def _engine_for(self, model):
        # The engine holds the training weights (no copy); rebuild only if the unwrapped model changes.
        if self._engine is None or self._engine_model is not model:
            from rapidfire_hf.rollout import RolloutEngine

            tr = self.trainer
            self._engine = RolloutEngine(
                model,
                pad_token_id=tr._tokenizer.pad_token_id,
                stop_token_ids=list(tr.eos_token_ids),
                backend=self.backend,
                prefill_chunk_rows=self.prefill_rows,
                decode_attention=DECODE_ATTENTION,
            )
            self._engine_model = model
        self._chunk_prefill()  # the engine is built at the first rollout: chunk it from there on
        return self._engine

    def generate_single_turn(self, prompt_ids, images=None, multimodal_fields=None, *args, **kwargs):
        reason = _unsupported_sampling(self.trainer)
        if images is not None or multimodal_fields or kwargs.get("has_tool_images") or reason:
            self.fallbacks += 1
            return self.original(prompt_ids, images, multimodal_fields, *args, **kwargs)
        completion_ids = self._generate(prompt_ids)
        self.calls += 1
        return (completion_ids, None) if self.returns_logprobs else completion_ids

    def _generate(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        if not self.release_after_rollout:
            return self._generate_once(prompt_ids)
        t0 = time.perf_counter()
        try:
            return self._generate_once(prompt_ids)
        finally:
            t1 = time.perf_counter()
            self.timings["prefill_chunked_rollouts"].append(self._chunk_prefill())
            if self._engine is not None:
                self._engine.release()
            from rapidfire_hf.memory.stats import clear_cublas_workspaces

            clear_cublas_workspaces()  # no recorded graph uses them after the release
            self.timings["engine_s"].append(t1 - t0)
            self.timings["release_s"].append(time.perf_counter() - t1)

    def _generate_once(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        from trl.models import unwrap_model_for_generation

        from rapidfire_hf.memory.oom import run_in_chunks

        tr = self.trainer
        ids, mask = _left_pad(prompt_ids, tr._tokenizer.pad_token_id, tr.pad_to_multiple_of)
        device = tr.accelerator.device
        # The same context as TRL's branch: ZeRO-3 parameters gathered, gradient checkpointing off, the
        # KV cache on while generating; FSDP parameters summoned.
        with contextlib.ExitStack() as stack:
            model = stack.enter_context(
                unwrap_model_for_generation(
                    tr.model_wrapped,
                    tr.accelerator,
                    gather_deepspeed3_params=tr.args.ds3_gather_for_generation,
                    generation_kwargs=tr.generation_kwargs,
                    gradient_checkpointing_kwargs=tr.args.gradient_checkpointing_kwargs,
                )
            )
            stack.enter_context(torch.no_grad())
            if getattr(tr, "_dist", None) is not None:
                stack.enter_context(tr._dist.summon_full_params(tr.model_wrapped, recurse=False))
            engine, params = self._engine_for(model), sampling_params(tr)
            ids, mask = ids.to(device), mask.to(device)
            # an OOM halves the prompts generated at once and retries (memory.oom.run_in_chunks)
            parts = run_in_chunks(
                lambda a, b: engine.generate(ids[a:b], mask[a:b], params).responses,
                ids.shape[0],
                ids.shape[0],
                "generation",
                on_oom=engine.release,
                device=device,
                advice="Lower max_completion_length or max_prompt_length.",
            )
        completions = truncate_after_eos(torch.cat(parts), list(tr.eos_token_ids))
        memory = getattr(getattr(tr, "_rapidfire", None), "parts", {}).get("memory")
        if memory is not None:
            # the rollout -> train boundary: the memory part releases the generation's cached blocks
            memory.phase_boundary("rollout", "train", step=tr.state.global_step)
        return completions


def install_rollout(trainer, backend: str = "auto") -> RolloutPatch:
    """Patch a GRPO/RLOO trainer's generation (see ``RolloutPatch``); raise ``ValueError`` if unsupported."""
    reason = supports_rollout(trainer)
    if reason is not None:
        raise ValueError(reason)
    return RolloutPatch(trainer, backend=backend)
