"""The greedy rollout of a sharded PPOTrainer against its unsharded policy, shared by the FSDP2 and ZeRO-3
rank scripts: one rollout builds the engine on gathered weights, a second (in two chunks) runs under the
caller's gather counter, and both are compared with ``model.generate`` and the engine on the unsharded copy."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rapidfire_hf.rollout import RolloutEngine, SamplingParams


def greedy_rollout_check(trainer, single, tok, response_length: int, whole: Callable[[], bool], counter):
    """``(facts, gathers)``: the comparison's facts (``backend``, ``path``, ``rows``, ``equal_generate``,
    ``equal_engine``, ``equal_first``, ``tokens``, ``steps``, ``whole_steps``: whether every decode step saw
    ``whole()``), and what ``counter()`` counted around the chunked rollout."""
    batch = trainer.next_prompts(0)
    seen = []
    trainer.roller.engine = None  # built by the rollout, on gathered weights
    with torch.no_grad():
        first = trainer.roller.rollout(batch, None, sampling=False)  # builds the engine
        trainer.roller.engine._static.step_callback = lambda t: seen.append(whole())
        with counter() as gathers:  # two chunks of 2 prompts: still one gather for the rollout
            rollout = trainer.roller.rollout(batch, 2, sampling=False)
    queries = batch["input_ids"]
    params = SamplingParams(max_new_tokens=response_length, do_sample=False)
    ref = {}
    for backend in ("hf", "static"):
        engine = RolloutEngine(single, tok.pad_token_id, [tok.eos_token_id], backend=backend)
        ref[backend] = engine.generate(queries, queries != tok.pad_token_id, params).responses
    engine = trainer.roller.engine
    facts = dict(
        backend=engine.backend,
        path=engine.path,
        rows=int(queries.shape[0]),
        equal_generate=bool(torch.equal(rollout.responses, ref["hf"])),
        equal_engine=bool(torch.equal(rollout.responses, ref["static"])),
        equal_first=bool(torch.equal(first.responses, rollout.responses)),
        tokens=int((rollout.responses != tok.pad_token_id).sum()),
        steps=len(seen),
        whole_steps=bool(seen) and all(seen),
    )
    return facts, gathers
