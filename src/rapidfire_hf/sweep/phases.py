"""The three phases of one sweep update, each batched across trials: rollout, scoring, PPO epochs.

Every phase lays the active trials' rows out in consecutive blocks, one block per trial, and routes each
block through its trial's adapter (:class:`rapidfire_hf.sweep.lora.AdapterBank`). What this module holds is
that layout (row blocks, scoring packs, training packs) and the per-trial state it routes; the per-trial
math is PPOTrainer's own, called on each trial's block with that trial's settings: the training forward and
the fused values (``ppo/modeling.policy_outputs``, ``block_values``), reward weighting
(``ppo/rewards.weighted_scores``), ``missing_eos_penalty`` and advantages (``ppo/scoring.scored_experience``),
the window schedule, loss and statistics (``ppo/optimization.mini_batches``, ``rows_loss``,
``ppo/types.PPOStats``), the step guard (``optim/step_health``) and PPOTrainer's out-of-memory policies: a
training forward that runs out of memory is split and retried (``ppo/recovery.pack_recovery``), a scoring
forward is retried with half the rows per forward (``ppo/recovery.NoGradChunks``).
"""

from __future__ import annotations

import torch

from rapidfire_hf.memory.checkpointing import activation_bytes
from rapidfire_hf.memory.planner import MAX_TRAIN_TOKENS, UNPLANNED_SCORING_ROWS
from rapidfire_hf.models.plumbing import causal_lm_parts
from rapidfire_hf.ppo.core import truncate_after_stop
from rapidfire_hf.ppo.modeling import (
    block_values,
    policy_logprobs,
    policy_outputs,
    response_hidden,
    reward_model_scores,
    sequence_inputs,
)
from rapidfire_hf.ppo.optimization import (
    micro_batch_counts,
    micro_batch_starts,
    mini_batches,
    new_stats,
    rows_loss,
)
from rapidfire_hf.ppo.recovery import NoGradChunks, PackRows, pack_recovery
from rapidfire_hf.ppo.reporting import update_device_metrics, update_host_metrics
from rapidfire_hf.ppo.rewards import reward_columns, weighted_scores
from rapidfire_hf.ppo.rollout_phase import sampling_params
from rapidfire_hf.ppo.scoring import reward_texts, scored_experience
from rapidfire_hf.ppo.types import Experience, PPOStats, Rollout


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
        train_rows: the most rows one training forward takes across trials (None: the fixed rule of
            :func:`train_pack_rows`); the sweep's plan (``sweep/planning.py``) sets it before each update.
        scoring_rows: rows per scoring forward (None: ``local_rollout_forward_batch_size``, TRL's 64 for
            ``"auto"``); set by the sweep's plan too.
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
        train_rows: int | None = None,
        scoring_rows: int | None = None,
    ):
        self.model, self.bank, self.shared, self.tok = model, bank, shared, tokenizer
        self.train_rows, self.scoring_rows = train_rows, scoring_rows
        self.oom_splits = 0  # packed training forwards split after an OOM so far
        self.scoring_chunks = NoGradChunks(next(model.parameters()).device)  # oom_retries: scoring retries
        self.engine, self.reward_model, self.reward_funcs = engine, reward_model, reward_funcs
        self.full_mask, self.reward_full_mask = full_mask, reward_full_mask  # 4-D masks: see sweep._full_mask
        self.pad = tokenizer.pad_token_id
        self.stop = tokenizer.eos_token_id if shared.stop_token == "eos" else shared.stop_token_id
        self.decoder, self.lm_head = causal_lm_parts(model)
        self.device = next(model.parameters()).device
        self._last_route = None
        self._gen_rows = 0  # the most rows one batched decode has had (index routing pads up to it)
        self._index_version = -1  # the bank's index_version the engine's recorded graphs read

    @property
    def decode_rows(self) -> int:
        """The most rows one batched decode has had (the index route pads later decodes up to it)."""
        return self._gen_rows

    def row_activation_bytes(self, trial, tokens: int, ctx: int) -> int:
        """Bytes one training row of ``tokens`` tokens keeps for backward through the shared base, ``trial``'s
        adapter and value head (the plan's probe; :func:`rapidfire_hf.memory.checkpointing.activation_bytes`)."""
        vocab = self.model.config.vocab_size
        row = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(self.device)
        row[row == self.pad] = (self.pad + 1) % vocab  # no padding in the probe row

        def forward():
            with self._autocast(), self.bank.route([(trial.slot, 1)]):
                _, hidden, lp, ent = policy_outputs(
                    self.decoder, self.lm_head, row, self.pad, ctx, self.shared.temperature, self.full_mask, True
                )
                return lp, ent, block_values([trial.value_head], [1], hidden)

        was_training = self.model.training
        self.model.train()
        try:
            return activation_bytes(forward)
        finally:
            self.model.train(was_training)

    # ------------------------------------------------------------------ rollout
    def rollout(self, trials, batches: list[dict]) -> list[Rollout]:
        """Sample each trial's prompts with its own adapter and its own noise, in one decode."""
        a = self.shared
        params = sampling_params(a)
        queries = [b["input_ids"].to(self.device) for b in batches]
        if self.engine.backend == "static":
            q = torch.cat(queries)
            n = q.shape[0]
            gens = [(x.shape[0], t.update_generator()) for t, x in zip(trials, queries)]
            route = [(t.slot, x.shape[0]) for t, x in zip(trials, queries)]
            by_index = self.bank.routes_by_index(self.engine.compiles_decode(self.device))
            if by_index and self._gen_rows > n:
                # keep the decode's batch shape when trials stop: rows of no trial (the base model, noise of
                # their own) fill it, so the compiled step is reused (see sweep/lora.py)
                pad = self._gen_rows - n
                q = torch.cat([q, q[:1].expand(pad, -1)])
                gens.append((pad, torch.Generator().manual_seed(0)))
                route.append((None, pad))
            self._gen_rows = max(self._gen_rows, q.shape[0])
            if not by_index and route != self._last_route:  # recorded graphs bake the route in: record anew
                self.engine.release()
                self._last_route = route
            with self.bank.route(route, by_index=by_index):
                if by_index and self.bank.index_version != self._index_version:  # stacks or mask reallocated
                    self.engine.release()
                    self._index_version = self.bank.index_version
                out = self.engine.generate(q, q != self.pad, params, generator=gens)
            responses = out.responses[:n].split([x.shape[0] for x in queries])
            logprobs = out.logprobs[:n].split([x.shape[0] for x in queries])
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
        step = self.scoring_rows or self.shared.local_rollout_forward_batch_size
        if step == "auto":  # no plan (phases used on their own): TRL's default chunk
            step = UNPLANNED_SCORING_ROWS
        pending = {}  # the pieces of the pack that starts at a row

        def next_stop(start: int, rows: int) -> int:  # packs of `rows` from `start` (smaller after an OOM)
            pending[start] = packs([(t, max(s, start), e) for t, s, e in layout if e > start], rows)[0]
            return pending[start][-1][2]

        def score_pack(lo: int, hi: int):
            return self._score_pack(pending.pop(lo), qr[lo:hi], post_qr[lo:hi], ctx)

        # PPOTrainer's scoring policy: a pack that runs out of memory is scored again, packs of half as
        # many rows from there on (each trial's rows then cut as that trial alone cuts them after the OOM)
        setting = "local_rollout_forward_batch_size"
        done = self.scoring_chunks.run(score_pack, qr.shape[0], step, "scoring", setting, next_stop=next_stop)
        ref_lp, values = (torch.cat([d[i] for d in done]).float() for i in (0, 1))
        # the reward model's scores, or every reward function's once for all trials' rows (on the CPU)
        rm_scores = torch.cat([d[2] for d in done]) if self.reward_model is not None else None
        columns = self._reward_columns(rollouts, posts) if rm_scores is None else None
        out = []
        for (t, s, e), r, post in zip(layout, rollouts, posts):
            if rm_scores is not None:
                sc = rm_scores[s:e]
            else:  # each trial's weights, added as PPOTrainer adds them
                sc = weighted_scores(columns[s:e], t.args.reward_weights).to(self.device)
            out.append(
                scored_experience(
                    t.args, r, post, ref_lp[s:e], values[s:e], sc, self.tok.eos_token_id, self.pad
                )
            )
        return out

    def _score_pack(self, pieces, chunk, post_chunk, ctx: int):
        """Reference log-probs, values and reward-model scores (or None) of one scoring pack."""
        with self._autocast():
            ref = policy_logprobs(self.model, chunk, self.pad, ctx, self.shared.temperature, self.full_mask)
            segs = [(t.slot, e - s) for t, s, e in pieces]
            with self.bank.route(segs):
                hidden = response_hidden(self.decoder, sequence_inputs(chunk, self.pad, self.full_mask), ctx)
            rows = [n for _, n in segs]  # a head per piece (see packs)
            values = block_values([t.value_head for t, _, _ in pieces], rows, hidden)
            scores = None
            if self.reward_model is not None:
                scores = reward_model_scores(
                    self.reward_model, post_chunk, self.pad, ctx, self.reward_full_mask, rows
                )
        return ref, values, scores

    def _reward_columns(self, rollouts, posts) -> torch.Tensor:
        """Every reward function called once on all trials' completions: ``[rows, functions]`` on the CPU."""
        texts = reward_texts(self.tok, torch.cat([r.queries for r in rollouts]), torch.cat(posts), self.pad)
        columns = {key: [v for r in rollouts for v in r.extra[key]] for key in rollouts[0].extra or {}}
        return reward_columns(self.reward_funcs, *texts, columns)

    # ------------------------------------------------------------------ PPO epochs
    def optimize(self, trials, exps: list[Experience]) -> list[PPOStats]:
        """Every trial's PPO epochs, micro-step by micro-step together: the k-th micro-batch of each trial
        shares one forward and one backward; each trial's optimizer steps when its own window closes."""
        schedules = [_schedule(t) for t in trials]
        stats = [new_stats(t.args, t.args.per_device_train_batch_size, self.device) for t in trials]
        ctx = exps[0].rollout.queries.shape[1]
        self.model.train()
        for head in (t.value_head for t in trials):
            head.train()
        steps = [iter(s) for s in schedules]
        seq = exps[0].rollout.query_responses.shape[1]
        micro = max(t.args.per_device_train_batch_size for t in trials)
        cap = self.train_rows or train_pack_rows(seq, micro)
        # PPOTrainer's OOM policy, new each update (memory may differ after a rollout): a pack that runs out
        # of memory is split by rows and retried, later packs of the update split as often up front
        recovery = pack_recovery(
            self.shared.max_oom_splits, [p for t in trials for p in t.params], advice=PACK_ADVICE
        )
        try:
            while True:
                batch = [(i, nxt) for i, it in enumerate(steps) if (nxt := next(it, None)) is not None]
                if not batch:
                    break
                # each trial's gradient comes from its own rows only (the base is frozen), so the trials of one
                # micro-step may share a forward or not without changing the math; packing bounds the peak
                for pack in pack_in_order(batch, lambda item: int(item[1][0].numel()), cap):
                    self._micro_step(trials, exps, stats, pack, ctx, recovery)
        finally:
            self.oom_splits += len(recovery.events)
        return stats

    def _micro_step(self, trials, exps, stats, batch, ctx, recovery) -> None:
        """One forward and backward of the trials' micro-batches in ``batch`` (in pieces after an OOM), their
        statistics and losses to each trial, then the step of each trial whose window it closes."""
        pack = [PackRows(i, idx.to(self.device)) for i, (idx, _, _) in batch]
        results = recovery(lambda rows, weight: self._forward_backward(trials, exps, rows, ctx), pack)
        for i, (_, pos, _) in batch:
            out, entropy = results[i]
            trials[i].health.observe_loss(out.loss)  # the window's finite-step check, as PPOTrainer's
            stats[i].record(pos, out, entropy.mean())
        for i, (_, _, closes) in batch:
            if closes:
                self._step(trials[i])

    def _forward_backward(self, trials, exps, pack: list[PackRows], ctx) -> dict:
        """Forward and backward of a pack's rows: ``{trial index: (LossOutput, entropy per row)}``, a piece of a
        trial's micro-batch normalised by that micro-batch's whole counts (so the pieces add up to it)."""
        rows = [exps[p.key].rollout.query_responses[p.rows] for p in pack]
        segs = [(trials[p.key].slot, len(p)) for p in pack]
        qr = torch.cat(rows)
        with self._autocast(), self.bank.route(segs):
            _, resp_hidden, lp, ent = policy_outputs(
                self.decoder, self.lm_head, qr, self.pad, ctx, self.shared.temperature, self.full_mask, True
            )
            heads = [trials[p.key].value_head for p in pack]
            vpred = block_values(heads, [n for _, n in segs], resp_hidden).float()
        total, start, results = 0.0, 0, {}
        for p in pack:
            t, adv, sl = trials[p.key], exps[p.key].adv, slice(start, start + len(p))
            counts = None if p.whole else micro_batch_counts(adv, p.micro_batch)
            out = rows_loss(t.args, adv, p.rows, lp[sl], vpred[sl], counts)
            window = t.args.micro_batches_per_step
            total = total + (out.loss / window if window > 1 else out.loss)  # as accelerate's backward
            out.loss = out.loss.detach()
            results[p.key] = (out, ent[sl].detach())
            start += len(p)
        total.backward()
        return results

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


PACK_ADVICE = (
    "Lower train_rows_per_forward (rows of one training forward across trials), per_device_train_batch_size "
    "(raise gradient_accumulation_steps to keep the batch), response_length, or raise max_oom_splits."
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


def _schedule(trial):
    """One trial's micro-steps in PPOTrainer's order: ``(row indices, (epoch, mini, micro), closes window)``
    (:func:`rapidfire_hf.ppo.optimization.mini_batches`, each mini-batch cut in the trial's micro-batches)."""
    micro = trial.args.per_device_train_batch_size
    starts = micro_batch_starts(trial.args, micro)
    for epoch, m, mb_idx in mini_batches(trial.args, trial.perm_generator):
        for u, start in enumerate(starts):
            yield mb_idx[start : start + micro], (epoch, m, u), u == len(starts) - 1


def trial_metrics(trial, exp: Experience, stats: PPOStats, times, eos_id, train_start: float) -> dict:
    """The metrics ``PPOTrainer`` logs for one update, for one trial (times are the shared phases')."""
    device_metrics = update_device_metrics(exp, stats, eos_id)
    metrics = dict(zip(device_metrics, torch.stack(list(device_metrics.values())).tolist()))  # one host sync
    metrics.update(update_host_metrics(exp, times, trial.state.episode, train_start, trial.scheduler))
    return metrics
