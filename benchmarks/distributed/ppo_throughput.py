"""PPO tokens/s of rapidfire_hf.PPOTrainer on however many processes it is launched with.

Weak scaling: every rank rolls out and trains the same per-rank batch, so N ranks process N times
the tokens per update; ``tokens/s`` counts prompt + response tokens of all ranks per update second
(the trainer's ``tokens_per_second``). The first update (CUDA graph capture, allocator warm-up) is
reported but left out of the median.

Usage:
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml \
        benchmarks/distributed/ppo_throughput.py --out results/tput_2gpu.json
    torchrun --standalone --nproc_per_node 2 benchmarks/distributed/ppo_throughput.py --tiny --out x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

# The 1.1B Llama shape of DESIGN.md's baseline table.
LLAMA_1B = {"hidden": 2048, "layers": 22, "heads": 32, "kv_heads": 4, "vocab": 32000}
TINY = {"hidden": 32, "layers": 1, "heads": 2, "kv_heads": 1, "vocab": 64}


def llama_config(shape: dict, num_labels: int | None = None):
    from transformers import LlamaConfig

    extra = {"num_labels": num_labels} if num_labels else {}
    return LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["hidden"] * 11 // 4,
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **extra,
    )


def build_models(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Policy, value and reward models with random init, built directly on ``device``."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    with device:
        policy = LlamaForCausalLM(llama_config(shape)).to(dtype)
        value = LlamaForSequenceClassification(llama_config(shape, num_labels=1)).to(dtype)
        reward = LlamaForSequenceClassification(llama_config(shape, num_labels=1)).to(dtype)
    return policy, value, reward


def prompt_dataset(n: int, length: int, vocab: int, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)  # no pad/bos/eos inside prompts
    return Dataset.from_dict({"input_ids": ids.tolist()})


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke: a tiny model, fp32")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--optimizer", default="rapidfire", choices=["rapidfire", "adamw"])
    args = parser.parse_args()

    from rapidfire_hf.demo.task import build_char_tokenizer
    from rapidfire_hf.distributed import describe_engine
    from rapidfire_hf.optim import RapidFireOptimizer
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    cuda = torch.cuda.is_available() and not args.tiny
    shape = TINY if args.tiny else LLAMA_1B
    local_rank = int(__import__("os").environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t_build = time.perf_counter()
    policy, value, reward = build_models(shape, device, torch.bfloat16 if cuda else torch.float32)
    build_s = time.perf_counter() - t_build
    local = args.per_device_batch * args.accumulation
    config = PPOConfig(
        output_dir=str(args.out.parent / "tput_run"),
        use_cpu=not cuda,
        bf16=cuda,
        seed=0,
        per_device_train_batch_size=args.per_device_batch,
        gradient_accumulation_steps=args.accumulation,
        num_mini_batches=1,
        num_ppo_epochs=1,
        response_length=args.response_length,
        max_steps=args.updates,
        logging_steps=1,
        learning_rate=1e-6,
        local_rollout_forward_batch_size=local,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        max_grad_norm=0.0,
    )
    optimizer = (
        RapidFireOptimizer(lr=1e-6, gradient_pipeline=True, rollback="auto")
        if args.optimizer == "rapidfire"
        else None
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=build_char_tokenizer(),
        model=policy,
        ref_model=None,
        reward_model=reward,
        value_model=value,
        optimizer=optimizer,
        train_dataset=prompt_dataset(local * 8 * 8, args.prompt_length, shape["vocab"]),
    )
    support = describe_engine(trainer.accelerator)
    trainer.train()
    acc = trainer.accelerator
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0], device=acc.device)
    peaks = acc.gather(peak).tolist()
    if acc.is_main_process:
        logs = [h for h in trainer.state.log_history if "tokens_per_second" in h]
        steady = logs[1:] or logs
        result = {
            "processes": acc.num_processes,
            "engine": support.engine.value,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "model": "llama-1.1B" if not args.tiny else "tiny",
            "shape": shape,
            "dtype": "bf16" if cuda else "fp32",
            "optimizer": args.optimizer,
            "prompt_length": args.prompt_length,
            "response_length": args.response_length,
            "rollout_batch_per_rank": local,
            "updates": len(logs),
            "tokens_per_second": statistics.median(h["tokens_per_second"] for h in steady),
            "seconds_per_update": statistics.median(h["time/update"] for h in steady),
            "rollout_share": statistics.median(h["time/rollout"] / h["time/update"] for h in steady),
            "per_update": [
                {
                    k: h[k]
                    for k in (
                        "tokens_per_second",
                        "time/update",
                        "time/rollout",
                        "time/scoring",
                        "time/training",
                    )
                }
                for h in logs
            ],
            "peak_gib_per_rank": peaks,
            "build_seconds": build_s,
            "versions": {"torch": torch.__version__, **_versions()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: result[k] for k in ("processes", "tokens_per_second", "seconds_per_update")}))
    acc.wait_for_everyone()
    acc.end_training()


def _versions() -> dict:
    import accelerate
    import transformers

    return {"transformers": transformers.__version__, "accelerate": accelerate.__version__}


if __name__ == "__main__":
    main()
