"""FSDP2-sharded policies: the weights gathered once per rollout, not once per token.

Under FSDP2 (``fully_shard``) each unit's parameters are ``DTensor`` shards between forwards; a forward's
pre-hook all-gathers the unit and, with ``reshard_after_forward``, its post-hook frees the gathered copy
again, so ``model.generate`` gathers every unit at every token. :func:`gathered` all-gathers each unit
once, keeps it gathered for the whole rollout (the units' post-forward resharding off meanwhile) and
reshards at the end: the native step reads the gathered modules directly, the generic step runs the
model's own forward, whose hooks then find every unit already gathered.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from rapidfire_hf.distributed.generation import held_unsharded


def fsdp_units(model) -> list[FSDPModule]:
    """The ``fully_shard`` units inside ``model`` (empty for an unsharded model)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gathered(model):
    """Every FSDP2 unit of ``model`` all-gathered once on entry and kept gathered until exit, where each is
    resharded and its ``reshard_after_forward`` put back (``distributed.generation.held_unsharded``; units an
    enclosing gather holds, as PPO's rollout does, are left to it). A no-op for a model without units."""
    return held_unsharded(fsdp_units(model))


# why the engine refuses a ZeRO-3 model outside a gather (llama_forward / generic_forward say it)
ZERO3_PARTITIONED = (
    "DeepSpeed ZeRO-3 partitions the weights and they are not gathered now; build and run the engine inside a "
    "gather of them (PPOTrainer's rollout gathers the policy once per rollout) or generate through model.generate"
)


def zero3_partitioned(model) -> bool:
    """Whether some parameter of ``model`` is a DeepSpeed ZeRO-3 partition not gathered now (inside
    ``deepspeed.zero.GatheredParameters`` every one is whole: ``ds_status`` AVAILABLE). DeepSpeed is not imported."""
    return any(
        hasattr(p, "ds_id") and getattr(getattr(p, "ds_status", None), "name", None) != "AVAILABLE"
        for p in model.parameters()
    )
