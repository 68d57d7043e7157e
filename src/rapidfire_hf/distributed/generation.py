"""Generation with sharded weights: gather them once per rollout, not once per decode step.

Under ZeRO-3 and FSDP2 every module forward gathers its weights and frees them afterwards. A
rollout of R tokens runs R forwards, so the whole model crosses the interconnect R times. Gathering
all weights once before the rollout and releasing them after costs one model's worth of memory on
each GPU for the duration of generation and turns R all-gathers into one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


def gathered_for_generation(
    accelerator, model: torch.nn.Module, submodule: torch.nn.Module | None = None
) -> AbstractContextManager[torch.nn.Module]:
    """A context that yields the unwrapped model with all of its weights (or those of ``submodule``) present
    on this rank.

    DDP and single-device models are yielded as they are, by a plain ``nullcontext``: nothing is gathered, so
    no context of this module is entered (the engine is read when this is called). A collective under ZeRO-3
    and FSDP2: every rank must enter it (generate on every rank, even with nothing to generate).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (DeepSpeed engine, FSDP2 module, DDP module).
        submodule: a part of the unwrapped model that is all the caller runs (PPO's policy, for
            generation): only its weights are gathered (ZeRO-3), only its FSDP2 units and the root are
            unsharded. With a separate 7B value model this leaves ~13 GiB per GPU ungathered during
            the rollout. None gathers everything.

    Returns:
        A context manager yielding the unwrapped ``nn.Module`` to call ``generate``/forward on; its weights
        must not be modified.
    """
    from rapidfire_hf.distributed.features import Engine, detect_engine

    engine = detect_engine(accelerator)
    unwrapped = accelerator.unwrap_model(model)
    if engine not in (Engine.ZERO3, Engine.FSDP2) or getattr(model, _GATHERED, False):
        # nested use (a subclass gathering around rollout(), which gathers itself) is a no-op: DeepSpeed
        # refuses overlapping GatheredParameters (seen under ZeRO-3 on 2x H200), and an inner FSDP2
        # exit would reshard under the outer context
        return nullcontext(unwrapped)
    return _gathered(
        model, submodule, _zero3_gathered if engine is Engine.ZERO3 else _fsdp2_unsharded, unwrapped
    )


@contextmanager
def _gathered(model: torch.nn.Module, submodule, gather, unwrapped: torch.nn.Module):
    """``gather``'s context around ``model`` (marked gathered inside, so that a nested call gathers nothing)."""
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
    with held_unsharded(units):
        yield


@contextmanager
def held_unsharded(units: list):
    """Each FSDP2 unit of ``units`` (``FSDPModule``) all-gathered once on entry and kept gathered until exit: the
    units' post-forward resharding is off meanwhile, so forwards inside find them gathered and leave them so
    (R decode steps: one all-gather per unit instead of R). On exit each unit this call gathered is resharded,
    and every unit's ``reshard_after_forward`` is put back as it was.

    Nested use gathers once: a unit an enclosing call holds (PPO's rollout around the rollout engine's own
    gather, ``rollout/sharded.py``) is left to it, gathered at this exit. A unit gathered on entry by anything
    else (the root after a forward: FSDP2 keeps it unsharded) is resharded at exit like the others.
    """
    units = [u for u in units if id(u) not in _HELD]
    saved = [_reshards_after_forward(u) for u in units]
    _HELD.update(id(u) for u in units)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()  # one all-gather per unit for the whole block (none for a unit already gathered)
        yield
    finally:
        for unit, was in zip(units, saved):
            unit.reshard()
            unit.set_reshard_after_forward(was, recurse=False)
            _HELD.discard(id(unit))


_HELD: set[int] = set()  # ids of the units a held_unsharded block holds now


def _param_group(unit):
    return unit._get_fsdp_state()._fsdp_param_group  # None for a unit that holds no parameters of its own


def _reshards_after_forward(unit) -> bool:
    # torch has a setter and no getter: a unit whose post-forward frees its gathered weights keeps the mesh
    # it reshards to in its parameter group (None when it keeps them, as the root does)
    group = _param_group(unit)
    return group is not None and group.post_forward_mesh_info is not None
