"""FSDP2-sharded policies: the weights gathered once per rollout, not once per token.

Under FSDP2 (``fully_shard``) each unit's parameters are ``DTensor`` shards between forwards; a forward's
pre-hook all-gathers the unit and, with ``reshard_after_forward``, its post-hook frees the gathered copy
again, so ``model.generate`` gathers every unit at every token. :func:`gathered` all-gathers each unit
once, keeps it gathered for the whole rollout (the units' post-forward resharding off meanwhile) and
reshards at the end: the native step reads the gathered modules directly, the generic step runs the
model's own forward, whose hooks then find every unit already gathered.
"""

from __future__ import annotations

import contextlib

from torch.distributed.fsdp import FSDPModule


def fsdp_units(model) -> list[FSDPModule]:
    """The ``fully_shard`` units inside ``model`` (empty for an unsharded model)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reshards_after_forward(unit: FSDPModule) -> bool:
    # torch has a setter and no getter: a unit whose post-forward frees its gathered weights keeps the mesh
    # it reshards to in its parameter group (None when it keeps them, as the root does)
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


@contextlib.contextmanager
def gathered(model):
    """Every FSDP2 unit of ``model`` all-gathered once on entry and kept gathered until exit, where each is
    resharded and its ``reshard_after_forward`` put back. A no-op for a model without units."""
    units = fsdp_units(model)
    if not units:
        yield
        return
    saved = [_reshards_after_forward(u) for u in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()  # one all-gather per unit for the whole rollout
        yield
    finally:
        for unit, was in zip(units, saved):
            unit.reshard()
            unit.set_reshard_after_forward(was, recurse=False)
