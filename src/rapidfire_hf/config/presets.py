"""Presets: three named starting points, ``conservative``, ``balanced`` (the defaults) and ``aggressive``.

============  ===================================  ==============================  ===================================
preset        gradient                             memory                          precision
============  ===================================  ==============================  ===================================
conservative  pipeline off (depth 1, overlap 0),   plan within 80% of the device,  static bf16, no fallback rules:
              verify every step                    no recompute, compact at 60%    behaves like stock TRL in bf16
                                                   fragmentation, prefetch 1
balanced      pipeline on, depth 4, overlap 0.5,   plan within 85%, recompute      adaptive from bf16, NaN/Inf
              verify every step                    only to fit, compact at 30%,    gradients -> fp32
                                                   prefetch 2
aggressive    pipeline on, depth 16, overlap 0.9,  plan within 92%, recompute and  adaptive from bf16, NaN/Inf -> fp32,
              verify every 4 steps                 8-bit AdamW state only to fit,  LM head -> fp32 on a gradient spike
                                                   compact at 15%, prefetch 4
============  ===================================  ==============================  ===================================

Every preset runs the throughput planner (``rapidfire_hf.memory.planner``): none recomputes activations
that fit, and the memory left over becomes bigger training micro-batches and chunks. Use
``conservative`` to debug or to compare against stock TRL, ``balanced`` for most runs, and
``aggressive`` for the largest batches a GPU holds, once a run is known to be healthy.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from typing import Any

from rapidfire_hf.config.errors import ConfigError
from rapidfire_hf.config.schema import RapidFireConfig

PRESET_DESCRIPTIONS: dict[str, str] = {
    "conservative": "no gradient pipeline, static bf16, lazy compaction: closest to stock TRL, for debugging",
    "balanced": "gradient pipeline depth 4, adaptive bf16 with a NaN/Inf fallback: the default",
    "aggressive": "deep pipeline with sparse verification, eager compaction, may plan 92% of the device "
    "and keep AdamW state in 8 bits when nothing else fits",
}

# only the values that differ from the defaults (= balanced)
_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "conservative": {
        "gradient": {"pipeline": False, "pipeline_depth": 1, "overlap_factor": 0.0, "sync_interval": 1},
        "memory": {"optimization": "conservative", "compaction_threshold": 0.6, "prefetch_window": 1},
        "precision": {"mode": "static", "initial": "bf16", "fallback": []},
    },
    "balanced": {},
    "aggressive": {
        "gradient": {"pipeline": True, "pipeline_depth": 16, "overlap_factor": 0.9, "sync_interval": 4},
        "memory": {"optimization": "aggressive", "compaction_threshold": 0.15, "prefetch_window": 4},
        "precision": {
            "mode": "adaptive",
            "initial": "bf16",
            "fallback": [
                {"condition": "nonfinite_grads > 0", "action": "switch_to fp32"},
                {"condition": "layer:lm_head.grad_anomaly > 6", "action": "switch_to fp32"},
            ],
        },
    },
}


def preset_dict(name: str) -> dict[str, dict[str, Any]]:
    """The full nested form of preset ``name`` as plain data.

    Raises:
        ConfigError: for an unknown name, listing the presets (and the closest one).
    """
    if name not in _OVERRIDES:
        close = difflib.get_close_matches(str(name), list(_OVERRIDES), n=1)
        raise ConfigError(
            "unknown preset" + (f" (did you mean {close[0]!r}?)" if close else ""),
            value=name,
            allowed="one of " + ", ".join(repr(n) for n in _OVERRIDES),
        )
    data = RapidFireConfig().to_dict()
    for section, values in _OVERRIDES[name].items():
        data[section].update(values)
    return data


class _Presets(Mapping):
    """Read-only mapping preset name -> ``RapidFireConfig``; each lookup returns a fresh copy."""

    def __getitem__(self, name: str) -> RapidFireConfig:
        if name not in _OVERRIDES:
            raise KeyError(name)
        return RapidFireConfig.from_dict(preset_dict(name))

    def __iter__(self) -> Iterator[str]:
        return iter(_OVERRIDES)

    def __len__(self) -> int:
        return len(_OVERRIDES)

    def __repr__(self) -> str:
        return f"PRESETS({', '.join(_OVERRIDES)})"


PRESETS: Mapping[str, RapidFireConfig] = _Presets()
