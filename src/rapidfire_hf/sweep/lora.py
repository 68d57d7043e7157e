"""Many LoRA adapters on one frozen base model, each row of a batch going through its own adapter.

peft can serve a batch of mixed adapters (``adapter_names=``) only in eval mode ("Cannot pass
`adapter_names` when the model is in training mode"), so PPO's training forward of several trials at
once needs its own layer. :class:`MultiLoRALinear` wraps a frozen ``nn.Linear`` and holds one
``(A, B)`` pair per trial; an :class:`AdapterBank` shared by every wrapped layer says which block of
consecutive rows goes through which adapter (``None`` = the base alone, the reference policy). A block
computes ``base(x) + B(A(x)) * scaling`` on its rows only (one pair of small matmuls per adapter, the
frozen base matmul once for all rows), with the same operations, in the same order, as peft's LoRA
``Linear`` (so a one-trial sweep trains the numbers ``PPOTrainer(peft_config=...)`` trains).

That block routing is a Python list, and ``torch.compile`` specialises on it: a compiled decode step is
compiled again for every new route (each stop, clone or halving rung; checked with dynamo's counters) and
falls back to eager after dynamo's recompile limit. :meth:`AdapterBank.route` with ``by_index=True``
routes by tensors instead: every slot's ``A`` stacked into one ``[capacity * r, in]`` matrix per layer, a
``[rows, capacity * r]`` 0/1 mask selecting each row's slot, and one ``B`` stack, so
``delta = ((x @ A_all.T) * mask) @ B_all.T * scaling``: the same products with exact zeros for the other
slots, in tensors whose addresses and shapes stay put while the route changes. It is for generation
(no autograd through the stacks); training keeps the block path.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from rapidfire_hf.ppo.seeds import init_lora

DECODE_ROUTINGS = ("auto", "blocks", "index")


def _lora_settings(peft_config) -> dict:
    """``r``, ``scaling`` and ``targets`` of a peft ``LoraConfig``; anything a sweep cannot share raises."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise TypeError(
            "PPOSweep needs peft_config=LoraConfig(...): trials share one frozen base and each trains its "
            f"own LoRA adapter (got {type(peft_config).__name__}). Full-model trials are not supported."
        )
    unsupported = {
        "use_dora": peft_config.use_dora,
        "bias": peft_config.bias != "none",
        "modules_to_save": bool(peft_config.modules_to_save),
        "fan_in_fan_out": peft_config.fan_in_fan_out,
        "layers_to_transform": peft_config.layers_to_transform is not None,
        "init_lora_weights": peft_config.init_lora_weights is not True,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(
            f"LoraConfig options {bad} are not supported by PPOSweep: use plain LoRA (bias='none', default "
            "init, no DoRA, no modules_to_save)."
        )
    r, alpha = peft_config.r, peft_config.lora_alpha
    scaling = alpha / math.sqrt(r) if peft_config.use_rslora else alpha / r
    return {"r": r, "scaling": scaling, "targets": peft_config.target_modules}


def _is_target(name: str, targets) -> bool:
    """peft's matching rule: a string is a full-match regex; a list matches a name or its last parts."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus one LoRA pair per adapter slot, routed per block of rows by a bank.

    Args:
        base: the frozen linear layer (kept as ``base_layer``, as peft names it).
        bank: the :class:`AdapterBank` whose ``segments`` route the rows of each call.
        r: LoRA rank.
        scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA).
    """

    def __init__(self, base: nn.Linear, bank: AdapterBank, r: int, scaling: float):
        super().__init__()
        self.base_layer = base
        self.r, self.scaling = r, scaling
        self.lora_A = nn.ParameterDict()  # slot -> [r, in]
        self.lora_B = nn.ParameterDict()  # slot -> [out, r]
        object.__setattr__(self, "_bank", bank)  # not a submodule: the bank holds every layer
        # index routing's stacks (plain attributes, not state): [capacity * r, in] and [out, capacity * r]
        self._a_all: torch.Tensor | None = None
        self._b_all: torch.Tensor | None = None

    def stack(self, slots: list[str | None], capacity: int) -> bool:
        """Copy the slots' current pairs into the index-routing stacks (``slots[i]`` at rows ``i*r:(i+1)*r``;
        None leaves position ``i`` zero), in place when the capacity is unchanged, so a recorded decode graph
        keeps reading the same memory. Returns True when the stacks were reallocated (a recorded graph
        reading the old ones is stale)."""
        w = self.base_layer.weight
        shape_a, shape_b = (capacity * self.r, w.shape[1]), (w.shape[0], capacity * self.r)
        new = self._a_all is None or self._a_all.shape != shape_a or self._a_all.device != w.device
        if new:
            self._a_all = torch.zeros(shape_a, dtype=self.adapter_dtype(), device=w.device)
            self._b_all = torch.zeros(shape_b, dtype=self.adapter_dtype(), device=w.device)
        with torch.no_grad():
            self._a_all.zero_()
            self._b_all.zero_()
            for i, slot in enumerate(slots):
                if slot is None:
                    continue
                self._a_all[i * self.r : (i + 1) * self.r].copy_(self.lora_A[slot])
                self._b_all[:, i * self.r : (i + 1) * self.r].copy_(self.lora_B[slot])
        return new

    def adapter_dtype(self) -> torch.dtype:
        """fp32 for a half-precision base (peft's ``autocast_adapter_dtype``), else the base's dtype."""
        dtype = self.base_layer.weight.dtype
        return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def add_slot(self, slot: str) -> None:
        """A new pair, uninitialised (:meth:`AdapterBank.add` draws it)."""
        w = self.base_layer.weight
        a = torch.empty(self.r, w.shape[1], dtype=self.adapter_dtype(), device=w.device)
        b = torch.empty(w.shape[0], self.r, dtype=a.dtype, device=w.device)
        self.lora_A[slot], self.lora_B[slot] = nn.Parameter(a), nn.Parameter(b)

    def _delta(self, slot: str, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A[slot], self.lora_B[slot]
        return F.linear(F.linear(x.to(a.dtype), a), b) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, ..., in]
        result = self.base_layer(x)
        if self._bank.by_index:  # read nothing of the route but tensors (see the module docstring)
            mask = self._bank.row_mask.view(x.shape[0], *([1] * (x.dim() - 2)), -1)
            xa = F.linear(x.to(self._a_all.dtype), self._a_all) * mask
            return (result + F.linear(xa, self._b_all) * self.scaling).to(result.dtype)
        segments = self._bank.segments
        if segments is None or all(slot is None for slot, _ in segments):
            return result
        if len(segments) == 1:  # one adapter for every row: exactly peft's expression
            return (result + self._delta(segments[0][0], x)).to(result.dtype)
        parts, start = [], 0
        for slot, rows in segments:
            piece = x[start : start + rows]
            if slot is None:
                parts.append(result.new_zeros(piece.shape[:-1] + (result.shape[-1],)))
            else:
                parts.append(self._delta(slot, piece))
            start += rows
        return (result + torch.cat(parts)).to(result.dtype)


class AdapterBank:
    """Injects :class:`MultiLoRALinear` into a model's target linears and manages the adapter slots.

    The base model's own parameters are frozen (``requires_grad_(False)``); the wrapped layers replace
    the targets in place. Route a forward with :meth:`route`; outside it every row sees the base model.

    Args:
        model: a transformers causal LM (not PEFT-wrapped).
        peft_config: a ``peft.LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``).

    Example:
        >>> bank = AdapterBank(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
        >>> bank.add("t0", seed=0); bank.add("t1", seed=1)
        >>> with bank.route([("t0", 4), ("t1", 4)]):
        ...     logits = model(input_ids).logits  # rows 0-3 through adapter t0, rows 4-7 through t1
    """

    def __init__(self, model: nn.Module, peft_config):
        if hasattr(model, "peft_config"):
            raise ValueError(
                "PPOSweep takes the base model and a peft_config, not a PeftModel: pass model.get_base_model()."
            )
        settings = _lora_settings(peft_config)
        self.peft_config = peft_config
        self.r = settings["r"]
        self.segments: list[tuple[str | None, int]] | None = None
        self._decode_routing = "auto"
        self.by_index = False  # route() with by_index=True: the layers read row_mask and their stacks
        self.row_mask: torch.Tensor | None = None  # [rows, capacity * r], 0/1 in the adapters' dtype
        self.index_version = 0  # counts reallocations of the stacks or the mask (a recorded graph is stale)
        model.requires_grad_(False)
        out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        targets = settings["targets"]
        names = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear)
            and m is not out_emb
            and (targets == "all-linear" or (targets is not None and _is_target(n, targets)))
        ]
        if not names:
            conv1d = [
                n
                for n, m in model.named_modules()
                if type(m).__name__ == "Conv1D"
                and (targets == "all-linear" or (targets is not None and _is_target(n, targets)))
            ]
            if conv1d:  # GPT-2-style projections: a [in, out] weight applied as x @ W, not an nn.Linear
                raise ValueError(
                    f"LoraConfig.target_modules={targets!r} matches {len(conv1d)} transformers Conv1D layers of "
                    f"{type(model).__name__} (e.g. {conv1d[0]!r}); the sweep's routed adapters wrap nn.Linear only. "
                    "Train these trials one at a time with PPOTrainer(peft_config=...), which takes peft's Conv1D LoRA."
                )
            raise ValueError(
                f"LoraConfig.target_modules={targets!r} matches no nn.Linear of {type(model).__name__}: name "
                "its projections (e.g. ['q_proj', 'v_proj']) or use 'all-linear'."
            )
        self.layers: dict[str, MultiLoRALinear] = {}
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = MultiLoRALinear(getattr(parent, child), self, settings["r"], settings["scaling"])
            setattr(parent, child, layer)
            self.layers[name] = layer

    @property
    def decode_routing(self) -> str:
        """How PPOSweep's batched decode routes rows: ``"auto"`` (the default: ``"index"`` where the decode
        step is compiled, ``"blocks"`` elsewhere), ``"blocks"`` (the Python route) or ``"index"`` (the
        stacks and row mask: one compiled decode step for every route).

        Measured on one H200 in one call (benchmarks/sweep/results/h200/routing: 1.1B, 8 LoRA trials,
        halving at updates 4 and 8 of 12): the block route recompiled at every rung and did not finish in
        250 s (8 updates; first update 105 s, 4.82 s per update of 8 trials); the index route finished, the
        best trial known after 68 s (first update 40 s, 3.67 s per update), same peak (33.1 GiB). Without
        compilation nothing is re-traced, and the block route's arithmetic is peft's (a one-trial sweep
        equals ``PPOTrainer`` bit for bit), so "auto" keeps it there."""
        return self._decode_routing

    @decode_routing.setter
    def decode_routing(self, value: str) -> None:
        if value not in DECODE_ROUTINGS:
            raise ValueError(f"decode_routing must be one of {DECODE_ROUTINGS}, got {value!r}")
        self._decode_routing = value

    def routes_by_index(self, compiled: bool) -> bool:
        """Whether a batched decode routes by the stacks and mask, given whether its step is compiled."""
        return self._decode_routing == "index" or (self._decode_routing == "auto" and compiled)

    @property
    def slots(self) -> list[str]:
        first = next(iter(self.layers.values()))
        return list(first.lora_A.keys())

    def add(self, slot: str, seed: int) -> list[nn.Parameter]:
        """Create adapter ``slot`` from ``seed`` alone, as ``PPOTrainer(peft_config=...)`` draws its adapter
        (:func:`rapidfire_hf.ppo.seeds.init_lora`; the global RNG is left as it was)."""
        if slot in self.slots:
            raise ValueError(f"adapter slot {slot!r} exists already")
        for layer in self.layers.values():
            layer.add_slot(slot)
        init_lora([(layer.lora_A[slot], layer.lora_B[slot]) for layer in self.layers.values()], seed)
        return self.parameters(slot)

    def copy(self, src: str, dst: str) -> list[nn.Parameter]:
        """Create ``dst`` holding a copy of ``src``'s current weights."""
        self.add(dst, seed=0)
        with torch.no_grad():
            for p_dst, p_src in zip(self.parameters(dst), self.parameters(src)):
                p_dst.copy_(p_src)
        return self.parameters(dst)

    def remove(self, slot: str) -> None:
        for layer in self.layers.values():
            del layer.lora_A[slot]
            del layer.lora_B[slot]

    def parameters(self, slot: str) -> list[nn.Parameter]:
        """Adapter ``slot``'s parameters in module order (A then B per layer, as peft orders them)."""
        return [p for layer in self.layers.values() for p in (layer.lora_A[slot], layer.lora_B[slot])]

    @contextmanager
    def route(self, segments: list[tuple[str | None, int]], by_index: bool = False):
        """Within the block, rows go through adapters block by block: ``[(slot or None, rows), ...]``.

        ``by_index=True`` (generation only, no gradient reaches the adapters): the same routing through the
        stacks and the row mask (see the module docstring), refreshed from the adapters' current weights on
        entry, in place while the number of slots fits the stacks' capacity (the next power of two) and
        the number of rows is unchanged.
        """
        previous = self.segments, self.by_index
        self.segments = list(segments)
        if by_index:
            self._index_route(self.segments)
        self.by_index = by_index
        try:
            yield
        finally:
            self.segments, self.by_index = previous

    def _index_route(self, segments: list[tuple[str | None, int]]) -> None:
        slots = self.slots
        capacity = 1 << max(0, len(slots) - 1).bit_length()  # room to add slots without new shapes
        # only the routed slots enter the stacks: a stopped trial's adapter (non-finite when it diverged)
        # would reach every row through the zeros of the mask (0 x NaN is NaN)
        routed = {slot for slot, _ in segments}
        for layer in self.layers.values():
            self.index_version += layer.stack([s if s in routed else None for s in slots], capacity)
        first = next(iter(self.layers.values()))
        rows, cols = sum(n for _, n in segments), capacity * self.r
        if (
            self.row_mask is None
            or self.row_mask.shape != (rows, cols)
            or self.row_mask.device != first._a_all.device
        ):
            self.row_mask = torch.zeros(rows, cols, dtype=first._a_all.dtype, device=first._a_all.device)
            self.index_version += 1
        mask = torch.zeros(rows, cols, dtype=self.row_mask.dtype)
        start = 0
        for slot, n in segments:
            if slot is not None:
                i = slots.index(slot)
                mask[start : start + n, i * self.r : (i + 1) * self.r] = 1
            start += n
        self.row_mask.copy_(mask)

    def state_dict(self, slot: str) -> dict[str, torch.Tensor]:
        """Adapter ``slot`` under the keys peft saves (``base_model.model.<module>.lora_A.weight``)."""
        out = {}
        for name, layer in self.layers.items():
            out[f"base_model.model.{name}.lora_A.weight"] = layer.lora_A[slot].detach().clone()
            out[f"base_model.model.{name}.lora_B.weight"] = layer.lora_B[slot].detach().clone()
        return out

    def load_state_dict(self, slot: str, state: dict[str, torch.Tensor]) -> None:
        """Load peft-format adapter weights (as :meth:`state_dict` writes them) into ``slot``."""
        with torch.no_grad():
            for name, layer in self.layers.items():
                for part, params in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
                    key = f"base_model.model.{name}.{part}.weight"
                    if key not in state:
                        raise KeyError(
                            f"adapter weights lack {key}: saved for another model or target_modules"
                        )
                    params[slot].copy_(state[key])
