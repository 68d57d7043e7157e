"""FP8 (e4m3 forward, e5m2 gradients) for large Linear layers, on GPUs that have FP8 tensor cores.

Two backends, chosen by :func:`enable_fp8` (``backend=``, see :func:`resolve_fp8_backend`):

* ``torchao``: ``torchao.float8.convert_to_float8_training`` (the optional extra
  ``pip install 'rapidfire_hf[fp8]'``), with its ``recipe``: ``tensorwise`` (one dynamic scale per
  tensor), ``rowwise`` (one per row, more accurate) or ``rowwise_with_gw_hp`` (rowwise, weight gradient
  in high precision). Its casts are fused, and its speed comes, under ``torch.compile``.
* ``scaled_mm``: :class:`Float8Linear`, this module's own layer on ``torch._scaled_mm`` with dynamic
  per-tensor scales (``tensorwise`` only), needing nothing beyond torch; it runs eagerly and can keep the
  FP8 weights between optimizer steps (``cache_weights``).

Parameters stay in their dtype and keep their identity (the optimizer is not touched); only the three
matmuls of each converted layer (output, input gradient, weight gradient) run in FP8.
``benchmarks/precision`` measures both backends against bf16 (speed, output error, training loss).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn  # activations and weights: more mantissa
E5M2 = torch.float8_e5m2  # gradients: more range
FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) have FP8 tensor cores
_TINY = 1e-30  # amax floor: an all-zero tensor gets a finite scale (2**-100 * fmax away from overflow)
BACKENDS = ("auto", "torchao", "scaled_mm")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's Float8LinearRecipeName values

logger = logging.getLogger("rapidfire_hf.precision")


def fp8_support(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether FP8 matmuls can run on ``device`` (default: the current CUDA device), and why not.

    Returns:
        ``(True, "")`` or ``(False, reason)`` with the GPU name and compute capability in the reason.
    """
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return (
            False,
            f"FP8 needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper); the model is on {device}",
        )
    if not torch.cuda.is_available():
        return (
            False,
            "FP8 needs a CUDA GPU with compute capability >= 8.9 (Ada/Hopper); no CUDA GPU is available",
        )
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return False, (
            f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 tensor cores need >= 8.9 (Ada, Hopper, "
            "Blackwell). Keep bf16 on this GPU."
        )
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm; FP8 needs torch >= 2.1"
    return True, ""


def _quantize(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic scaling into ``dtype``; returns (fp8 tensor, 1/scale), the scale ``_scaled_mm`` takes.

    The scale is the largest power of two with ``amax * scale <= finfo(dtype).max``. A power of two is
    exact in every float format, so ``t * scale`` is computed in ``t``'s own dtype without rounding
    (bf16 stays bf16: no fp32 copy of the tensor), it cannot exceed the FP8 maximum (no clamp pass), and
    ``1/scale`` is exact. ``amax`` is one reduction (``vector_norm(inf)``: no ``|t|`` temporary) and stays
    on the device. Passes over the tensor per cast: 3 (read; read+write in t's dtype; read+write FP8)
    instead of 6, four of them in fp32, before. An all-zero tensor quantises to zeros with a finite
    scale; a tensor holding inf/NaN gives NaN, as the bf16 matmul would.
    """
    fmax = torch.finfo(dtype).max
    t = t.detach()
    amax = torch.linalg.vector_norm(t, ord=math.inf, dtype=torch.float32).clamp_min(_TINY)
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax)))
    # fp16 cannot hold scales above 65504 (amax below ~0.007): scale such tensors in fp32
    work = t if t.dtype in (torch.bfloat16, torch.float32) else t.float()
    q = (work * scale.to(work.dtype)).to(dtype)
    return q, scale.reciprocal()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    # _scaled_mm wants its second operand column-major
    return t.t().contiguous().t()


# Optimizer steps taken in this process by any torch.optim.Optimizer (counted by a global step hook that
# is installed with the first weight cache). Part of the cache key, because a fused AdamW step (and
# anything writing through ``param.data``) changes a weight without bumping its version counter.
_OPTIMIZER_STEPS = [0]
_STEP_HOOK = []


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


def _install_step_hook() -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ W^T + b`` with all three matmuls of forward and backward in FP8.

    ``wq``/``ws`` are the e4m3 weight and its inverse scale (quantised by the caller, possibly cached);
    ``weight`` is passed only so that autograd returns its gradient.
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype, wq, ws):
        # x2d: (M, K) row-major; wq: (N, K) row-major, so wq.t() is the column-major (K, N) operand
        xq, xs = _quantize(x2d, E4M3)
        out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype)
        if bias is not None:
            out = out + bias.to(out_dtype)
        ctx.save_for_backward(xq, xs, wq, ws)  # FP8 copies: a quarter of fp32 activation memory
        ctx.has_bias, ctx.w_dtype, ctx.x_dtype = bias is not None, weight.dtype, x2d.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = _quantize(grad.contiguous(), E5M2)
        grad_x = torch._scaled_mm(gq, _col_major(wq), scale_a=gs, scale_b=ws, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(
            gq.t().contiguous(), _col_major(xq), scale_a=gs, scale_b=xs, out_dtype=torch.float32
        )
        grad_b = grad.float().sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), grad_b, None, None, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in FP8 (``torch._scaled_mm``) with dynamic per-tensor scales.

    Falls back to ``F.linear`` when a dimension is not a multiple of 16 (a ``_scaled_mm`` requirement).
    Built with :meth:`from_linear`, which reuses the original ``weight`` and ``bias`` Parameters.

    Args of :meth:`from_linear`:
        cache_weight: keep the FP8 copy of the weight between calls and re-quantise only when the weight
            may have changed: another storage, an in-place op on the Parameter (its version counter), or
            a step of any ``torch.optim.Optimizer`` in the process (a global step hook). Saves the weight's
            cast in every forward after the first of an optimizer step (gradient accumulation, evaluation,
            generation) at the cost of one byte per weight. Off by default: writes through ``param.data``
            outside an optimizer step (some EMA / weight-sync code) are invisible to all three checks, and
            would leave a stale FP8 weight; call :meth:`clear_weight_cache` after such writes.
    """

    cache_weight: bool = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, cache_weight: bool = False) -> Float8Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.cache_weight = cache_weight
        new._weight_cache = None
        if cache_weight:
            _install_step_hook()
        return new

    def clear_weight_cache(self) -> None:
        """Drop the cached FP8 weight (re-quantised on the next forward)."""
        self._weight_cache = None

    def _fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.weight
        if not self.cache_weight:
            return _quantize(w, E4M3)
        key = (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape), _OPTIMIZER_STEPS[0])
        cached = getattr(self, "_weight_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, *_quantize(w, E4M3))
            self._weight_cache = cached
        return cached[1], cached[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] % 16 or self.in_features % 16 or self.out_features % 16:
            return F.linear(x, self.weight, self.bias)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        with torch.autocast(device_type, enabled=False):
            wq, ws = self._fp8_weight()
            out = _Fp8Linear.apply(x2d.contiguous(), self.weight, self.bias, out_dtype, wq, ws)
        return out.reshape(*x.shape[:-1], self.out_features)


# Smallest min(in_features, out_features) that enable_fp8 converts by default. End-to-end compiled training on
# an H200 (benchmarks/precision/results/h200/fp8_loss/, torchao tensorwise against compiled bf16): the 7B
# shape's linears (4096 / 11008 wide) ran 1.23x faster, the 1.1B shape's (2048 / 5632) 0.85x (bf16 weights)
# and 0.77x (fp32 master weights): below 4096 the casts and scales cost more than the FP8 matmul saves.
FP8_MIN_FEATURES = 4096


def fp8_candidates(
    model: nn.Module, min_features: int = FP8_MIN_FEATURES, skip: tuple[str, ...] = ("lm_head",)
) -> list[str]:
    """Names of Linear layers large enough for FP8 to pay off, with ``_scaled_mm``-compatible shapes."""
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, Float8Linear):
            continue
        if any(name == s or name.endswith("." + s) or name.startswith(s + ".") for s in skip):
            continue
        if min(module.in_features, module.out_features) >= min_features and not (
            module.in_features % 16 or module.out_features % 16
        ):
            out.append(name)
    return out


def resolve_fp8_backend(backend: str = "auto", recipe: str = "tensorwise") -> str:
    """The backend :func:`enable_fp8` uses for ``backend`` and ``recipe``: ``"torchao"`` or ``"scaled_mm"``.

    ``"auto"`` is torchao when it is installed, else ``scaled_mm`` (tensorwise only: a rowwise recipe
    without torchao is an ImportError naming the extra).

    Raises:
        ValueError: an unknown backend or recipe, or a rowwise recipe with ``backend="scaled_mm"``.
        ImportError: torchao is needed (``backend="torchao"`` or a rowwise recipe) and not installed.
    """
    from rapidfire_hf.utils import imports

    if backend not in BACKENDS:
        raise ValueError(f"FP8 backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if recipe not in RECIPES:
        raise ValueError(f"FP8 recipe must be one of {', '.join(map(repr, RECIPES))}, got {recipe!r}")
    if backend == "scaled_mm":
        if recipe != "tensorwise":
            raise ValueError(
                f"the scaled_mm backend scales per tensor only; recipe {recipe!r} needs backend='torchao' "
                "(pip install 'rapidfire_hf[fp8]')"
            )
        return "scaled_mm"
    if backend == "torchao" or recipe != "tensorwise":
        imports.require("torchao", f"FP8 training with the torchao backend (recipe {recipe!r})")
        return "torchao"
    return "torchao" if imports.is_available("torchao") else "scaled_mm"


def _torchao_float8():
    """torchao's ``Float8LinearConfig`` and ``convert_to_float8_training``, or an ImportError that says why."""
    from rapidfire_hf.utils.imports import require

    torchao = require("torchao", "FP8 training with the torchao backend")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:  # a torchao built for another torch
        raise ImportError(
            f"torchao {getattr(torchao, '__version__', '?')} cannot load its float8 module with torch "
            f"{torch.__version__} ({e}); install the torchao release built for this torch, or use "
            "backend='scaled_mm'"
        ) from e
    return Float8LinearConfig, convert_to_float8_training


def convert_linears_to_fp8(
    model: nn.Module,
    names: list[str],
    *,
    backend: str,
    recipe: str = "tensorwise",
    cache_weights: bool = False,
) -> list[str]:
    """Replace the Linear layers ``names`` of ``model`` by FP8 ones of ``backend`` (``"torchao"`` or
    ``"scaled_mm"``), without :func:`enable_fp8`'s hardware check and layer selection (both backends also
    run on CPU, slowly: the benchmarks' smoke modes use that). Returns ``names``."""
    if backend not in ("torchao", "scaled_mm"):
        raise ValueError(f"backend must be 'torchao' or 'scaled_mm' (resolve 'auto' first), got {backend!r}")
    if backend == "torchao":
        config_cls, convert = _torchao_float8()
        wanted = set(names)
        convert(
            model,
            config=config_cls.from_recipe_name(recipe),
            module_filter_fn=lambda module, fqn: fqn in wanted,
        )
        return names
    if recipe != "tensorwise":
        raise ValueError(f"the scaled_mm backend scales per tensor only, not {recipe!r}")
    modules = dict(model.named_modules())
    for name in names:
        parent_name, _, child = name.rpartition(".")
        setattr(
            modules[parent_name] if parent_name else model,
            child,
            Float8Linear.from_linear(modules[name], cache_weight=cache_weights),
        )
    return names


def enable_fp8(
    model: nn.Module,
    *,
    backend: str = "auto",
    recipe: str = "tensorwise",
    min_features: int = FP8_MIN_FEATURES,
    skip: tuple[str, ...] = ("lm_head",),
    plugin=None,
    cache_weights: bool = False,
) -> list[str]:
    """Run the large Linear layers of ``model`` in FP8 for training.

    Args:
        model: The model, already on the GPU.
        backend: ``"torchao"``, ``"scaled_mm"`` or ``"auto"`` (torchao when installed; see
            :func:`resolve_fp8_backend`). torchao's layers are fast under ``torch.compile``.
        recipe: torchao's scaling recipe: ``"tensorwise"`` (both backends), ``"rowwise"`` or
            ``"rowwise_with_gw_hp"`` (torchao only).
        min_features: Smallest ``min(in_features, out_features)`` converted; small matmuls lose to the casts.
            The default, :data:`FP8_MIN_FEATURES` (4096), comes from end-to-end H200 training runs: a gain
            on the 7B shape (1.23x), a loss on the 1.1B shape (2048-wide linears). Lower it only where a
            benchmark of your model shows a gain.
        skip: Module names (or suffixes) never converted; the LM head by default (log-probs are sensitive).
        plugin: An attached :class:`~rapidfire_hf.precision.AdaptivePrecisionPlugin`: layers it runs above
            its base precision (sensitive ones) are skipped.
        cache_weights: ``scaled_mm`` backend: keep each layer's FP8 weight between calls until the weight
            changes (see :class:`Float8Linear`); ignored by torchao.

    Returns:
        Names of the converted layers.

    Raises:
        ValueError: an unknown backend or recipe, or a rowwise recipe with ``backend="scaled_mm"``.
        ImportError: torchao is needed and not installed (the message names the ``fp8`` extra).
        RuntimeError: on CPU, on GPUs without FP8 (compute capability < 8.9), naming the GPU.
    """
    chosen = resolve_fp8_backend(backend, recipe)
    ok, why = fp8_support(next(model.parameters()).device)
    if not ok:
        raise RuntimeError(why)
    names = fp8_candidates(model, min_features, skip)
    if plugin is not None:
        names = [n for n in names if not any(n == k or n.startswith(k + ".") for k in plugin.overrides)]
    convert_linears_to_fp8(model, names, backend=chosen, recipe=recipe, cache_weights=cache_weights)
    logger.info("FP8 (%s, %s) for %d linear layers", chosen, recipe, len(names))
    return names
