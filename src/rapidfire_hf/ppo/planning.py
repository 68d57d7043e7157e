"""PPOTrainer's throughput plan: ``memory.optimization`` as a target (``rapidfire_hf.memory.planner``).

At the first update, before the rollout, :func:`plan_run` measures the activation bytes one training row
keeps under each checkpointing policy the level allows (a one-row forward through the policy and value
model per policy; cached per model shape and device in ``<output_dir>/rapidfire_plan_probe.json``), reads
the device's memory, and asks :func:`rapidfire_hf.memory.planner.make_plan` for the training micro-batch,
the checkpointing policy and the scoring and generation chunks. The plan is applied (checkpointing on the
models, accelerate's accumulation steps for a merged micro-batch), printed once as a table and logged to
the trackers as ``rapidfire/plan/*``. Without a rapidfire config nothing is measured: the user's split,
no recompute, TRL's chunk defaults.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from rapidfire_hf.memory.checkpointing import (
    activation_bytes,
    allowed_levels,
    apply_selective_checkpointing,
    level_budget,
    user_checkpointing,
)
from rapidfire_hf.memory.planner import (
    LEVEL_POLICY,
    POLICY_LEVEL,
    Asked,
    Plan,
    Probe,
    Workload,
    decide_fused_copies,
    kv_bytes_per_token,
    make_plan,
    unplanned,
    unplanned_fused_copies,
)
from rapidfire_hf.ppo.rollout_phase import rollout_backend
from rapidfire_hf.rollout.engine import resolved_backend
from rapidfire_hf.rollout.llama_forward import fused_projection_bytes

logger = logging.getLogger("rapidfire_hf.ppo.trainer")

PROBE_CACHE = "rapidfire_plan_probe.json"
PROBE_CACHE_VERSION = 1


def workload(
    args, policy_config, prompt_tokens: int, itemsize: int, cache_persists: bool = False
) -> Workload:
    """The :class:`Workload` of one update of ``args`` on a policy of ``policy_config`` (``cache_persists``:
    the rollout runs the static engine, which keeps its KV cache between updates)."""
    return Workload(
        rollout_rows=args.local_batch_size,
        mini_rows=args.local_mini_batch_size,
        micro_rows=args.per_device_train_batch_size,
        prompt_tokens=prompt_tokens,
        response_tokens=args.response_length,
        hidden=policy_config.hidden_size,
        layers=policy_config.num_hidden_layers,
        vocab=policy_config.vocab_size,
        kv_bytes_per_token=kv_bytes_per_token(policy_config, itemsize),
        itemsize=itemsize,
        cache_persists=cache_persists,
    )


def asked(args, memory, deepspeed: bool) -> Asked:
    """What the user set in ``args`` and the memory config (``"auto"`` -> ``None``)."""
    scoring = args.local_rollout_forward_batch_size
    generation = args.rollout_generation_batch_size
    if user_checkpointing(args):
        checkpointing = "gradient_checkpointing"
    else:
        checkpointing = memory.checkpointing.value if memory is not None else "off"
    return Asked(
        scoring_rows=None if scoring == "auto" else scoring,
        generation_rows=None if generation == "auto" else (generation or 0),
        checkpointing=checkpointing,
        planner=bool(memory is not None and memory.planner),
        merge=not deepspeed,
        free_cache=args.rollout_cache == "auto",
    )


def policies(memory, checkpointing: str) -> tuple[str, ...]:
    """The checkpointing policies the run may apply, least recompute first (``allowed_levels``)."""
    if checkpointing == "gradient_checkpointing":
        return ("gradient_checkpointing",)
    return tuple(LEVEL_POLICY[lv] for lv in allowed_levels(memory.optimization, checkpointing))


def _apply(models, policy: str) -> None:
    if policy == "gradient_checkpointing":
        return  # HF's own checkpointing, enabled by the trainer, stays
    for m in models:
        apply_selective_checkpointing(m, POLICY_LEVEL[policy])


class ProbeCache:
    """Measured activation bytes per row, by probe key, in one JSON file written atomically.

    A file that cannot be read (damaged, another format) is ignored with a warning and measured again;
    nothing in it is trusted beyond a dict of non-negative integers.
    """

    def __init__(self, folder):
        self.path = Path(folder) / PROBE_CACHE

    def _read(self) -> dict:
        try:
            if not self.path.is_file():  # inside: a name over the system's limit raises here too
                return {}
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != PROBE_CACHE_VERSION:
                raise ValueError("not a probe cache of this version")
            return data["entries"] if isinstance(data.get("entries"), dict) else {}
        except (OSError, ValueError, UnicodeDecodeError) as err:
            logger.warning(
                "rapidfire: ignoring the plan's probe cache %s (%s); measuring again", self.path, err
            )
            return {}

    def get(self, key: str, wanted: tuple[str, ...]) -> dict[str, int] | None:
        entry = self._read().get(key)
        if not isinstance(entry, dict) or set(entry) != set(wanted):
            return None
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry.values()):
            return None
        return {p: entry[p] for p in wanted}

    def put(self, key: str, measured: dict[str, int]) -> None:
        try:
            entries = self._read()
            entries[key] = measured
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": PROBE_CACHE_VERSION, "entries": entries}, indent=1))
            os.replace(tmp, self.path)
        except OSError as err:  # a read-only or full disk: the plan stands, only the cache is lost
            logger.warning("rapidfire: could not write the plan's probe cache %s (%s)", self.path, err)


def probe_key(trainer, tokens: int, wanted: tuple[str, ...]) -> str:
    """What the measured bytes depend on: the models' shapes and kinds, dtype, kernels, device, length."""
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    parts = [
        type(unwrapped.policy).__name__,
        unwrapped.policy.config.to_json_string(use_diff=False),
        type(unwrapped.value_model).__name__ if unwrapped.value_model is not None else "fused",
        str(trainer.is_peft),
        str(next(unwrapped.parameters()).dtype),
        str(trainer.accelerator.mixed_precision),
        str(trainer._use_liger),
        str(trainer.args.torch_compile),
        torch.cuda.get_device_name(trainer.accelerator.device)
        if trainer.accelerator.device.type == "cuda"
        else "cpu",
        str(tokens),
        ",".join(wanted),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def measure(trainer, models, tokens: int, ctx: int, wanted: tuple[str, ...]) -> Probe:
    """Activation bytes of one training row of ``tokens`` tokens under each of ``wanted`` (cached)."""
    cache = ProbeCache(trainer.args.output_dir) if trainer.accelerator.is_local_main_process else None
    key = probe_key(trainer, tokens, wanted)
    hit = cache.get(key, wanted) if cache is not None else None
    if hit is not None:
        return Probe(hit, cached=True)
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    device = trainer.accelerator.device
    vocab = unwrapped.policy.config.vocab_size
    row = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    row[row == trainer.pad_token_id] = (trainer.pad_token_id + 1) % vocab  # no padding in the probe row

    def forward():
        with trainer.accelerator.autocast():
            return unwrapped(row, trainer.pad_token_id, ctx, trainer.args.temperature, with_entropy=True)

    was_training = unwrapped.training
    unwrapped.train()  # HF layers checkpoint only in training mode
    eager = getattr(torch.compiler, "set_stance", None)
    measured = {}
    try:
        for policy in wanted:
            _apply(models, policy)
            if eager is not None:
                with eager("force_eager"):  # the measuring dispatch mode runs the layers eagerly
                    measured[policy] = activation_bytes(forward)
            else:
                measured[policy] = activation_bytes(forward)
    finally:
        unwrapped.train(was_training)
        for p in unwrapped.parameters():
            p.grad = None
    if cache is not None:
        cache.put(key, measured)
    return Probe(measured)


def fuse_wanted(args, device) -> bool | str | None:
    """What ``rollout_decode_fuse_projections`` asks on ``device``: ``True``, ``False`` or ``"auto"``; None
    where ``"auto"`` has nothing to decide because the decode step is not recorded on a CUDA GPU (fusing pays
    by cutting the recorded step's GEMMs and was measured nowhere else): no copies, no row in the plan."""
    want = args.rollout_decode_fuse_projections
    if want == "auto" and (torch.device(device).type != "cuda" or args.rollout_decode_mode == "eager"):
        return None
    return want


def decode_copies(trainer, policy, static: bool) -> tuple[bool | str | None, int, int | None]:
    """``(want, bytes, built)`` of the fused decode projections' weight copies, which the rollout engine
    allocates at its first generation and keeps (static engine only): ``want`` None where they are not
    considered (another engine, or :func:`fuse_wanted` None); ``bytes`` what they would take; ``built`` the
    bytes an engine built before the plan already holds (None: no engine yet; that engine stays as it is)."""
    want = fuse_wanted(trainer.args, trainer.accelerator.device) if static else None
    if want is None:
        return None, 0, None
    engine = trainer.roller.engine
    if engine is not None:  # built by a rollout before the plan: its projections stay as they are
        return want, 0, engine.copy_bytes()
    lora = trainer.args.rollout_decode_fuse_lora
    return want, (fused_projection_bytes(policy, lora=lora) if want is not False else 0), None


def _fused(plan: Plan, want, copies: int, built: int | None, device) -> Plan:
    """``plan`` with the fused projections decided without a plan (:func:`unplanned_fused_copies`)."""
    if want is None:
        return plan
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return unplanned_fused_copies(plan, want, copies, total, built)


def first_step_reserve(trainer) -> int:
    """Bytes the first backward and optimizer step still allocate: the gradients not yet there, and
    AdamW's two moments while the optimizer holds no state (in the parameters' dtype; 1 byte each for an
    8-bit optimizer)."""
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params if p.grad is None)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    if getattr(inner, "state", None):
        return grads
    eight_bit = "8bit" in type(getattr(inner, "_inner", inner)).__name__.lower()
    return grads + sum(p.numel() * (2 if eight_bit else 2 * p.element_size()) for p in params)


def _agreed(acc, plan: Plan) -> Plan:
    """Every process runs the plan of the first one: the number of backward passes per optimizer window
    must be the same on every rank (DDP's all-reduce, DeepSpeed's step), whatever each measured."""
    if acc.num_processes <= 1:
        return plan
    from accelerate.utils import broadcast_object_list

    shared = broadcast_object_list([plan.to_dict()], from_process=0)[0]
    return Plan(**shared)


def unplanned_run(trainer, prompt_tokens: int) -> Plan:
    """The plan before :func:`plan_run` (a phase called outside ``train()``): the user's settings."""
    args, acc = trainer.args, trainer.accelerator
    unwrapped = acc.unwrap_model(trainer.model)
    work = workload(args, unwrapped.policy.config, prompt_tokens, 2)
    memory = trainer.rf_config.memory if trainer.rf_config is not None else None
    want = asked(args, None, False)
    plan = unplanned(work, want, "none", memory.optimization if memory is not None else "balanced")
    static = resolved_backend(unwrapped.policy, rollout_backend(args, trainer.engine_support)) == "static"
    fuse, copies, built = decode_copies(trainer, unwrapped.policy, static)
    return _fused(plan, fuse, copies, built, acc.device)


def plan_run(trainer, queries: torch.Tensor) -> Plan:
    """Measure, plan and apply (module docstring); returns the plan, also kept as ``trainer.plan``."""
    args, acc = trainer.args, trainer.accelerator
    memory = trainer.rf_config.memory if trainer.rf_config is not None else None
    unwrapped = acc.unwrap_model(trainer.model)
    models = [m for m in (unwrapped.policy, unwrapped.value_model) if m is not None]
    ctx = queries.shape[1]
    itemsize = 2 if acc.mixed_precision in ("bf16", "fp16") else next(unwrapped.parameters()).element_size()
    static = resolved_backend(unwrapped.policy, rollout_backend(args, trainer.engine_support)) == "static"
    work = workload(args, unwrapped.policy.config, ctx, itemsize, cache_persists=static)
    want = asked(args, memory, acc.distributed_type == DistributedType.DEEPSPEED)
    fuse, copies, built = decode_copies(trainer, unwrapped.policy, static)
    if memory is None:
        plan = unplanned(work, want, "gradient_checkpointing" if user_checkpointing(args) else "none")
        plan = _fused(plan, fuse, copies, built, acc.device)
        # without a plan table: memory held, or a request that cannot be met, is said once
        if (plan.fuse_projections or fuse is True) and acc.is_main_process:
            state = "on" if plan.fuse_projections else "off"
            hint = "; rollout_decode_fuse_projections=False turns them off" if plan.fuse_projections else ""
            print(
                f"rapidfire: fused decode projections {state} ({plan.reasons['fuse_projections']}){hint}",
                flush=True,
            )
    else:
        wanted = policies(memory, want.checkpointing)
        try:
            probe = measure(trainer, models, work.tokens, ctx, wanted)
        except Exception as err:  # a model the measuring dispatch mode cannot run: keep the user's split
            logger.warning(
                "rapidfire: the throughput planner could not measure (%s); your split is kept", err
            )
            plan = _fused(
                unplanned(work, want, wanted[0], memory.optimization), fuse, copies, built, acc.device
            )
        else:
            budget = level_budget(acc.device, memory.optimization, first_step_reserve(trainer))
            plan = make_plan(work, want, probe, budget, memory.optimization)
            if fuse is not None:  # the same plan with the copies held: kept only where it changes nothing
                held = (
                    make_plan(work, want, probe, budget.holding(copies), memory.optimization)
                    if copies
                    else plan
                )
                plan = decide_fused_copies(plan, held, fuse, copies, built)
        plan = _agreed(acc, plan)
        _apply(models, plan.checkpointing)
        state = getattr(trainer, "state_decision", None)  # set when the trainer built the optimizer
        if state is not None:
            plan.optimizer_state = "8-bit" if state[0] else "as built"
            plan.reasons["optimizer_state"] = state[1]
            if not state[0] and state[1] != "fits":
                plan.fits = False
        else:
            plan.reasons["optimizer_state"] = "your optimizer"
        if acc.is_main_process:
            print(plan.table(), flush=True)
    if plan.merge > 1:  # accelerate closes a window after this many (merged) micro-batches
        acc.gradient_accumulation_steps = args.micro_batches_per_step // plan.merge
    trainer.plan = plan
    trainer.checkpointing = None if plan.checkpointing == "none" else plan.checkpointing
    return plan
