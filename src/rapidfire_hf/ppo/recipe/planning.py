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
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
from accelerate.utils import DistributedType

from rapidfire_hf.memory.checkpointing import (
    activation_bytes,
    allowed_levels,
    apply_selective_checkpointing,
    level_budget,
    user_checkpointing,
)
from rapidfire_hf.memory.estimate import DecoderShape, analytic_probe
from rapidfire_hf.memory.kv_choice import AUTO as KV_AUTO
from rapidfire_hf.memory.kv_choice import EIGHT_BIT, cache_unable, choose_kv_cache
from rapidfire_hf.memory.offload_plan import choose_offload, with_offload_of
from rapidfire_hf.memory.oom import pipeline_state
from rapidfire_hf.memory.phase_offload import PhaseOffload
from rapidfire_hf.memory.planner import (
    LEVEL_POLICY,
    POLICY_LEVEL,
    Asked,
    Plan,
    Probe,
    Workload,
    decide_fused_copies,
    kv_bytes_per_token,
    level_target,
    make_plan,
    unplanned,
    unplanned_fused_copies,
)
from rapidfire_hf.optim.step_health import eight_bit_optimizer
from rapidfire_hf.ppo.config import engine_kv_cache_dtype
from rapidfire_hf.ppo.recipe.probe_cache import ProbeCache
from rapidfire_hf.ppo.rollout_phase import rollout_backend
from rapidfire_hf.rollout.engine import eight_bit_cache_reason, resolved_backend
from rapidfire_hf.rollout.llama_forward import fused_projection_bytes, ring_windows
from rapidfire_hf.utils.device_memory import device_capacity_bytes

logger = logging.getLogger("rapidfire_hf.ppo.trainer")


@dataclass(frozen=True)
class PlanInputs:
    """What the plan reads of a PPOTrainer, built by ``PPOTrainer.plan_inputs()``: the planning functions take
    this, never the trainer, and return the plan (:class:`PlannedRun`) that the trainer applies to itself."""

    args: Any  # the PPOConfig
    accelerator: Any  # device, mixed precision, processes, distributed type
    module: Any  # the unwrapped PolicyAndValue (policy, value model or fused head)
    model: Any  # the prepared model (its trained parameters)
    memory: Any  # the rapidfire config's MemoryConfig, or None (no rapidfire config: nothing measured)
    optimizer: Any  # the prepared optimizer
    state_decision: tuple[bool, str] | None  # the 8-bit-state choice of a config-built optimizer
    is_peft: bool
    use_liger: bool
    pad_token_id: int
    engine_support: Any  # what the distributed engine supports (rollout backend)
    engine: Any  # the rollout engine if a rollout already built it, else None
    ref_model: Any  # the separate frozen reference, or None
    reward_model: Any  # or None
    host_offload_include_cpu: bool = False  # tests: a CPU model counts as movable for host offload
    frozen_choice: Any = None  # the FrozenChoice of "auto" frozen precision (memory.frozen_choice), or None


@dataclass(frozen=True)
class PlannedRun:
    """What :func:`plan_run` decided: the plan and what host offload moves between the phases (None: nothing)."""

    plan: Plan
    offload: PhaseOffload | None


def workload(args, policy, prompt_tokens: int, itemsize: int, cache_persists: bool = False) -> Workload:
    """The :class:`Workload` of one update of ``args`` on ``policy`` (``cache_persists``: the rollout runs the
    static engine, which keeps its KV cache between updates; the cache is in ``args.rollout_kv_cache_dtype``,
    refused at start where the engine cannot keep it; a sliding-window layer's cache is its ring where the
    native path runs the policy: ``rollout.llama_forward.ring_windows``)."""
    policy_config = policy.config
    kv_cache = engine_kv_cache_dtype(args.rollout_kv_cache_dtype)
    return Workload(
        rollout_rows=args.local_batch_size,
        mini_rows=args.local_mini_batch_size,
        micro_rows=args.per_device_train_batch_size,
        prompt_tokens=prompt_tokens,
        response_tokens=args.response_length,
        hidden=policy_config.hidden_size,
        layers=policy_config.num_hidden_layers,
        vocab=policy_config.vocab_size,
        kv_bytes_per_token=kv_bytes_per_token(policy_config, itemsize, kv_cache),
        itemsize=itemsize,
        cache_persists=cache_persists,
        intermediate=getattr(policy_config, "intermediate_size", None),
        kv_cache_dtype=kv_cache,
        kv_windows=ring_windows(policy),
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
        kv_cache_dtype=args.rollout_kv_cache_dtype,
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


def probe_identity(run: PlanInputs, tokens: int, wanted: tuple[str, ...]) -> dict[str, str]:
    """What the measured bytes depend on: the models' shapes and kinds, the trained part, dtype, kernels,
    device, row length, policies, and the versions that measured them (``ppo.probe_cache``)."""
    import transformers

    from rapidfire_hf import __version__

    unwrapped = run.module
    config = unwrapped.policy.config.to_json_string(use_diff=False)
    device = run.accelerator.device
    return {
        "policy": type(unwrapped.policy).__name__,
        "config": hashlib.sha256(config.encode()).hexdigest()[:24],
        "value": type(unwrapped.value_model).__name__ if unwrapped.value_model is not None else "fused",
        "peft": str(run.is_peft),
        "dtype": str(next(unwrapped.parameters()).dtype),
        "mixed_precision": str(run.accelerator.mixed_precision),
        "liger": str(run.use_liger),
        "compile": str(run.args.torch_compile),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "tokens": str(tokens),
        "policies": ",".join(wanted),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rapidfire_hf": __version__,
    }


def shape_estimate(run: PlanInputs, tokens: int, ctx: int, itemsize: int, wanted) -> dict[str, int] | None:
    """The activation bytes of one row from the policy's shape (:mod:`rapidfire_hf.memory.estimate`), for
    the policies it knows; None where the policy is not a Llama-like decoder it can read."""
    unwrapped = run.module
    try:
        shape = DecoderShape.from_config(unwrapped.policy.config)
    except (AttributeError, TypeError):
        return None
    known = tuple(p for p in wanted if p in ("none", "elementwise", "matmuls"))
    separate = unwrapped.value_model is not None
    return analytic_probe(shape, tokens, tokens - ctx, itemsize, known, separate_value=separate)


def measure(run: PlanInputs, models, tokens: int, ctx: int, wanted: tuple[str, ...]) -> Probe:
    """Activation bytes of one training row of ``tokens`` tokens under each of ``wanted`` (cached)."""
    acc, pad = run.accelerator, run.pad_token_id
    cache = ProbeCache(run.args.output_dir) if acc.is_local_main_process else None
    identity = probe_identity(run, tokens, wanted)
    unwrapped = run.module
    device = acc.device
    if cache is not None:
        mixed = acc.mixed_precision in ("bf16", "fp16")
        itemsize = 2 if mixed else next(unwrapped.parameters()).element_size()
        hit = cache.get(identity, wanted, shape_estimate(run, tokens, ctx, itemsize, wanted))
        if hit is not None:
            return Probe(hit, cached=True, source=f"cached in {cache.path} (verified)")
    vocab = unwrapped.policy.config.vocab_size
    row = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    row[row == pad] = (pad + 1) % vocab  # no padding in the probe row

    def forward():
        with acc.autocast():
            return unwrapped(row, pad, ctx, run.args.temperature, with_entropy=True)

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
        cache.put(identity, measured)
    return Probe(measured)


def fuse_wanted(args, device) -> bool | str | None:
    """What ``rollout_decode_fuse_projections`` asks on ``device``: ``True``, ``False`` or ``"auto"``; None
    where ``"auto"`` has nothing to decide because the decode step is not recorded on a CUDA GPU (fusing pays
    by cutting the recorded step's GEMMs and was measured nowhere else): no copies, no row in the plan."""
    want = args.rollout_decode_fuse_projections
    if want == "auto" and (torch.device(device).type != "cuda" or args.rollout_decode_mode == "eager"):
        return None
    return want


def decode_copies(run: PlanInputs, policy, static: bool) -> tuple[bool | str | None, int, int | None]:
    """``(want, bytes, built)`` of the fused decode projections' weight copies, which the rollout engine
    allocates at its first generation and keeps (static engine only): ``want`` None where they are not
    considered (another engine, or :func:`fuse_wanted` None); ``bytes`` what they would take; ``built`` the
    bytes an engine built before the plan already holds (None: no engine yet; that engine stays as it is)."""
    want = fuse_wanted(run.args, run.accelerator.device) if static else None
    if want is None:
        return None, 0, None
    if run.engine is not None:  # built by a rollout before the plan: its projections stay as they are
        return want, 0, run.engine.copy_bytes()
    lora = run.args.rollout_decode_fuse_lora
    return want, (fused_projection_bytes(policy, lora=lora) if want is not False else 0), None


def _fused(plan: Plan, want, copies: int, built: int | None, device) -> Plan:
    """``plan`` with the fused projections decided without a plan (:func:`unplanned_fused_copies`)."""
    if want is None:
        return plan
    device = torch.device(device)
    total = device_capacity_bytes(device) if device.type == "cuda" else 0
    return unplanned_fused_copies(plan, want, copies, total, built)


def first_step_reserve(run: PlanInputs) -> int:
    """Bytes the first backward and optimizer step still allocate: the gradients not yet there, and
    AdamW's two moments while the optimizer holds no state (in the parameters' dtype; 1 byte each for an
    8-bit optimizer)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    grads = first_step_gradients(run)
    inner = getattr(run.optimizer, "optimizer", run.optimizer)
    if getattr(inner, "state", None):
        return grads
    eight_bit = eight_bit_optimizer(run.optimizer)
    return grads + sum(p.numel() * (2 if eight_bit else 2 * p.element_size()) for p in params)


def first_step_gradients(run: PlanInputs) -> int:
    """Bytes of the gradients the first backward still allocates (trained parameters without ``.grad``):
    the part of :func:`first_step_reserve` that training alone holds (each step's ``zero_grad`` frees them)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    return sum(p.numel() * p.element_size() for p in params if p.grad is None)


def offloadable_frozen(run: PlanInputs, include_cpu: bool = False) -> dict:
    """The frozen models whose weights host offload may move (name -> module): the separate reference and
    the reward model (never trained by the run), each on the device (a CPU one only with ``include_cpu``,
    tests) and not quantized (bitsandbytes' quantized weights carry their own state); none under DeepSpeed (its engine
    owns the weights)."""
    if run.accelerator.distributed_type == DistributedType.DEEPSPEED:
        return {}
    out = {}
    for name, model in (("reference", run.ref_model), ("reward", run.reward_model)):
        params = list(model.parameters()) if isinstance(model, torch.nn.Module) else []
        if not params or any(not p.is_floating_point() for p in params):
            continue
        if any(p.device.type == "meta" or (p.device.type == "cpu" and not include_cpu) for p in params):
            continue
        out[name] = model
    return out


def frozen_weight_bytes(models: dict) -> int:
    """Device bytes of the weights of ``models`` (storages shared between them once)."""
    seen = {}
    for model in models.values():
        for p in model.parameters():
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def build_offload(run: PlanInputs, plan: Plan) -> PhaseOffload | None:
    """What the trainer moves between phases for ``plan`` (None: nothing)."""
    include_cpu = run.host_offload_include_cpu
    frozen = offloadable_frozen(run, include_cpu) if plan.offload_frozen else {}
    optimizer = run.optimizer if plan.offload_state else None
    offload = PhaseOffload.build(frozen, optimizer, include_cpu=include_cpu)
    return offload if offload.active else None


def _forced_offload(plan: Plan, want: str, frozen: int) -> Plan:
    """``plan`` (made without the planner) with ``host_offload='on'`` applied where asked."""
    if want != "on":
        return plan
    plan = replace(plan, reasons=dict(plan.reasons))
    plan.offload_frozen, plan.offload_state = frozen > 0, True
    plan.reasons["offload_frozen"] = plan.reasons["offload_state"] = "your host_offload='on'"
    return plan


def _agreed(acc, plan: Plan) -> Plan:
    """Every process runs the plan of the first one: the number of backward passes per optimizer window
    must be the same on every rank (DDP's all-reduce, DeepSpeed's step), whatever each measured."""
    if acc.num_processes <= 1:
        return plan
    from accelerate.utils import broadcast_object_list

    shared = broadcast_object_list([plan.to_dict()], from_process=0)[0]
    return Plan(**shared)


def kv_auto_unable(run: PlanInputs, static: bool) -> str | None:
    """Why ``rollout_kv_cache_dtype="auto"`` keeps the model's dtype whatever the plan (None: the plans
    decide): :func:`rapidfire_hf.memory.kv_choice.cache_unable`, or an engine built before the plan (a
    rollout outside ``train()``), whose cache stays as built."""
    if run.engine is not None:
        return "the rollout engine was built before the plan; its cache stays as built"
    model = eight_bit_cache_reason(run.module.policy) if static else None
    return cache_unable(static, run.accelerator.device.type == "cuda", model)


def kv_auto_plan(run: PlanInputs, plan: Plan, work: Workload, planned, static: bool, itemsize: int) -> Plan:
    """``plan`` (the cache in the model's dtype), or the plan with an int8 cache where
    :func:`rapidfire_hf.memory.kv_choice.choose_kv_cache` takes it; either with the choice's reason in its
    "KV cache dtype" row. ``planned``: the plan of a workload, made as ``plan`` was."""
    level = run.memory.optimization
    unable = kv_auto_unable(run, static)
    rows = run.args.local_batch_size
    if unable is not None or not level_target(level).kv_cache_8bit:
        return choose_kv_cache(level, None, None, rows, unable).on(plan)
    config = run.module.policy.config
    eight_work = replace(
        work, kv_bytes_per_token=kv_bytes_per_token(config, itemsize, EIGHT_BIT), kv_cache_dtype=EIGHT_BIT
    )
    eight = planned(eight_work)
    choice = choose_kv_cache(level, plan, eight, rows)
    return choice.on(eight if choice.dtype else plan)


def unplanned_run(run: PlanInputs, prompt_tokens: int) -> Plan:
    """The plan before :func:`plan_run` (a phase called outside ``train()``): the user's settings."""
    args, acc, memory = run.args, run.accelerator, run.memory
    unwrapped = run.module
    work = workload(args, unwrapped.policy, prompt_tokens, 2)
    want = asked(args, None, False)
    plan = unplanned(work, want, "none", memory.optimization if memory is not None else "balanced")
    static = resolved_backend(unwrapped.policy, rollout_backend(args, run.engine_support)) == "static"
    fuse, copies, built = decode_copies(run, unwrapped.policy, static)
    return _fused(plan, fuse, copies, built, acc.device)


def plan_run(run: PlanInputs, queries: torch.Tensor) -> PlannedRun:
    """Measure, plan and apply to the models and the accelerator (module docstring); returns the plan and the
    host offload it asks for, which the trainer takes (``PPOTrainer.plan_update``)."""
    args, acc, memory = run.args, run.accelerator, run.memory
    unwrapped = run.module
    models = [m for m in (unwrapped.policy, unwrapped.value_model) if m is not None]
    ctx = queries.shape[1]
    itemsize = 2 if acc.mixed_precision in ("bf16", "fp16") else next(unwrapped.parameters()).element_size()
    static = resolved_backend(unwrapped.policy, rollout_backend(args, run.engine_support)) == "static"
    work = workload(args, unwrapped.policy, ctx, itemsize, cache_persists=static)
    want = asked(args, memory, acc.distributed_type == DistributedType.DEEPSPEED)
    if pipeline_state(run.optimizer)[1]:  # it counts backwards itself: pieces would count as micro-batches
        want = replace(want, split=False)
    fuse, copies, built = decode_copies(run, unwrapped.policy, static)
    include_cpu = run.host_offload_include_cpu
    frozen = frozen_weight_bytes(offloadable_frozen(run, include_cpu))
    if memory is None:
        plan = unplanned(work, want, "gradient_checkpointing" if user_checkpointing(args) else "none")
        plan = _forced_offload(_fused(plan, fuse, copies, built, acc.device), args.host_offload, frozen)
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
            probe = measure(run, models, work.tokens, ctx, wanted)
        except Exception as err:  # a model the measuring dispatch mode cannot run: keep the user's split
            logger.warning(
                "rapidfire: the throughput planner could not measure (%s); your split is kept", err
            )
            plan = _fused(
                unplanned(work, want, wanted[0], memory.optimization), fuse, copies, built, acc.device
            )
            plan = _forced_offload(plan, args.host_offload, frozen)
        else:
            budget = level_budget(acc.device, memory.optimization, first_step_reserve(run))
            budget = replace(budget, grad_bytes=min(budget.reserve_bytes, first_step_gradients(run)))

            def planned(work: Workload) -> Plan:
                room, plan = choose_offload(
                    lambda b: make_plan(work, want, probe, b, memory.optimization),
                    work,
                    budget,
                    frozen,
                    memory.optimization,
                    args.host_offload,
                    state_movable=acc.device.type == "cuda" or include_cpu,
                )
                if fuse is not None:  # the same plan with the copies held: kept only where it changes nothing
                    held = (
                        make_plan(work, want, probe, room.holding(copies), memory.optimization)
                        if copies
                        else plan
                    )
                    plan = with_offload_of(plan, decide_fused_copies(plan, held, fuse, copies, built))
                return plan

            plan = planned(work)
            if args.rollout_kv_cache_dtype == KV_AUTO:  # the model's dtype or int8 (memory.kv_choice)
                plan = kv_auto_plan(run, plan, work, planned, static, itemsize)
        plan = _agreed(acc, plan)
        _apply(models, plan.checkpointing)
        state = run.state_decision  # set when the trainer built the optimizer
        if state is not None:
            plan.optimizer_state = "8-bit" if state[0] else "as built"
            plan.reasons["optimizer_state"] = state[1]
            if not state[0] and state[1] != "fits":
                plan.fits = False
        else:
            plan.reasons["optimizer_state"] = "your optimizer"
        if run.frozen_choice is not None:  # the table's "frozen models" row
            plan = run.frozen_choice.on(replace(plan, reasons=dict(plan.reasons), asked=dict(plan.asked)))
        if acc.is_main_process:
            print(plan.table(), flush=True)
    if plan.merge > 1:  # accelerate closes a window after this many (merged) micro-batches
        acc.gradient_accumulation_steps = args.micro_batches_per_step // plan.merge
    return PlannedRun(plan, build_offload(run, plan))  # and what moves to host memory between the phases
