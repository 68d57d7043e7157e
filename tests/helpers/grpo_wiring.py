"""The hand wiring of the low-memory mechanisms around a GRPOTrainer's rollout (release the rollout engine after
each rollout, chunk its prefill, move the optimizer state to the host during it): the reference that the
tests of ``memory.lowmem`` compare the library switch with. Applies the library's mechanisms through the
trainer's private rollout patch, as the switch itself does."""

from __future__ import annotations

import time

from rapidfire_hf.utils.units import GIB


def release_rollout_cache_after_each_rollout(
    trainer, state_offload=None, prefill_rows: int | None = None, clear_workspaces: bool = False, timings=None
) -> bool:
    """Make the installed rollout engine drop its KV cache, buffers and graphs after every rollout.

    With ``state_offload`` (an ``OptimizerStateOffload``), the optimizer state is
    also moved to the host before each rollout and back after it. ``prefill_rows``
    chunks the engine's prompt prefill (``RolloutEngine.chunk_prefill``) and ``clear_workspaces`` frees cuBLAS's
    workspaces after each release. ``timings`` (a dict) collects per rollout the host seconds of the
    engine call (it ends with a device sync: the completions are read on the host) and of the
    offload / release / restore around it.
    """
    patch = trainer._rapidfire.parts.get("rollout")
    if patch is None:
        return False
    generate = patch._generate
    times = timings if timings is not None else {}
    for key in ("state_offload_s", "engine_s", "release_s", "state_restore_s", "prefill_chunked_rollouts"):
        times.setdefault(key, [])

    def chunk_prefill_once():
        engine = patch._engine
        if prefill_rows is None or engine is None:
            return False
        return engine.chunk_prefill(prefill_rows)  # RolloutEngine: the static backend only

    if prefill_rows is not None:
        engine_for = patch._engine_for

        def engine_for_chunked(model):  # the engine is built at the first rollout: chunk it from there on
            engine = engine_for(model)
            chunk_prefill_once()
            return engine

        patch._engine_for = engine_for_chunked

    def generate_then_release(prompt_ids):
        t0 = time.perf_counter()
        if state_offload is not None:
            state_offload.offload()
        t1 = time.perf_counter()
        try:
            return generate(prompt_ids)
        finally:
            t2 = time.perf_counter()
            times["prefill_chunked_rollouts"].append(chunk_prefill_once())
            if patch._engine is not None:
                patch._engine.release()
            if clear_workspaces:
                from rapidfire_hf.memory.stats import clear_cublas_workspaces

                clear_cublas_workspaces()
            t3 = time.perf_counter()
            if state_offload is not None:
                state_offload.restore()
            t4 = time.perf_counter()
            for key, dt in zip(
                ("state_offload_s", "engine_s", "release_s", "state_restore_s"),
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3),
            ):
                times[key].append(dt)

    patch._generate = generate_then_release
    return True


class LazyStateOffload:
    """``OptimizerStateOffload`` of ``trainer.optimizer``, built at the first rollout (after create_optimizer)."""

    def __init__(self, trainer, cls, include_cpu: bool):
        self.trainer, self.cls, self.include_cpu = trainer, cls, include_cpu
        self.impl = None
        self.moved: list[int] = []

    def offload(self) -> None:
        if self.impl is None and self.trainer.optimizer is not None:
            self.impl = self.cls(self.trainer.optimizer, include_cpu=self.include_cpu)
        if self.impl is not None:
            self.moved.append(self.impl.offload())

    def restore(self) -> None:
        if self.impl is not None:
            self.impl.restore()

    def wait(self) -> None:
        if self.impl is not None:
            self.impl.wait()

    def install_wait(self, accelerator) -> None:
        """The restored state must be complete before backward, where the pipeline steps buckets."""
        backward = accelerator.backward

        def backward_after_restore(*args, **kwargs):
            self.wait()
            return backward(*args, **kwargs)

        accelerator.backward = backward_after_restore

    def stats(self) -> dict:
        return {
            "rollouts": len(self.moved),
            "gib_per_rollout": [m / GIB for m in self.moved],
            "storages_not_movable": self.impl.skipped if self.impl is not None else 0,
        }
