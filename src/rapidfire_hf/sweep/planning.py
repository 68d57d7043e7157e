"""PPOSweep's throughput plan: the single-run planner (``rapidfire_hf.memory.planner``) on every trial's rows.

One sweep update holds every active trial's rows at once: one decode of all their prompts (the static
engine keeps that KV cache between updates), scoring packs across trials, and training forwards that pack
the trials' micro-batches. :class:`SweepPlanner` asks :func:`rapidfire_hf.memory.planner.make_plan`, with
the rows of all trials as the workload, for:

- the rows of one training forward across trials (``train_rows_per_forward`` when the user set it): as
  many of the trials' micro-batches as fit the level's target, up to the planner's 16,384-token cap (no
  measurable speed above it on an H200 at 1.1B), never fewer than one trial's micro-batch. Packing never
  changes a trial's math: each trial's micro-batch stays whole in one forward and its loss reads only its
  own rows (``tests/sweep/test_packing.py``);
- the scoring chunk (rows per no-grad scoring forward), unless ``local_rollout_forward_batch_size`` is set:
  the sweep's earlier fixed chunk (TRL's 64 rows), or fewer where memory is short. Larger chunks (the
  single-run planner goes up to 256 rows) are not measured for sweeps, so the plan does not take them.

The decode is never chunked (one decode serves every trial) and the sweep never recomputes activations, so
a plan that does not fit says so; PPOTrainer's out-of-memory recovery then splits the packs. The level is
``rapidfire_config``'s ``memory.optimization`` (default ``balanced``: 85% of the device); its
``memory.planner: false`` keeps the sweep's fixed rule instead (16,384 tokens per training forward, TRL's
scoring chunk of 64 rows).

The plan is made before the first update and again whenever the rows of an update change (a clone, a stop,
a rung of successive halving); the activation bytes of one training row are measured once per row length
(one forward of one row through the shared base and one trial's adapter and value head).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from rapidfire_hf.config.schema import to_plain
from rapidfire_hf.memory.checkpointing import level_budget
from rapidfire_hf.memory.kv_choice import AUTO as KV_AUTO
from rapidfire_hf.memory.kv_choice import KVChoice
from rapidfire_hf.memory.levels import DEFAULT_LEVEL
from rapidfire_hf.memory.planner import (
    UNPLANNED_SCORING_ROWS,
    Asked,
    Plan,
    Probe,
    Workload,
    kv_bytes_per_token,
    make_plan,
    unplanned,
)
from rapidfire_hf.rollout.llama_forward import ring_windows
from rapidfire_hf.sweep.phases import train_pack_rows

logger = logging.getLogger("rapidfire_hf.sweep")


def sweep_memory(rf_config) -> tuple[str, bool]:
    """``(level, planner on)`` from a loaded rapidfire config (None: ``balanced``, planner on)."""
    memory = getattr(rf_config, "memory", None)
    if memory is None:
        return DEFAULT_LEVEL, True
    return str(to_plain(memory.optimization)), bool(memory.planner)


def reserve_bytes(trials) -> int:
    """What the trials' first backward and optimizer step still allocate: gradients not yet there, and
    AdamW's two moments for every optimizer without state yet (in the parameters' dtype)."""
    total = 0
    for t in trials:
        total += sum(p.numel() * p.element_size() for p in t.params if p.grad is None)
        if not t.optimizer.state:
            total += sum(2 * p.numel() * p.element_size() for p in t.params)
    return total


class SweepPlanner:
    """Plans the packing of a sweep's updates (module docstring).

    Args:
        level: the ``memory.optimization`` level (its share of the device is the target).
        planner: False keeps the sweep's fixed rule (:func:`rapidfire_hf.sweep.phases.train_pack_rows`,
            TRL's scoring chunk).
        train_rows: the user's ``train_rows_per_forward`` (kept), or None.
        free_bytes: plan against this many bytes instead of measuring the device (tests).
    """

    def __init__(self, level: str = DEFAULT_LEVEL, planner: bool = True, train_rows: int | None = None,
                 free_bytes: int | None = None):  # fmt: skip
        self.level, self.planner, self.train_rows, self.free_bytes = level, planner, train_rows, free_bytes
        self.plan: Plan | None = None  # the plan in force
        self.plans = 0  # plans made so far (the first is printed as a table, later ones as one line)
        self._key = None
        self._probe: dict[int, int] = {}  # tokens per row -> activation bytes of one training row

    def workload(self, trials, prompt_tokens: int, response_tokens: int, decode_rows: int, model,
                 static: bool, itemsize: int, kv_cache_dtype: str | None = None) -> Workload:  # fmt: skip
        """The workload of one update of ``trials``: all their rows, one micro-step of every trial as the
        micro-batches a training forward may pack (``decode_rows``: rows of the one decode, padded;
        ``itemsize``: bytes per activation element; the KV cache is in the model's dtype, or 8-bit with
        ``kv_cache_dtype``)."""
        cfg = model.config
        cache_itemsize = next(model.parameters()).element_size()
        micro = max(t.args.per_device_train_batch_size for t in trials)
        return Workload(
            rollout_rows=max(decode_rows, sum(t.args.local_batch_size for t in trials)),
            mini_rows=micro * len(trials),
            micro_rows=micro,
            prompt_tokens=prompt_tokens,
            response_tokens=response_tokens,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            vocab=cfg.vocab_size,
            kv_bytes_per_token=kv_bytes_per_token(cfg, cache_itemsize, kv_cache_dtype),
            itemsize=itemsize,
            cache_persists=static,
            intermediate=getattr(cfg, "intermediate_size", None),
            kv_cache_dtype=kv_cache_dtype,
            kv_windows=ring_windows(model),
        )

    def update(self, phases, trials, shared, prompt_tokens: int) -> Plan | None:
        """Plan for this update of ``trials`` and apply it to ``phases``; returns the plan when it is new
        (first update, or the update's rows changed), else None."""
        static = phases.engine.backend == "static"
        autocast = (shared.bf16 or shared.fp16) and phases.device.type == "cuda"  # as SweepPhases' forwards
        itemsize = 2 if autocast else next(phases.model.parameters()).element_size()
        kv_cache = getattr(phases.engine, "kv_cache_dtype", None)  # the engine's (None: the model's dtype)
        work = self.workload(
            trials, prompt_tokens, shared.response_length, phases.decode_rows, phases.model, static, itemsize,
            kv_cache,
        )  # fmt: skip
        key = (work, tuple(t.args.per_device_train_batch_size for t in trials))
        if key == self._key:
            return None
        self._key = key
        scoring = shared.local_rollout_forward_batch_size
        asked = Asked(
            scoring_rows=None if scoring == "auto" else scoring,
            generation_rows=0,  # one decode of every trial's prompts
            planner=self.planner,
            train_rows=self.train_rows,
            merge_any=True,  # packs of any number of trials (pack_in_order): 5 trials may pack 4 + 1
            split=False,  # packs are split by the sweep's OOM recovery, not planned in pieces
            kv_cache_dtype=shared.rollout_kv_cache_dtype,
        )
        probe = self._measure(phases, trials[0], work.tokens, prompt_tokens) if self.planner else None
        if probe is None:
            plan = unplanned(work, asked, "none", self.level)
            plan.train_rows = self.train_rows or train_pack_rows(work.tokens, work.micro_rows)
            off = "memory.planner off" if not self.planner else "the probe failed"
            plan.reasons["train_rows"] = (
                "your train_rows_per_forward" if self.train_rows else f"16,384 tokens ({off})"
            )
        else:
            budget = level_budget(phases.device, self.level, reserve_bytes(trials), self.free_bytes)
            if self.free_bytes is None:  # the engine's cache of the last decode is in what the device holds
                # now, and the plan counts the decode's cache itself: count it once
                budget = replace(budget, held_bytes=max(0, budget.held_bytes - phases.engine.held_bytes()))
            # the scoring chunk grows no larger than the sweep's previous fixed chunk (TRL's 64 rows): a larger
            # one is not measured for sweeps yet; the plan only makes it smaller where memory is short
            plan = make_plan(
                work,
                asked,
                probe,
                budget,
                self.level,
                scoring_cap=UNPLANNED_SCORING_ROWS,
                equal_scoring=False,
            )
        plan.title, plan.train_label = "PPOSweep plan", "training rows per forward (all trials)"
        if asked.kv_cache_dtype == KV_AUTO:  # said here, not memory.kv_choice's plan comparison
            plan = KVChoice(
                None, "auto: the model's dtype (PPOSweep decodes every trial in one batch; 'int8' to ask)"
            ).on(plan)
        if plan.planned and not self.train_rows and plan.train_rows > work.micro_rows:
            plan.reasons["train_rows"] = (
                f"{plan.train_rows // work.micro_rows} trials' micro-batches per forward (each trial's math unchanged)"
            )
        if plan.planned and asked.scoring_rows is None:
            whole = min(UNPLANNED_SCORING_ROWS, work.rollout_rows)
            plan.reasons["scoring_rows"] = (
                "TRL's 64 rows, as before the plan (larger: not measured for sweeps)"
                if plan.scoring_rows >= whole
                else "bounded to fit"
            )
        plan.reasons["generation_rows"] = "one decode of every trial's prompts"
        plan.asked["checkpointing"] = "off"
        plan.reasons["checkpointing"] = "a sweep does not recompute activations"
        plan.reasons["optimizer_state"] = "each trial's torch AdamW"
        phases.train_rows, phases.scoring_rows = plan.train_rows, plan.scoring_rows
        self.plan = plan
        self.plans += 1
        return plan

    def _measure(self, phases, trial, tokens: int, ctx: int) -> Probe | None:
        """Activation bytes of one training row (once per row length); None, with a warning, when the
        probe itself fails (the sweep then packs by the fixed rule, as with the planner off)."""
        if tokens not in self._probe:
            try:
                self._probe[tokens] = phases.row_activation_bytes(trial, tokens, ctx)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory on one row: training would fail too
                logger.warning("PPOSweep: the throughput plan could not measure a training row (%s): "
                               "packing by the fixed rule", err)  # fmt: skip
                return None
        return Probe({"none": self._probe[tokens]})  # the only policy: a sweep never recomputes

    @staticmethod
    def describe(plan: Plan, trials: int) -> str:
        """One line for a plan made after the first (rows per training forward and per scoring forward)."""
        return (
            f"PPOSweep plan for {trials} trial(s): {plan.train_rows} rows per training forward, "
            f"{plan.scoring_rows} per scoring forward, planned peak {plan.planned_peak_bytes / 2**30:.1f} GiB"
            + ("" if plan.fits or not plan.planned else " (DOES NOT FIT: out-of-memory recovery will split)")
        )
