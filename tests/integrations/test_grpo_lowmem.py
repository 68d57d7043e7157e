"""The mechanisms of ``memory.lowmem`` inside TRL's GRPO (chunked offloaded checkpointing, the hand-wired stack,
the 8-bit embedding state) against stock TRL GRPO. Each mechanism alone: tests/memory/test_offload.py,
tests/rollout/test_prefill.py, tests/optim/test_bnb.py; the benchmark's memory model: tests/benchmarks/.

Correctness claim checked here: on a tiny Llama in fp32 on the CPU, TRL 1.16's own GRPO loss
(``GRPOTrainer._compute_loss``) and every parameter gradient are the same with the chunked, offloaded
checkpointing as without any checkpointing, within rtol 1e-5 / atol 1e-7 (fp32 round-off: the chunks
sum the parameter gradients in a different order). The CUDA test repeats it with the host offload and
prefetch actually copying (skipped without a GPU).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from rapidfire_hf.memory.chunked_checkpoint import apply_chunked_checkpointing, checkpoint_module_in_chunks
from rapidfire_hf.memory.offload import HostOffloader, OptimizerStateOffload
from rapidfire_hf.optim.bnb import skip_bitsandbytes_sync_on_default_stream, use_8bit_embedding_state
from tests.benchmarks.loader import load_benchmark
from tests.helpers import grpo_wiring

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo"
RTOL, ATOL = 1e-5, 1e-7


def load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # run.py imports its sibling phases.py by name
    return load_benchmark(f"grpo/{name}.py", keep_on_path=True)


# GRPOTrainer refuses nn.DataParallel, which transformers' Trainer uses when one process sees several GPUs
ONE_GPU = pytest.mark.skipif(
    torch.cuda.device_count() > 1,
    reason="GRPOTrainer refuses nn.DataParallel (several GPUs visible): run with CUDA_VISIBLE_DEVICES=0",
)


def tiny_grpo(tokenizer, tmp_path, steps=2, hidden=64, layers=3, prompts=None, **overrides):
    """A tiny GRPOTrainer (fp32, CPU), HF checkpointing off as the benchmark's low-memory variants set it
    (shared with test_lowmem_option.py)."""
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward

    kwargs = dict(
        output_dir=tempfile.mkdtemp(dir=tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=0.0,
        seed=0,
        max_steps=steps,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    trainer = GRPOTrainer(
        model=build_tiny_llama(tokenizer, hidden=hidden, layers=layers),
        reward_funcs=vowel_reward,
        args=GRPOConfig(**kwargs),
        train_dataset=make_prompt_dataset(prompts or 8 * steps),
        processing_class=tokenizer,
    )
    return trainer


def grpo_trainer(tokenizer, tmp_path, device="cpu"):
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        report_to=[],
        use_cpu=device == "cpu",
        beta=0.0,
        seed=0,
        gradient_checkpointing=False,  # as rapidfire_lowmem2; the reference then has no recompute at all
        bf16=False,  # no bf16 autocast: compare at fp32 round-off
    )
    model = build_tiny_llama(tokenizer, layers=3).to(device)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowel_reward,
        args=args,
        train_dataset=make_prompt_dataset(16),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what the training loop sets before compute_loss
    return trainer


def grpo_inputs(vocab: int, device="cpu", b=8, p=6, c=8):
    """A GRPO micro-batch as ``_generate_and_score_completions`` hands it to ``compute_loss``: a
    left-padded prompt and a completion that stopped early, so the attention mask is not all ones."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_ids[0, :2], prompt_mask[0, :2] = 0, 0
    completion_ids = torch.randint(3, vocab, (b, c), generator=g)
    completion_mask = torch.ones(b, c, dtype=torch.long)
    completion_ids[1, 3:], completion_mask[1, 3:] = 0, 0
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(device) for k, v in inputs.items()}


def loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same(reference, candidate):
    (loss0, g0), (loss1, g1) = reference, candidate
    torch.testing.assert_close(loss1, loss0, rtol=RTOL, atol=ATOL)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("rows", [1, 3, 8])  # one row per chunk, a ragged last chunk, one chunk
def test_grpo_loss_and_gradients_match_stock(tokenizer, tmp_path, single_thread, rows):
    trainer = grpo_trainer(tokenizer, tmp_path)
    inputs = grpo_inputs(len(tokenizer))
    stock = loss_and_grads(trainer, inputs)  # TRL's GRPO loss, no checkpointing

    offloader = apply_chunked_checkpointing(trainer.model, rows=rows, offload=True)
    fired = []
    for p in trainer.model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    assert_same(stock, loss_and_grads(trainer, inputs))
    # 3 layers + the final norm keep one input each; every parameter's .grad is written exactly once
    # (the gradient pipeline steps a parameter when its hook fires)
    assert offloader.stats.saved == 4
    params = list(trainer.model.parameters())
    assert len(fired) == len(params) and {id(p) for p in fired} == {id(p) for p in params}
    # a second step reuses the same wrapping (the saved-input chain restarts)
    assert_same(stock, loss_and_grads(trainer, inputs))
    assert offloader.stats.saved == 8


def test_bf16_gradients_are_as_close_to_fp32_as_stocks(tokenizer, tmp_path, single_thread):
    """bf16 weights, as on the GPU: each chunk's weight-gradient GEMM rounds to bf16 (the partials are
    summed in fp32), so the gradient is not bit-equal to stock's; it is as far from the fp32 gradient
    as stock's own bf16 gradient is (within 25%; measured: 1% apart)."""

    def rel(a, b):
        return max(((a[n].float() - b[n].float()).norm() / b[n].float().norm()).item() for n in b)

    inputs = grpo_inputs(len(tokenizer), b=16, p=8, c=16)
    fp32 = grpo_trainer(tokenizer, tmp_path / "a")
    _, truth = loss_and_grads(fp32, inputs)
    stock = grpo_trainer(tokenizer, tmp_path / "b")
    stock.model.to(torch.bfloat16)
    _, stock_grads = loss_and_grads(stock, inputs)
    chunked = grpo_trainer(tokenizer, tmp_path / "c")
    chunked.model.to(torch.bfloat16)
    apply_chunked_checkpointing(chunked.model, rows=2)
    _, chunked_grads = loss_and_grads(chunked, inputs)
    assert all(g.dtype == torch.bfloat16 for g in chunked_grads.values())
    assert 0 < rel(chunked_grads, truth) <= 1.25 * rel(stock_grads, truth)


def test_generation_and_no_grad_calls_run_the_original_forward(tokenizer, tmp_path, single_thread):
    trainer = grpo_trainer(tokenizer, tmp_path)
    model = trainer.model
    ids = grpo_inputs(len(tokenizer))["prompt_ids"]
    with torch.no_grad():
        before = model(input_ids=ids).logits
    offloader = apply_chunked_checkpointing(model, rows=2)
    with torch.no_grad():
        after = model(input_ids=ids).logits
        out = model.generate(ids, max_new_tokens=3, do_sample=False)  # uses the KV cache
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert out.shape == (ids.shape[0], ids.shape[1] + 3)
    assert offloader.stats.saved == 0
    with pytest.raises(RuntimeError, match="already applied"):
        apply_chunked_checkpointing(model)
    with pytest.raises(ValueError, match="rows"):
        apply_chunked_checkpointing(grpo_trainer(tokenizer, tmp_path / "b").model, rows=0)


def test_a_module_returning_a_tuple_gets_the_same_structure_back(single_thread):
    class Layer(torch.nn.Module):  # older transformers decoder layers return (hidden_states, None)
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, hidden_states, attention_mask=None):
            return (torch.tanh(self.lin(hidden_states)) * attention_mask, None)

    torch.manual_seed(0)
    layer = Layer()
    x = torch.randn(5, 3, 6, requires_grad=True)
    mask = torch.rand(5, 3, 1)
    layer(x, attention_mask=mask)[0].sum().backward()
    reference = [layer.lin.weight.grad.clone(), x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    checkpoint_module_in_chunks(layer, 2, HostOffloader())
    out = layer(x, attention_mask=mask)  # the mask's rows are cut with the batch
    assert isinstance(out, tuple) and out[1] is None
    out[0].sum().backward()
    for got, want in zip([layer.lin.weight.grad, x.grad], reference):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-6)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_lowmem2_stack_with_8bit_adamw_pipelines_every_step(tokenizer, tmp_path, single_thread):
    """The stack of chunked checkpointing and optimizer-state offload wired in by hand, with bitsandbytes' 8-bit AdamW (it runs on the CPU
    too): every window stepped in backward, embedding state 32-bit and the rest 8-bit as transformers
    sets it up, the state moved out and back around each rollout."""
    from rapidfire_hf import enable_rapidfire
    from rapidfire_hf.integrations.parts import find_rapidfire_optimizer

    trainer = tiny_grpo(
        tokenizer, tmp_path, steps=3, hidden=128, layers=2, prompts=32, optim="adamw_8bit", learning_rate=1e-6
    )
    offloader = apply_chunked_checkpointing(trainer.model, rows=3)
    trainer = enable_rapidfire(
        trainer,
        config={"memory": {"optimization": "aggressive"}},
        optimizer_kwargs={"rollback": "off", "pipeline_bucket_mb": 0.05},  # several buckets at this size
    )
    state_offload = grpo_wiring.LazyStateOffload(trainer, OptimizerStateOffload, include_cpu=True)
    state_offload.install_wait(trainer.accelerator)
    assert grpo_wiring.release_rollout_cache_after_each_rollout(trainer, state_offload=state_offload)
    trainer.train()

    opt = find_rapidfire_optimizer(trainer.optimizer)
    stats = opt.stats()
    assert stats["pipelined_steps"] == 3 and not stats["deferred_steps"] and stats["pipeline_buckets"] > 3
    bits = {n: opt.state[p]["state1"].dtype for n, p in trainer.model.named_parameters()}
    assert bits["model.embed_tokens.weight"] == torch.float32
    assert bits["lm_head.weight"] == bits["model.layers.1.mlp.down_proj.weight"] == torch.uint8
    moved = state_offload.stats()["gib_per_rollout"]
    assert len(moved) == 3 and moved[0] == 0 and moved[1] > 0  # no state before the first step
    assert offloader.stats.saved == 3 * 3
    assert all(s["loss"] == s["loss"] for s in trainer.state.log_history if "loss" in s)  # finite


@pytest.mark.gpu
@ONE_GPU
def test_cuda_offload_and_prefetch_match_stock(tokenizer, tmp_path):
    trainer = grpo_trainer(tokenizer, tmp_path, device="cuda")
    inputs = grpo_inputs(len(tokenizer), device="cuda")
    stock = loss_and_grads(trainer, inputs)
    offloader = apply_chunked_checkpointing(trainer.model, rows=3, offload=True)
    for _ in range(2):
        assert_same(stock, loss_and_grads(trainer, inputs))
    stats = offloader.stats
    assert stats.saved == 8 and stats.to_host_bytes > 0 and stats.to_device_bytes == stats.to_host_bytes
    # each backward loads every chunk of every saved input (batch 8 in chunks of 3 rows: 3 chunks) and,
    # while it uses one, starts copying the next: all but the first chunk it loads were prefetched
    chunks, saved_per_backward = -(-8 // 3), stats.saved // 2
    assert stats.prefetched == 2 * (saved_per_backward * chunks - 1)  # 22 on the H200

    opt = torch.optim.AdamW(trainer.model.parameters())
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    opt.step()
    values = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v)}
    off = OptimizerStateOffload(opt)
    assert off.offload() > 0
    torch.cuda.synchronize()
    off.restore()
    off.wait()
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                assert torch.equal(v, values[(id(p), k)])


# ---- rapidfire_lowmem3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, forward_rows", [(3, 5), (8, 2)])  # wider and narrower forward chunks
def test_forward_rows_apart_from_backward_rows_match_stock(
    tokenizer, tmp_path, single_thread, rows, forward_rows
):
    trainer = grpo_trainer(tokenizer, tmp_path)
    inputs = grpo_inputs(len(tokenizer))
    stock = loss_and_grads(trainer, inputs)
    offloader = apply_chunked_checkpointing(trainer.model, rows=rows, forward_rows=forward_rows)
    assert_same(stock, loss_and_grads(trainer, inputs))
    assert offloader.stats.saved == 4
    with pytest.raises(ValueError, match="forward_rows"):
        apply_chunked_checkpointing(grpo_trainer(tokenizer, tmp_path / "b").model, forward_rows=0)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_8bit_embedding_state_keeps_the_trainers_hyperparameters(tokenizer, tmp_path, single_thread):
    """use_8bit_embedding_state: AdamW8bit with the trainer's own optim='adamw_8bit' arguments, and
    the embedding's state 8-bit as well (transformers keeps it 32-bit for optim='adamw_8bit')."""
    import bitsandbytes as bnb
    from trl import GRPOConfig, GRPOTrainer

    from rapidfire_hf.demo import build_tiny_llama, make_prompt_dataset, vowel_reward

    run = load("run")
    manager = bnb.optim.GlobalOptimManager.get_instance()

    def trainer_with_state(eight_bit_embedding: bool):
        # bitsandbytes keeps overrides process-wide, keyed by (group, parameter) index: one trainer's
        # 32-bit embedding override would apply to the next optimizer too (run.py: one process a variant)
        manager.initialize()
        args = GRPOConfig(
            output_dir=str(tmp_path / f"o{eight_bit_embedding}"),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=8,
            report_to=[],
            use_cpu=True,
            learning_rate=3e-4,
            adam_beta2=0.95,
            optim="adamw_8bit",
        )
        trainer = GRPOTrainer(
            model=build_tiny_llama(tokenizer, hidden=128),
            reward_funcs=vowel_reward,
            args=args,
            train_dataset=make_prompt_dataset(16),
            processing_class=tokenizer,
        )
        if eight_bit_embedding:
            info = use_8bit_embedding_state(trainer)
            assert "AdamW8bit" in info["optimizer_cls"] and "optim_bits" not in info["kwargs"]
        opt = trainer.create_optimizer()
        for p in trainer.model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        return trainer, opt

    plain, opt0 = trainer_with_state(False)
    eight, opt1 = trainer_with_state(True)
    manager.initialize()
    emb0, emb1 = plain.model.get_input_embeddings().weight, eight.model.get_input_embeddings().weight
    assert opt0.state[emb0]["state1"].dtype == torch.float32  # transformers' override
    assert opt1.state[emb1]["state1"].dtype == torch.uint8
    assert run.embedding_state_dtypes(eight.model, opt1)["state1"] == "uint8"
    assert run.state_gib(opt1) < run.state_gib(opt0)
    for g0, g1 in zip(opt0.param_groups, opt1.param_groups):  # same groups and hyper-parameters
        assert [p.shape for p in g0["params"]] == [p.shape for p in g1["params"]]
        assert (g0["lr"], g0["betas"], g0["eps"], g0["weight_decay"]) == (
            g1["lr"],
            g1["betas"],
            g1["eps"],
            g1["weight_decay"],
        )
    assert opt1.param_groups[0]["betas"] == (0.9, 0.95) and opt1.param_groups[0]["lr"] == 3e-4
    lm0, lm1 = plain.model.lm_head.weight, eight.model.lm_head.weight
    assert torch.equal(lm0, lm1)  # every non-embedding parameter: the same 8-bit update


# ---- rapidfire_lowmem4 ---------------------------------------------------------------------------------


def test_reused_host_buffers_give_stocks_loss_and_gradients_step_after_step(
    tokenizer, tmp_path, single_thread
):
    """HostOffloader(reuse_host_buffers=True), run through real copies to host buffers and back (copy_on_cpu):
    the first step creates one buffer per saved input (3 layers + the final norm), every later step takes
    them from the pool, and each step (different inputs, so a stale buffer would show) matches TRL's loss
    and gradients without checkpointing."""
    trainer = grpo_trainer(tokenizer, tmp_path)
    batches = [grpo_inputs(len(tokenizer))]
    g = torch.Generator().manual_seed(7)
    for _ in range(2):  # other token ids and advantages, same shapes
        b = dict(batches[0])
        b["completion_ids"] = torch.randint(3, len(tokenizer), b["completion_ids"].shape, generator=g)
        b["advantages"] = torch.randn(b["advantages"].shape, generator=g)
        batches.append(b)
    stock = [loss_and_grads(trainer, b) for b in batches]
    offloader = apply_chunked_checkpointing(
        trainer.model, rows=3, forward_rows=5, reuse_host_buffers=True, copy_on_cpu=True
    )
    for n, (b, ref) in enumerate(zip(batches, stock), start=1):
        assert_same(ref, loss_and_grads(trainer, b))
        assert offloader.stats.host_buffers_created == 4  # only in the first step
        assert offloader.stats.host_buffers_reused == 4 * (n - 1)
        assert offloader.stats.to_host_bytes == offloader.stats.to_device_bytes > 0
        assert len([x for bufs in offloader._pool.values() for x in bufs]) == 4  # all back after backward
    # a forward whose backward never runs gives its buffers back when its graph is dropped
    loss = trainer._compute_loss(trainer.model, batches[0])
    assert offloader.pooled_bytes() == 0
    del loss
    import gc

    gc.collect()
    assert len([x for bufs in offloader._pool.values() for x in bufs]) == 4
    # without reuse every save gets a new buffer
    plain = apply_chunked_checkpointing(
        grpo_trainer(tokenizer, tmp_path / "b").model, rows=3, copy_on_cpu=True
    )
    assert plain.reuse_host_buffers is False


@pytest.mark.gpu
@ONE_GPU
def test_cuda_reused_pinned_buffers_and_bnb_without_syncs_match(tokenizer, tmp_path):
    """On the GPU: pooled pinned buffers survive a CUDA-graph capture (which empties torch's pinned cache) and
    later steps still match stock; AdamW8bit without its per-parameter syncs gives the same bits."""
    trainer = grpo_trainer(tokenizer, tmp_path, device="cuda")
    inputs = grpo_inputs(len(tokenizer), device="cuda")
    stock = loss_and_grads(trainer, inputs)
    offloader = apply_chunked_checkpointing(trainer.model, rows=3, reuse_host_buffers=True)
    assert_same(stock, loss_and_grads(trainer, inputs))
    pool = [x.data_ptr() for bufs in offloader._pool.values() for x in bufs]
    assert len(pool) == 4 and all(x.is_pinned() for bufs in offloader._pool.values() for x in bufs)
    graph = torch.cuda.CUDAGraph()
    static = torch.zeros(4, device="cuda")
    with torch.cuda.graph(graph):  # calls torch._C._host_emptyCache() on enter
        static.add_(1)
    assert_same(stock, loss_and_grads(trainer, inputs))
    assert sorted(x.data_ptr() for bufs in offloader._pool.values() for x in bufs) == sorted(pool)
    assert offloader.stats.host_buffers_created == 4

    if importlib.util.find_spec("bitsandbytes") is None:
        return
    import bitsandbytes as bnb

    def steps():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4096, 64, device="cuda"))
        opt = bnb.optim.AdamW8bit([w], lr=1e-2)
        for i in range(3):
            w.grad = torch.randn_like(w) * (i + 1)
            opt.step()
        torch.cuda.synchronize()
        return w.detach().clone()

    before = steps()
    skip_bitsandbytes_sync_on_default_stream()
    assert torch.equal(steps(), before)


@pytest.mark.gpu
def test_rollout_warmup_stream_is_reused_and_workspaces_do_not_pile_up(tokenizer):
    """src/rapidfire_hf/rollout: released and re-recorded decode graphs warm up on one stream, so the memory
    allocated after each release + generate cycle stays flat (one cuBLAS workspace per new stream before)."""
    from rapidfire_hf.demo import build_tiny_llama
    from rapidfire_hf.rollout import RolloutEngine, SamplingParams
    from rapidfire_hf.rollout.static_engine import warmup_stream

    model = build_tiny_llama(tokenizer).cuda()
    enc = tokenizer(["task: abc ->", "hello there, world ->", "x"], return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
    engine = RolloutEngine(
        model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="cuda_graph"
    )
    params = SamplingParams(max_new_tokens=20, do_sample=False)
    allocated = []
    with torch.no_grad():
        for _ in range(4):
            engine.generate(ids, mask, params)
            engine.release()
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    assert warmup_stream() is warmup_stream()
    assert allocated[1] == allocated[2] == allocated[3], allocated
