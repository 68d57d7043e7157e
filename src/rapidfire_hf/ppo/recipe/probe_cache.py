"""The throughput plan's probe cache: activation bytes of one training row, measured once per setup.

PPOTrainer's plan measures what one training row keeps for backward under each checkpointing policy
(``rapidfire_hf.ppo.recipe.planning.measure``) and keeps it in ``<output_dir>/rapidfire_plan_probe.json``, so a
second run of the same setup plans at once. A plan is only as right as those numbers, so an entry is used
only when it is verifiably this setup's, and the plan table says it was cached:

- its key is the hash of the setup's identity (models' classes and configs, trained part, dtypes, kernels,
  device, row length, policies, and the versions of torch, transformers and rapidfire_hf), and the entry
  stores that identity: an entry whose identity is not the one its key hashes is refused (forged);
- the entry carries a hash of its identity and numbers: an entry edited by hand is refused;
- an entry of the same setup measured under other versions is stale: measured again, and said;
- an entry whose numbers are more than :data:`PLAUSIBLE` times off the estimate from the model's shape
  (:mod:`rapidfire_hf.memory.estimate`, where the model is a Llama-like decoder) is refused as implausible.

The hash is a check against edits and damage, not a signature: someone who can write the file and
recomputes the hashes can still make the plan use numbers within the plausible range. Every refusal is one
warning naming the file and why, and the probe is measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger("rapidfire_hf.ppo.trainer")

PROBE_CACHE = "rapidfire_plan_probe.json"
PROBE_CACHE_VERSION = 2
# an entry more than this many times above or below the shape's estimate is refused
PLAUSIBLE = 4.0
# identity fields that change with an upgrade, not with the setup: an entry differing only there is stale
VERSION_FIELDS = ("torch", "transformers", "rapidfire_hf")


def identity_key(identity: dict[str, str]) -> str:
    """The entry key of a setup's identity."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]


def _seal(identity: dict, measured: dict) -> str:
    return hashlib.sha256(json.dumps([identity, measured], sort_keys=True).encode()).hexdigest()[:24]


def _counts(measured, wanted: tuple[str, ...]) -> bool:
    return (
        isinstance(measured, dict)
        and set(measured) == set(wanted)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in measured.values())
    )


class ProbeCache:
    """Measured activation bytes per row, by setup, in one JSON file written atomically (module docstring).

    A file that cannot be read (damaged, another format) is ignored with a warning and measured again;
    nothing in it is trusted beyond a verified entry of non-negative integers.
    """

    def __init__(self, folder):
        self.path = Path(folder) / PROBE_CACHE

    def _refuse(self, why: str) -> None:
        logger.warning("rapidfire: not using the plan's probe cache %s (%s); measuring again", self.path, why)

    def _read(self) -> dict:
        try:
            if not self.path.is_file():  # inside: a name over the system's limit raises here too
                return {}
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or data.get("version") != PROBE_CACHE_VERSION:
                raise ValueError("not a probe cache of this version")
            return data["entries"] if isinstance(data.get("entries"), dict) else {}
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as err:
            logger.warning(
                "rapidfire: ignoring the plan's probe cache %s (%s); measuring again", self.path, err
            )
            return {}

    def get(
        self, identity: dict[str, str], wanted: tuple[str, ...], estimate: dict[str, int] | None = None
    ) -> dict[str, int] | None:
        """The verified bytes of ``identity`` for ``wanted``, or None (and, where an entry was refused, one
        warning saying why). ``estimate``: the shape's analytic bytes per policy, for the plausibility check."""
        entries = self._read()
        key = identity_key(identity)
        entry = entries.get(key)
        if entry is None:
            self._say_if_stale(entries, identity)
            return None
        if not isinstance(entry, dict) or entry.get("identity") != identity:
            self._refuse(f"entry {key} is not the setup its key names: forged or damaged")
            return None
        measured = entry.get("bytes")
        if not _counts(measured, wanted):
            self._refuse(f"entry {key} does not hold one non-negative integer per policy {list(wanted)}")
            return None
        if entry.get("check") != _seal(identity, measured):
            self._refuse(f"entry {key} was edited: its check does not match its numbers")
            return None
        for policy, nbytes in measured.items():
            guess = (estimate or {}).get(policy)
            if guess and not guess / PLAUSIBLE <= nbytes <= guess * PLAUSIBLE:
                self._refuse(
                    f"entry {key}: {nbytes / 2**20:.1f} MiB a row under {policy} is implausible against "
                    f"{guess / 2**20:.1f} MiB from the model's shape"
                )
                return None
        return {p: measured[p] for p in wanted}

    def _say_if_stale(self, entries: dict, identity: dict) -> None:
        """One warning when an entry of this setup measured under other versions is found (then replaced)."""
        same = {k: v for k, v in identity.items() if k not in VERSION_FIELDS}
        for entry in entries.values():
            old = entry.get("identity") if isinstance(entry, dict) else None
            if isinstance(old, dict) and {k: v for k, v in old.items() if k not in VERSION_FIELDS} == same:
                then = ", ".join(f"{k} {old.get(k)}" for k in VERSION_FIELDS if old.get(k) != identity.get(k))
                self._refuse(f"stale: this setup was measured with {then}")
                return

    def put(self, identity: dict[str, str], measured: dict[str, int]) -> None:
        """Store ``measured`` for ``identity`` (a stale entry of the same setup is replaced)."""
        try:
            entries = self._read()
            same = {k: v for k, v in identity.items() if k not in VERSION_FIELDS}
            entries = {
                k: e
                for k, e in entries.items()
                if not (
                    isinstance(e, dict)
                    and isinstance(e.get("identity"), dict)
                    and {a: b for a, b in e["identity"].items() if a not in VERSION_FIELDS} == same
                )
            }
            entries[identity_key(identity)] = {
                "identity": identity,
                "bytes": measured,
                "check": _seal(identity, measured),
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": PROBE_CACHE_VERSION, "entries": entries}, indent=1))
            os.replace(tmp, self.path)
        except OSError as err:  # a read-only or full disk: the plan stands, only the cache is lost
            logger.warning("rapidfire: could not write the plan's probe cache %s (%s)", self.path, err)
