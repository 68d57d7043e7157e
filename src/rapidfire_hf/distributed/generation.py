"""Generation with sharded weights: gather them once per rollout, not once per decode step.

Under ZeRO-3 and FSDP2 every module forward gathers its weights and frees them afterwards. A
rollout of R tokens runs R forwards, so the whole model crosses the interconnect R times. Gathering
all weights once before the rollout and releasing them after costs one model's worth of memory on
each GPU for the duration of generation and turns R all-gathers into one.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def gathered_for_generation(accelerator, model: torch.nn.Module, submodule: torch.nn.Module | None = None):
    """Yield the unwrapped model with all of its weights (or those of ``submodule``) present on this rank.

    DDP and single-device models are yielded as they are. A collective under ZeRO-3 and FSDP2:
    every rank must enter it (generate on every rank, even with nothing to generate).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (DeepSpeed engine, FSDP2 module, DDP module).
        submodule: a part of the unwrapped model that is all the caller runs (PPO's policy, for
            generation): only its weights are gathered (ZeRO-3), only its FSDP2 units and the root are
            unsharded. With a separate 7B value model this leaves ~13 GiB per GPU ungathered during
            the rollout. None gathers everything.

    Yields:
        The unwrapped ``nn.Module`` to call ``generate``/forward on; its weights must not be modified.
    """
    from rapidfire_hf.distributed.features import Engine, detect_engine

    engine = detect_engine(accelerator)
    unwrapped = accelerator.unwrap_model(model)
    if engine not in (Engine.ZERO3, Engine.FSDP2) or getattr(model, _GATHERED, False):
        # nested use (a subclass gathering around rollout(), which gathers itself) is a no-op: DeepSpeed
        # refuses overlapping GatheredParameters (seen under ZeRO-3 on 2x H200), and an inner FSDP2
        # exit would reshard under the outer context
        yield unwrapped
        return
    gather = _zero3_gathered if engine is Engine.ZERO3 else _fsdp2_unsharded
    with gather(model, submodule):
        setattr(model, _GATHERED, True)
        try:
            yield unwrapped
        finally:
            setattr(model, _GATHERED, False)


_GATHERED = "_rapidfire_weights_gathered"


@contextmanager
def _zero3_gathered(engine, submodule=None):
    import deepspeed

    params = list((submodule if submodule is not None else engine).parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        # ZeRO-3's per-module hooks would re-partition each layer after its forward (undoing the
        # gather at the first decode step): take them off while generating, put them back after.
        offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
        hooks = list(offload.forward_hooks) + list(offload.backward_hooks)
        for hook in hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)


@contextmanager
def _fsdp2_unsharded(model, submodule=None):
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        # FSDP2 makes the first unit to run forward the root. Rollout and scoring call submodules
        # (decoder layers) directly, which would make a layer the root and break the next forward
        # through the real root ("FSDP state has already been lazily initialized for ...layers.0",
        # seen on 2x H200, torch 2.11). Initialise from the real root first (a no-op once done).
        model._get_fsdp_state()._lazy_init()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if submodule is not None:  # the root (it holds the parameters of no sub-unit) and the submodule's units
        inside = {id(m) for m in submodule.modules()}
        units = [m for m in units if m is model or id(m) in inside]
    for unit in units:
        unit.set_reshard_after_forward(False)  # keep the weights across the decode steps
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True)  # accelerate's fsdp2 default (FULL_SHARD)
