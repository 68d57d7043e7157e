"""The three phases of one sweep update, each batched across trials: rollout, scoring, PPO epochs.

Every phase lays the active trials' rows out in consecutive blocks, one block per trial, and routes each
block through its trial's adapter (:class:`rapidfire_hf.sweep.lora.AdapterBank`). Per-trial math (KL
shaping, GAE, whitening, the clipped losses) is the PPO code of :mod:`rapidfire_hf.ppo.core`, applied to
each trial's block with that trial's settings; the statistics are those ``PPOTrainer`` logs.
"""

from __future__ import annotations

import torch

from rapidfire_hf.memory.planner import MAX_TRAIN_TOKENS, UNPLANNED_SCORING_ROWS
from rapidfire_hf.models.plumbing import classifier_parts
from rapidfire_hf.ppo.core import compute_advantages, first_true_indices, ppo_loss, truncate_after_stop
from rapidfire_hf.ppo.modeling import (
    causal_lm_parts,
    policy_logprobs,
    response_logprobs,
    sequence_inputs,
)
from rapidfire_hf.ppo.reporting import update_device_metrics, update_host_metrics
from rapidfire_hf.ppo.rollout_phase import sampling_params
from rapidfire_hf.ppo.types import STAT_KEYS as _STAT_KEYS
from rapidfire_hf.ppo.types import Experience, Rollout


def blocks(trials, rows_of) -> list[tuple[object, int, int]]:
    """``[(trial, start, end), ...]``: consecutive row blocks, ``rows_of(trial)`` rows each."""
    out, start = [], 0
    for t in trials:
        n = rows_of(t)
        out.append((t, start, start + n))
        start += n
    return out


def packs(layout, step: int) -> list[list[tuple[object, int, int]]]:
    """The scoring forwards: each trial's rows cut in pieces of ``step`` as that trial alone cuts them, the
    pieces of consecutive trials packed into forwards of at most ``step`` rows.

    A piece never straddles two trials, so every small per-piece matmul (a value head, the reward model's
    one-output head) sees exactly the rows it sees alone: CPU GEMMs of a few rows (``M < 8``) round
    differently from the same rows inside a larger batch (one ulp, measured).
    """
    pieces = [(t, a, min(a + step, e)) for t, s, e in layout for a in range(s, e, step)]
    out, rows = [], 0
    for piece in pieces:
        n = piece[2] - piece[1]
        if out and rows + n <= step:
            out[-1].append(piece)
            rows += n
        else:
            out.append([piece])
            rows = n
    return out


class SweepPhases:
    """Rollout, scoring and optimisation of a set of trials on one shared model (see module docstring).

    Args:
        model: the base causal LM with the bank's layers injected.
        bank: the :class:`AdapterBank`.
        shared: the sweep's shared PPOConfig (decode settings, scoring batch size).
        tokenizer: the processing class.
        engine: a ``RolloutEngine`` on ``model`` (static backend: one decode for every trial), or None to
            generate trial by trial with ``model.generate``.
        reward_model / reward_funcs: one of them, shared by every trial.
        full_mask / reward_full_mask: give the policy's / the reward model's forwards the 4-D mask
            (:func:`rapidfire_hf.ppo.modeling.sequence_inputs`; SDPA models only).
        train_rows_per_forward: the most rows one training forward takes across trials (None: the
            throughput planner's merge limit, see :func:`train_pack_rows`).
    """

    def __init__(
        self,
        model,
        bank,
        shared,
        tokenizer,
        engine,
        reward_model,
        reward_funcs,
        full_mask,
        reward_full_mask,
        train_rows_per_forward: int | None = None,
    ):
        self.model, self.bank, self.shared, self.tok = model, bank, shared, tokenizer
        self.train_rows_per_forward = train_rows_per_forward
        self.engine, self.reward_model, self.reward_funcs = engine, reward_model, reward_funcs
        self.full_mask, self.reward_full_mask = full_mask, reward_full_mask  # 4-D masks: see sweep._full_mask
        self.pad = tokenizer.pad_token_id
        self.stop = tokenizer.eos_token_id if shared.stop_token == "eos" else shared.stop_token_id
        self.decoder, self.lm_head = causal_lm_parts(model)
        self.device = next(model.parameters()).device
        self._last_route = None

    # ------------------------------------------------------------------ rollout
    def rollout(self, trials, batches: list[dict]) -> list[Rollout]:
        """Sample each trial's prompts with its own adapter and its own noise, in one decode."""
        a = self.shared
        params = sampling_params(a)
        queries = [b["input_ids"].to(self.device) for b in batches]
        if self.engine.backend == "static":
            q = torch.cat(queries)
            gens = [(x.shape[0], t.update_generator()) for t, x in zip(trials, queries)]
            route = [(t.slot, x.shape[0]) for t, x in zip(trials, queries)]
            if route != self._last_route:  # recorded decode graphs (GPU) bake the route in: record anew
                self.engine.release()
                self._last_route = route
            with self.bank.route(route):
                out = self.engine.generate(q, q != self.pad, params, generator=gens)
            responses = out.responses.split([x.shape[0] for x in queries])
            logprobs = out.logprobs.split([x.shape[0] for x in queries])
        else:  # model.generate samples a whole batch from one stream: one call per trial keeps them apart
            responses, logprobs = [], []
            for t, x in zip(trials, queries):
                with self.bank.route([(t.slot, x.shape[0])]):
                    out = self.engine.generate(x, x != self.pad, params, generator=t.update_generator())
                responses.append(out.responses)
                logprobs.append(out.logprobs)
        return [
            Rollout(
                queries=x,
                responses=r,
                logprobs=lp.float(),
                extra={k: v for k, v in b.items() if k != "input_ids"},
            )
            for x, r, lp, b in zip(queries, responses, logprobs, batches)
        ]

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def score(self, trials, rollouts: list[Rollout]) -> list[Experience]:
        """Reference log-probs (adapters off), values (each trial's adapter and head) and scores, batched."""
        ctx = rollouts[0].queries.shape[1]
        qr = torch.cat([r.query_responses for r in rollouts])
        posts = [truncate_after_stop(r.responses, self.stop, self.pad) for r in rollouts]
        post_qr = torch.cat([torch.cat([r.queries, p], 1) for r, p in zip(rollouts, posts)])
        layout = blocks(trials, lambda t: t.args.local_batch_size)
        step = self.shared.local_rollout_forward_batch_size
        if step == "auto":  # the sweep has no throughput planner yet: TRL's default chunk
            step = UNPLANNED_SCORING_ROWS
        ref_lp, values, scores = [], [], []
        with self._autocast():
            for pieces in packs(layout, step):
                lo, hi = pieces[0][1], pieces[-1][2]
                chunk = qr[lo:hi]
                ref_lp.append(
                    policy_logprobs(self.model, chunk, self.pad, ctx, self.shared.temperature, self.full_mask)
                )
                segs = [(t.slot, e - s) for t, s, e in pieces]
                with self.bank.route(segs):
                    hidden = self.decoder(**sequence_inputs(chunk, self.pad, self.full_mask), use_cache=False)
                heads = [t.value_head for t, _, _ in pieces]
                values.append(self._heads(heads, segs, hidden.last_hidden_state[:, ctx - 1 : -1]))
                if self.reward_model is not None:
                    scores.append(self._reward_model_scores(post_qr[lo:hi], segs, ctx))
        ref_lp, values = torch.cat(ref_lp).float(), torch.cat(values).float()
        per_func = torch.cat(scores)[:, None] if scores else self._reward_funcs_scores(rollouts, posts)
        out = []
        eos = self.tok.eos_token_id
        for (t, s, e), r, post in zip(layout, rollouts, posts):
            a = t.args
            weights = (self.reward_model is None and a.reward_weights) or [1.0] * per_func.shape[1]
            sc = torch.zeros(e - s, dtype=torch.float32, device=per_func.device)
            for j, w in enumerate(weights):  # in PPOTrainer's order of additions
                sc = sc + w * per_func[s:e, j]
            if a.missing_eos_penalty is not None and eos is not None:
                sc = sc - a.missing_eos_penalty * (~(post == eos).any(-1)).float()
            adv = compute_advantages(
                r.logprobs,
                ref_lp[s:e],
                values[s:e],
                sc.float(),
                first_true_indices(post == self.pad) - 1,
                kl_coef=a.kl_coef,
                kl_estimator=a.kl_estimator,
                gamma=a.gamma,
                lam=a.lam,
                whiten_rewards=a.whiten_rewards,
            )
            out.append(Experience(rollout=r, adv=adv, postprocessed_responses=post))
        return out

    def _reward_model_scores(self, post_qr: torch.Tensor, segs, ctx: int) -> torch.Tensor:
        """The reward model's backbone once for the pack; its one-output head per piece (see :func:`packs`)."""
        backbone, score = classifier_parts(self.reward_model, "reward_model")
        hidden = backbone(
            **sequence_inputs(post_qr, self.pad, self.reward_full_mask), use_cache=False
        ).last_hidden_state
        last = first_true_indices(post_qr[:, ctx:] == self.pad) - 1 + ctx
        final = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # [rows, H]
        return torch.cat([score(x).squeeze(-1).float() for x in final.split([n for _, n in segs])])

    @staticmethod
    def _heads(heads, segs, hidden: torch.Tensor) -> torch.Tensor:
        """Each row block's values from its own trial's value head. [rows, R]"""
        parts, start = [], 0
        for head, (_, rows) in zip(heads, segs):
            parts.append(head(hidden[start : start + rows]))
            start += rows
        return torch.cat(parts)

    def _reward_funcs_scores(self, rollouts, posts) -> torch.Tensor:
        """Every reward function called once on all trials' completions: ``[rows, functions]``."""
        tok = self.tok
        queries = torch.cat([r.queries for r in rollouts])
        post = torch.cat(posts)
        prompts = tok.batch_decode(queries, skip_special_tokens=True)
        completions = tok.batch_decode(post, skip_special_tokens=True)
        completion_ids = [row[row != self.pad].tolist() for row in post.cpu()]
        columns = {}
        for key in rollouts[0].extra or {}:
            columns[key] = [v for r in rollouts for v in r.extra[key]]
        cols = []
        for func in self.reward_funcs:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            if values is None or len(values) != len(completions):
                raise ValueError(
                    f"reward function {getattr(func, '__name__', func)!r} returned "
                    f"{None if values is None else len(values)} scores for {len(completions)} completions: "
                    "return one float per completion."
                )
            cols.append(torch.tensor([float(v) for v in values], dtype=torch.float32))
        return torch.stack(cols, dim=1).to(self.device)

    # ------------------------------------------------------------------ PPO epochs
    def optimize(self, trials, exps: list[Experience]) -> list[dict[str, torch.Tensor]]:
        """Every trial's PPO epochs, micro-step by micro-step together: the k-th micro-batch of each trial
        shares one forward and one backward; each trial's optimizer steps when its own window closes."""
        schedules = [_schedule(t) for t in trials]
        stats = [{k: torch.zeros(_stat_shape(t), device=self.device) for k in _STAT_KEYS} for t in trials]
        ctx = exps[0].rollout.queries.shape[1]
        self.model.train()
        for head in (t.value_head for t in trials):
            head.train()
        steps = [iter(s) for s in schedules]
        seq = exps[0].rollout.query_responses.shape[1]
        micro = max(t.args.per_device_train_batch_size for t in trials)
        cap = train_pack_rows(seq, micro, self.train_rows_per_forward)
        while True:
            batch = [(i, nxt) for i, it in enumerate(steps) if (nxt := next(it, None)) is not None]
            if not batch:
                break
            # each trial's gradient comes from its own rows only (the base is frozen), so the trials of one
            # micro-step may share a forward or not without changing the math; packing bounds the peak
            for pack in pack_in_order(batch, lambda item: int(item[1][0].numel()), cap):
                self._micro_step(trials, exps, stats, pack, ctx)
        return stats

    def _micro_step(self, trials, exps, stats, batch, ctx) -> None:
        rows = [exps[i].rollout.query_responses[step[0].to(self.device)] for i, step in batch]
        segs = [(trials[i].slot, r.shape[0]) for (i, _), r in zip(batch, rows)]
        qr = torch.cat(rows)
        with self._autocast(), self.bank.route(segs):
            hidden = self.decoder(**sequence_inputs(qr, self.pad, self.full_mask), use_cache=False)
            resp_hidden = hidden.last_hidden_state[:, ctx - 1 : -1]
            lp, ent = response_logprobs(resp_hidden, self.lm_head, qr[:, ctx:], self.shared.temperature, True)
            vpred = self._heads([trials[i].value_head for i, _ in batch], segs, resp_hidden).float()
        total, start = 0.0, 0
        for (i, (idx, pos, _)), (_, n) in zip(batch, segs):
            t, adv = trials[i], exps[i].adv
            idx = idx.to(self.device)
            a = t.args
            sl = slice(start, start + n)
            out = ppo_loss(
                lp[sl], adv.logprobs[idx], adv.advantages[idx], vpred[sl], adv.values[idx], adv.returns[idx],
                adv.padding_mask[idx], adv.padding_mask_p1[idx],
                cliprange=a.cliprange, cliprange_value=a.cliprange_value, vf_coef=a.vf_coef,
            )  # fmt: skip
            window = a.micro_batches_per_step
            t.health.observe_loss(out.loss.detach())  # the window's finite-step check, as PPOTrainer's
            total = total + (out.loss / window if window > 1 else out.loss)  # as accelerate's backward
            for key, value in zip(
                _STAT_KEYS,
                (out.approx_kl, out.pg_clipfrac, out.pg_loss, out.vf_loss, out.vf_clipfrac, ent[sl].mean(),
                 out.ratio_mean),
            ):  # fmt: skip
                stats[i][key][pos] = value.detach()
            start += n
        total.backward()
        for i, (_, _, closes) in batch:
            if closes:
                self._step(trials[i])

    @staticmethod
    def _step(trial) -> None:
        """Close ``trial``'s window as PPOTrainer's Stepper closes one: clip, then its step health steps the
        optimizer or skips a window whose loss or gradients are not finite."""
        a = trial.args
        grad_norm = None
        if a.max_grad_norm and a.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(trial.params, a.max_grad_norm)
        try:
            trial.health.step(trial.optimizer, trial.params, grad_norm)
        except (RuntimeError, ValueError, OverflowError) as err:  # this trial diverges, not the sweep
            trial.step_error = trial.step_error or f"its optimizer step raised {type(err).__name__}: {err}"
        trial.optimizer.zero_grad(set_to_none=True)

    def _autocast(self):
        a = self.shared
        enabled = bool(a.bf16 or a.fp16) and self.device.type == "cuda"
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16 if a.bf16 else torch.float16, enabled=enabled
        )


def train_pack_rows(seq_len: int, micro_rows: int, override: int | None = None) -> int:
    """Rows one training forward of a sweep may take across its trials.

    ``override`` when given; else as many rows as the throughput planner would merge into one forward of
    a single run (:data:`rapidfire_hf.memory.planner.MAX_TRAIN_TOKENS` tokens; H200, 1.1B: no measurable
    speed above it), and never fewer than one trial's micro-batch. So the training peak of a sweep stops
    growing with the number of trials once their rows pass that many tokens.
    """
    if override is not None:
        if int(override) < 1:
            raise ValueError(f"train_rows_per_forward must be >= 1, got {override}")
        return int(override)
    return max(micro_rows, MAX_TRAIN_TOKENS // max(1, seq_len))


def pack_in_order(items: list, rows_of, cap: int) -> list[list]:
    """Consecutive groups of ``items`` of at most ``cap`` rows each (an item larger than ``cap`` alone)."""
    groups, current, rows = [], [], 0
    for item in items:
        n = rows_of(item)
        if current and rows + n > cap:
            groups.append(current)
            current, rows = [], 0
        current.append(item)
        rows += n
    if current:
        groups.append(current)
    return groups


def _stat_shape(trial) -> tuple[int, int, int]:
    a = trial.args
    return (a.num_ppo_epochs, a.num_mini_batches, a.micro_batches_per_step)


def _schedule(trial):
    """One trial's micro-steps in PPOTrainer's order: ``(row indices, (epoch, mini, micro), closes window)``.

    The permutation of an epoch is drawn from the trial's generator when the epoch starts, as PPOTrainer
    draws it.
    """
    a = trial.args
    n, mb, micro = a.local_batch_size, a.local_mini_batch_size, a.per_device_train_batch_size
    for epoch in range(a.num_ppo_epochs):
        perm = torch.randperm(n, generator=trial.perm_generator)
        for m, mb_start in enumerate(range(0, n, mb)):
            mb_idx = perm[mb_start : mb_start + mb]
            starts = list(range(0, mb, micro))
            for u, start in enumerate(starts):
                yield mb_idx[start : start + micro], (epoch, m, u), u == len(starts) - 1


def trial_metrics(trial, exp: Experience, stats: dict, times, eos_id, train_start: float) -> dict:
    """The metrics ``PPOTrainer`` logs for one update, for one trial (times are the shared phases')."""
    device_metrics = update_device_metrics(exp, stats, eos_id)
    metrics = dict(zip(device_metrics, torch.stack(list(device_metrics.values())).tolist()))  # one host sync
    metrics.update(update_host_metrics(exp, times, trial.state.episode, train_start, trial.scheduler))
    return metrics
