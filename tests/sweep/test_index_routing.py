"""Index routing of the adapter bank (``AdapterBank.route(..., by_index=True)``, ``decode_routing="index"``).

The block route is a Python list that ``torch.compile`` specialises on: a compiled decode step is compiled
again for every new route, which on the H200 stalled a halving sweep at its first rung for over 70 s
(``benchmarks/sweep/README.md``). Index routing reads only tensors, so one compiled step serves every
route of a shape, and the sweep pads its decode to the rows it has had so a rung keeps the shape.
Tolerance against the block route: 1e-5 on fp32 logits (the same products, summed with exact zeros for
the other slots: only the GEMM's summation order differs).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.sweep import SuccessiveHalving
from rapidfire_hf.sweep.lora import AdapterBank

from .helpers import lora_config, make_sweep

# three slots, routes over the same 12 rows: every trial, two of them with base rows between, one alone
ROUTES = [
    [("a", 4), ("b", 4), ("c", 4)],
    [("c", 6), (None, 2), ("a", 4)],
    [("b", 12)],
]


def _bank_model(tokenizer):
    model = build_tiny_llama(tokenizer).eval()
    bank = AdapterBank(model, lora_config())
    g = torch.Generator().manual_seed(0)
    for i, slot in enumerate("abc"):
        bank.add(slot, seed=i)
        with torch.no_grad():  # B starts at zero: give every adapter a delta of its own
            for p in bank.parameters(slot)[1::2]:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model, bank


def test_index_route_equals_block_route(tokenizer):
    model, bank = _bank_model(tokenizer)
    ids = torch.randint(3, 40, (12, 7), generator=torch.Generator().manual_seed(1))
    base = model(input_ids=ids).logits
    for route in ROUTES:
        with torch.no_grad(), bank.route(route):
            blocks = model(input_ids=ids).logits
        with torch.no_grad(), bank.route(route, by_index=True):
            index = model(input_ids=ids).logits
        assert (blocks - base).abs().max() > 1e-2  # the adapters change the logits: the check can fail
        torch.testing.assert_close(index, blocks, atol=1e-5, rtol=1e-5)
    assert bank.by_index is False and bank.segments is None  # the route ends with its block


def test_index_route_compiles_once_for_every_route(tokenizer):
    """dynamo's graph count (the ``eager`` backend: guards as inductor's, without compiling kernels)."""
    model, bank = _bank_model(tokenizer)
    ids = torch.randint(3, 40, (12, 7), generator=torch.Generator().manual_seed(1))

    def graphs(by_index: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(lambda x: model(input_ids=x).logits, backend="eager", dynamic=False)
        for route in ROUTES:
            with torch.no_grad(), bank.route(route, by_index=by_index):
                step(ids)
        return counters["stats"]["unique_graphs"]

    assert graphs(by_index=False) == len(ROUTES)  # the block route: one graph per route
    assert graphs(by_index=True) == 1
    torch._dynamo.reset()


def test_decode_routing_refuses_unknown_values(tokenizer):
    _, bank = _bank_model(tokenizer)
    with pytest.raises(
        ValueError, match=r"decode_routing must be one of \('auto', 'blocks', 'index'\), got 'idx'"
    ):
        bank.decode_routing = "idx"
    assert bank.decode_routing == "auto"


def test_auto_routing_routes_by_index_only_where_the_decode_is_compiled(tokenizer):
    """The default, "auto", takes the index route where a compiled step would re-trace each new route,
    and the block route (peft's arithmetic) where nothing is compiled; an explicit choice is kept."""
    model, bank = _bank_model(tokenizer)
    assert bank.decode_routing == "auto"
    assert bank.routes_by_index(compiled=True) and not bank.routes_by_index(compiled=False)
    bank.decode_routing = "blocks"
    assert not bank.routes_by_index(compiled=True)
    bank.decode_routing = "index"
    assert bank.routes_by_index(compiled=False)

    from rapidfire_hf.rollout.engine import RolloutEngine

    for mode, cuda in (("auto", True), ("compile", True), ("cuda_graph", False), ("eager", False)):
        engine = RolloutEngine(model, pad_token_id=0, backend="static", decode_mode=mode)
        assert engine.compiles_decode(torch.device("cuda")) is cuda, mode
        assert engine.compiles_decode(torch.device("cpu")) is False, mode
    hf = RolloutEngine(model, pad_token_id=0, backend="hf")
    assert hf.compiles_decode(torch.device("cuda")) is False


def test_a_non_finite_adapter_off_the_route_stays_out(tokenizer):
    """A stopped trial's diverged (NaN) adapter must not reach the routed rows through the mask's zeros."""
    model, bank = _bank_model(tokenizer)
    with torch.no_grad():
        for p in bank.parameters("b"):
            p.fill_(float("nan"))
    ids = torch.randint(3, 40, (8, 5), generator=torch.Generator().manual_seed(3))
    route = [("a", 4), ("c", 2), (None, 2)]
    with torch.no_grad(), bank.route(route):
        blocks = model(input_ids=ids).logits
    with torch.no_grad(), bank.route(route, by_index=True):
        index = model(input_ids=ids).logits
    assert torch.isfinite(index).all()
    torch.testing.assert_close(index, blocks, atol=1e-5, rtol=1e-5)


def test_index_route_refreshes_trained_weights(tokenizer):
    """The stacks are copied from the adapters on every route: a decode sees the weights of the last update."""
    model, bank = _bank_model(tokenizer)
    ids = torch.randint(3, 40, (4, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), bank.route([("a", 4)], by_index=True):
        before = model(input_ids=ids).logits
    with torch.no_grad():
        for p in bank.parameters("a"):
            p.mul_(2.0)
    with torch.no_grad(), bank.route([("a", 4)], by_index=True):
        after = model(input_ids=ids).logits
    with torch.no_grad(), bank.route([("a", 4)]):
        blocks = model(input_ids=ids).logits
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, blocks, atol=1e-5, rtol=1e-5)


def test_sweep_with_index_routing_equals_block_routing(tokenizer, tmp_path):
    """A halving sweep decoded through the index route: the same curves as the block route, and the
    decode keeps its batch rows after the rung (the stopped trial's rows are filled, not dropped)."""
    trials = {
        "kl0.01": {"kl_coef": 0.01},
        "kl0.2": {"kl_coef": 0.2, "seed": 3},
        "lr3": {"learning_rate": 3e-3},
    }
    results, rows = {}, {}
    for routing in ("blocks", "index"):
        sweep = make_sweep(tokenizer, tmp_path / routing, trials, rollout_backend="static", max_steps=3)
        sweep.early_stopping = SuccessiveHalving(rungs=(1,), keep=0.5)
        sweep.bank.decode_routing = routing
        seen = []
        generate = sweep.phases.engine.generate

        def spy(input_ids, *args, _seen=seen, _generate=generate, **kwargs):
            _seen.append(input_ids.shape[0])
            return _generate(input_ids, *args, **kwargs)

        sweep.phases.engine.generate = spy
        results[routing] = {name: r.log_history for name, r in sweep.train().items()}
        rows[routing] = seen
    assert rows["blocks"][0] > rows["blocks"][-1]  # the rung stopped trials: fewer rows to decode
    assert rows["index"] == [rows["index"][0]] * len(rows["index"])  # ... padded back to the first count
    _assert_same_curves(results["blocks"], results["index"])


class _CloneAt:
    """Clones trial ``src`` twice after its update ``step`` (3 trials -> 5 slots: the stacks outgrow 4)."""

    def __init__(self, src, step):
        self.src, self.step = src, step

    def on_step_end(self, args, state, control, sweep=None, trial=None, **kwargs):
        if trial == self.src and state.global_step == self.step:
            sweep.clone(self.src, "copy1")
            sweep.clone(self.src, "copy2", learning_rate=3e-3)


def test_clones_past_the_stacks_capacity(tokenizer, tmp_path):
    trials = {
        "kl0.01": {"kl_coef": 0.01},
        "kl0.2": {"kl_coef": 0.2, "seed": 3},
        "lr3": {"learning_rate": 3e-3},
    }
    results, versions = {}, {}
    for routing in ("blocks", "index"):
        sweep = make_sweep(tokenizer, tmp_path / routing, trials, rollout_backend="static", max_steps=3)
        sweep.bank.decode_routing = routing
        sweep.callbacks.append(_CloneAt("kl0.01", 1))
        results[routing] = {name: r.log_history for name, r in sweep.train().items()}
        layer = next(iter(sweep.bank.layers.values()))
        versions[routing] = None if layer._a_all is None else layer._a_all.shape[0] // layer.r
    assert set(results["index"]) == {*trials, "copy1", "copy2"}
    assert versions == {"blocks": None, "index": 8}  # 5 slots: the stacks grew from capacity 4 to 8
    _assert_same_curves(results["blocks"], results["index"])


def _assert_same_curves(blocks: dict, index: dict) -> None:
    """Every trial's logged scores, KL and value loss within 1e-5 under both routes (same updates)."""
    assert blocks.keys() == index.keys()
    for name, history in blocks.items():
        assert len(history) == len(index[name])
        for ha, hb in zip(history, index[name]):
            for key in ("objective/scores", "objective/kl", "loss/value_avg"):
                if key in ha:
                    assert abs(ha[key] - hb[key]) <= 1e-5, (name, key, ha[key], hb[key])


def test_the_sweep_keeps_sdpa_for_auto_and_a_named_attention(monkeypatch):
    import rapidfire_hf.rollout as rollout
    from rapidfire_hf.sweep.sweep import sweep_decode_attention

    assert sweep_decode_attention("auto") == "sdpa"  # no sweep was measured with the Triton kernel
    for name in ("sdpa", "matmul", "triton"):
        assert sweep_decode_attention(name) == name
    # and it is what the sweep's engine gets
    seen = {}

    class Spy:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(rollout, "RolloutEngine", Spy)
    from rapidfire_hf.sweep.sweep import PPOSweep

    fake = type("S", (), {})()
    fake.tok = type("T", (), {"eos_token_id": 2, "pad_token_id": 0})()
    fake.model = torch.nn.Linear(2, 2)  # the batched decode cannot run it: the hf path, same arguments
    fake.args = type("A", (), {})()
    for key, value in dict(
        stop_token="eos", stop_token_id=None, rollout_decode_mode="auto", rollout_decode_attention="auto",
        rollout_decode_sampler="torch", rollout_decode_fuse_projections=False, rollout_decode_linear="torch",
        rollout_kv_cache_dtype="auto",
    ).items():  # fmt: skip
        setattr(fake.args, key, value)
    PPOSweep._make_engine(fake)
    assert seen["decode_attention"] == "sdpa"
