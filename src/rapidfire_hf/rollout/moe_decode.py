"""A routed mixture-of-experts MLP for one decode token per row, with device-only ops and static shapes.

transformers' expert dispatch loops over the experts a batch hit (``nonzero`` on the routing mask, a Python
loop over its rows), which syncs with the host and cannot be recorded as a CUDA graph (on one H100 with
transformers 5.17 the capture failed copying a CPU tensor, and the engine fell back to eager decoding).
Here every row's top-k experts are routed with the model's own router weight, exactly as the family's
modeling file does, then the experts run in one of three forms (:data:`MOE_FORMS`), the same shapes every
step, no host round trip:

- ``"gather"``: each row's k experts' stacked weights gathered (``[B, k, 2I, H]``, a copy of ``B * k``
  expert weights: read, written, read again) and two batched matmuls;
- ``"dense"``: every one of the ``E`` experts on every row (each weight read once, ``E / k`` times the
  FLOPs), the top-k outputs picked;
- ``"grouped"``: the ``B * k`` (row, expert) pairs sorted by expert, per-expert counts by a scatter-add
  over ``E`` slots and their int32 cumulative offsets, then ``torch._grouped_mm`` (torch's grouped GEMM)
  for gate/up and for down: each selected expert's weights read once, no copy. Where torch has no such
  op, or would not run it as one kernel (CUDA: bf16 on sm90 / sm100 only; elsewhere torch loops over the
  groups on the host, which a CUDA graph cannot record), forcing it is refused by name
  (:func:`grouped_form_reason`); traced (``make_fx``, ``torch.compile``) it takes bf16 only (torch's meta
  kernel refuses other dtypes, re-raised naming the form).

Measured on the CPU (one thread, hidden 128, expert width 64, 8 of 128 experts): batch 8 gather
1.6 ms / dense 3.6 ms; batch 64 gather 27.6 ms / dense 12.6 ms (the module's loop: 1.0 / 7.5 ms, but it
cannot be recorded). So ``form=None`` runs dense where ``B * k > E``; below that the grouped GEMM on a CUDA
device where it records, gather elsewhere (:func:`default_form`, with the H100 numbers that chose it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> how the routing weights are made: the top-k of the fp32 softmax renormalised always
# (Mixtral) or per config (norm_topk_prob), or the softmax of the top-k fp32 logits ("logits": Granite-MoE);
# and whether they are cast back to the logits' dtype
_ROUTERS = {
    "qwen3_moe": ("config", True),
    "mixtral": ("always", False),
    "olmoe": ("config", True),
    "flex_olmo": ("config", True),
    "qwen2_moe": ("config", True),
    "granitemoe": ("logits", True),
    "granitemoeshared": ("logits", True),
}
# model_types whose block adds a shared expert, gated per row by a sigmoid: ``shared_expert`` (an MLP) and
# ``shared_expert_gate`` (hidden -> 1), added after the routed experts (Qwen2-MoE)
_SHARED = {"qwen2_moe"}
# the expert forms of :func:`routed_moe` (None picks gather or dense by batch)
MOE_FORMS = ("gather", "dense", "grouped")


def grouped_form_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``form="grouped"`` cannot run on ``device`` in ``dtype`` as one recordable grouped GEMM (None
    when it can): torch without ``torch._grouped_mm``; on CUDA, anything but bf16 on compute capability 9.x
    / 10.x (torch's CUTLASS kernel; otherwise torch loops over the groups after copying the offsets to the
    host, a sync a CUDA graph cannot record)."""
    device = torch.device(device)
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (the grouped GEMM)"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"torch._grouped_mm runs one CUDA kernel for bfloat16 only, not {dtype}"
        major, minor = torch.cuda.get_device_capability(device)
        if major not in (9, 10):
            return (
                f"torch._grouped_mm's CUDA kernel needs compute capability 9.x or 10.x, not {major}.{minor}"
            )
    elif device.type != "cpu":
        return f"torch._grouped_mm is not checked on {device.type}"
    return None


def moe_layout_reason(mlp, config) -> str | None:
    """Why :func:`routed_moe` cannot compute ``mlp`` (None when it can): the family's router and experts
    with stacked ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` parameters (transformers 5.x), no
    biases, not transposed. Other layouts (the per-expert module lists of transformers 4.x) keep the
    model's own module call."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _ROUTERS:
        return f"no routed decode for model_type {model_type!r}"
    experts, gate = getattr(mlp, "experts", None), router_of(mlp)
    if experts is None or gate is None:
        return f"its MoE block {type(mlp).__name__} has no `experts` / `gate` (or `router`)"
    shared = [n for n in ("shared_expert", "shared_expert_gate") if getattr(mlp, n, None) is not None]
    if model_type in _SHARED and len(shared) != 2:
        return (
            f"its MoE block {type(mlp).__name__} lacks the shared expert and its gate that {model_type!r} has"
        )
    if model_type not in _SHARED and shared:  # never dropped without a word
        name = type(mlp).__name__
        return f"its MoE block {name} has {shared}, which the routed decode of {model_type!r} does not add"
    gu, down, router = (
        getattr(m, n, None) for m, n in ((experts, "gate_up_proj"), (experts, "down_proj"), (gate, "weight"))
    )
    if not all(isinstance(t, torch.Tensor) for t in (gu, down, router)):
        return f"its experts {type(experts).__name__} are not stacked gate_up_proj / down_proj parameters"
    flags = {  # transformers' experts decorator: what these stacked weights hold beyond gate/up/down
        "biases": getattr(experts, "has_bias", False),
        "transposed weights": getattr(experts, "is_transposed", False),
        "separate gate and up weights": not getattr(experts, "is_concatenated", True),
        "no gate": not getattr(experts, "has_gate", True),
        "a post-expert norm": getattr(experts, "has_post_expert_norm", False),
    }
    if any(flags.values()):
        return f"its experts have {', '.join(k for k, v in flags.items() if v)}"
    e, hidden = router.shape
    k = getattr(gate, "top_k", None)
    if (
        gu.dim() != 3
        or down.dim() != 3
        or gu.shape[0] != e
        or gu.shape[2] != hidden
        or gu.shape[1] % 2
        or tuple(down.shape) != (e, hidden, gu.shape[1] // 2)
        or not isinstance(k, int)
        or not 0 < k <= e
        or not callable(getattr(experts, "act_fn", None))
    ):
        return (
            f"its expert weights {tuple(gu.shape)} / {tuple(down.shape)} are not [E, 2I, H] / [E, H, I] "
            f"for router {tuple(router.shape)}"
        )
    return None


def default_form(batch: int, k: int, e: int, grouped_ok: bool) -> str:
    """The expert form :func:`routed_moe` runs when none is forced: dense where the rows' (row, expert)
    pairs outnumber the experts (``batch * k > e``); otherwise the grouped GEMM where it runs as one
    recordable kernel on a CUDA device (``grouped_ok``: :func:`grouped_form_reason` is None there), else
    gather. One H100, bf16, Qwen3-30B-A3B-shaped layers, recorded step, one call (2026-12-07,
    benchmarks/rollout/results/h100/moeform_2026-12-07): batch 8 gather 9.72 ms / dense 7.61 / grouped 5.40;
    batch 64 gather 50.18 / dense 8.90 / grouped 9.20."""
    if batch * k > e:
        return "dense"
    return "grouped" if grouped_ok else "gather"


def grouped_by_default(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether :func:`default_form` may pick the grouped GEMM for experts in ``dtype`` on ``device``: a CUDA
    device where it records as one kernel (:func:`grouped_form_reason`); elsewhere it is not timed."""
    device = torch.device(device)
    return device.type == "cuda" and grouped_form_reason(device, dtype) is None


def default_form_said(model, device: torch.device) -> str | None:
    """One clause for the start table: how ``model``'s routed MoE layers pick their expert form when decoded on
    ``device`` (:func:`default_form`); None where it has no routed layer :func:`routed_moe` computes."""
    config = getattr(model, "config", None)
    blocks = [m for m in model.modules() if is_moe_block(m)]
    if config is None or not blocks or moe_layout_reason(blocks[0], config) is not None:
        return None
    router = router_of(blocks[0])
    e, k = router.weight.shape[0], router.top_k
    dtype = blocks[0].experts.gate_up_proj.dtype
    if device.type != "cuda":
        below = "gather"
    elif not torch.cuda.is_available():  # a plan for a GPU this process cannot see
        below = "the grouped GEMM where it records (bf16, compute capability 9.x / 10.x), else gather"
    elif grouped_by_default(device, dtype):
        below = "the grouped GEMM"
    else:
        below = f"gather ({grouped_form_reason(device, dtype)})"
    return f"routed MoE experts ({k} of {e}): dense from batch {e // k + 1}, below it {below}"


def routed_moe(
    mlp,
    h: torch.Tensor,
    model_type: str,
    norm_topk_prob: bool = True,
    form: str | None = None,
    grouped_ok: bool = False,
) -> torch.Tensor:
    """``mlp`` (a block :func:`moe_layout_reason` accepts) on ``h [B, H]``, as its own forward computes it.

    Routing: fp32 softmax of the router logits, top-k, renormalised (Mixtral always; Qwen3-MoE, OLMoE,
    FlexOlmo and Qwen2-MoE when ``norm_topk_prob``), or the softmax of the top-k fp32 logits (Granite-MoE);
    cast back to the logits' dtype for all but Mixtral. Experts: each row's top-k expert weights gathered
    from the stacked parameters and two batched matmuls (``form="gather"``), or every expert on every row
    and the top-k outputs picked (``"dense"``), or the pairs grouped by expert through
    ``torch._grouped_mm`` (``"grouped"``, refused by name where :func:`grouped_form_reason` says why); None
    picks :func:`default_form` (``grouped_ok``: the caller checked the grouped GEMM runs here). The weighted
    top-k outputs are summed over k; a Qwen2-MoE block then adds its sigmoid-gated shared expert.
    """
    out = _routed(mlp, h, model_type, norm_topk_prob, form, grouped_ok)
    if model_type in _SHARED:  # Qwen2-MoE: routed + sigmoid(gate(h)) * shared_expert(h), in h's dtype
        out = out + torch.sigmoid(mlp.shared_expert_gate(h)) * mlp.shared_expert(h)
    return out


def _routed(
    mlp, h, model_type: str, norm_topk_prob: bool, form: str | None, grouped_ok: bool
) -> torch.Tensor:
    """The routed experts of :func:`routed_moe` (without a shared expert), in ``h``'s dtype."""
    renorm, cast = _ROUTERS[model_type]
    experts, gate = mlp.experts, router_of(mlp)
    logits = F.linear(h, gate.weight)  # [B, E]
    if renorm == "logits":  # Granite-MoE: the top-k fp32 logits, then their softmax
        top, idx = torch.topk(logits.float(), gate.top_k, dim=-1)  # [B, k]
        top = torch.softmax(top, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, gate.top_k, dim=-1)  # [B, k]
        if renorm == "always" or norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
    if cast:
        top = top.to(logits.dtype)
    e = experts.gate_up_proj.shape[0]
    if form is None:
        form = default_form(h.shape[0], gate.top_k, e, grouped_ok)
    if form == "grouped":
        return _grouped_experts(experts, h, idx, top)
    if form == "gather":
        gu = experts.gate_up_proj[idx]  # [B, k, 2I, H]: copies B * k expert weights
        x = torch.matmul(gu, h[:, None, :, None].to(gu.dtype)).squeeze(-1)  # [B, k, 2I]
        g, u = x.chunk(2, dim=-1)
        out = torch.matmul(experts.down_proj[idx], (experts.act_fn(g) * u)[..., None]).squeeze(
            -1
        )  # [B, k, H]
        # weighted in the routing weights' dtype (fp32 for Mixtral), summed over k, then cast: the order of
        # transformers' default experts implementation (grouped / batched matmul)
        return (out * top[..., None]).sum(dim=1).to(h.dtype)
    if form != "dense":
        raise ValueError(f"form must be one of {MOE_FORMS} or None, got {form!r}")
    # every expert on every row, reading each expert's weights once; unselected experts weigh 0
    x = F.linear(h, experts.gate_up_proj.flatten(0, 1)).view(h.shape[0], e, -1)  # [B, E, 2I]
    g, u = x.chunk(2, dim=-1)
    out = torch.matmul(
        (experts.act_fn(g) * u).transpose(0, 1), experts.down_proj.transpose(1, 2)
    )  # [E, B, H]
    out = out.transpose(0, 1).gather(1, idx[..., None].expand(-1, -1, out.shape[-1]))  # [B, k, H]
    return (out * top[..., None]).sum(dim=1).to(h.dtype)


def _grouped_experts(experts, h: torch.Tensor, idx: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The experts of :func:`routed_moe` as two grouped GEMMs over the ``S = B * k`` (row, expert) pairs
    sorted by expert: each selected expert's weights read once, static shapes, no host sync."""
    if not torch.compiler.is_compiling():  # dynamo traces the same call; checked where it is built
        reason = grouped_form_reason(h.device, experts.gate_up_proj.dtype)
        if reason is not None:
            raise ValueError(f"form='grouped' cannot run here: {reason}")
    b, k = idx.shape
    pairs = idx.reshape(-1)  # [S]: row r's j-th expert at r * k + j
    order = torch.argsort(pairs, stable=True)  # [S]: the pairs grouped by expert (static size)
    counts = torch.zeros(experts.gate_up_proj.shape[0], dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, pairs, torch.ones_like(pairs, dtype=torch.int32))  # [E], bincount without a sync
    offs = counts.cumsum(0, dtype=torch.int32)  # [E]: where each expert's rows end
    x = h[order // k].to(experts.gate_up_proj.dtype)  # [S, H]
    try:
        y = torch._grouped_mm(x, experts.gate_up_proj.transpose(1, 2), offs=offs)  # [S, 2I]
        g, u = y.chunk(2, dim=-1)
        out = torch._grouped_mm(experts.act_fn(g) * u, experts.down_proj.transpose(1, 2), offs=offs)  # [S, H]
    except RuntimeError as exc:  # e.g. traced in fp32: torch's meta kernel takes bf16 only
        raise RuntimeError(
            f"form='grouped': torch._grouped_mm refused {x.dtype} on {h.device}: {exc}"
        ) from exc
    out = out * top.reshape(-1)[order, None]  # in the routing weights' dtype, as the other forms
    rows = torch.empty_like(out).index_copy_(0, order, out)  # back to row order: [B * k, H]
    return rows.view(b, k, -1).sum(dim=1).to(h.dtype)


def is_moe_block(mlp: nn.Module) -> bool:
    """Whether a layer's MLP is a routed block (Qwen3-MoE keeps dense MLPs in its ``mlp_only_layers``)."""
    return hasattr(mlp, "experts") and router_of(mlp) is not None


def router_of(mlp: nn.Module) -> nn.Module | None:
    """A routed block's router: ``gate`` (most families) or ``router`` (Granite-MoE); None without one."""
    for name in ("gate", "router"):
        router = getattr(mlp, name, None)
        if isinstance(getattr(router, "weight", None), torch.Tensor):
            return router
    return None
