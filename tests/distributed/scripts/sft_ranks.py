"""A few steps of TRL's ``SFTTrainer`` with ``enable_rapidfire``, one process per rank.

A tiny Llama (random init) and the demo's character tokenizer are saved to ``OUT_DIR/model`` and loaded
back through that local path, as a user's checkpoint would be. Launch with ``torchrun --nproc_per_node 2``
(CPU, gloo: DDP) or ``accelerate launch --config_file accelerate_configs/<engine>.yaml`` (GPUs: DDP,
DeepSpeed ZeRO-2/3, FSDP2).

Each rank writes ``sft_rank<r>.pt``: its parameters as one float64 vector (every rank under DDP, the
gathered full state on rank 0 only under ZeRO-3/FSDP2), the logged losses, what ``enable_rapidfire``
installed and skipped, the detected engine with its feature table, and the optimizer counters. Rank 0
also writes ``sft.json`` (the same without the parameters). A failure is written too, with the last
lines of its traceback, so that a run on a machine nobody watches still says what broke.

Usage: ``sft_ranks.py OUT_DIR [--device cpu|cuda] [--bf16] [--config balanced|<json>] [--stock]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import traceback
from pathlib import Path

import torch

STEPS = 4


def words(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 6))) for _ in range(n)]


def save_tiny_model(path: Path) -> None:
    """A random-init tiny Llama and the char tokenizer, written with ``save_pretrained``."""
    from rapidfire_hf.demo import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer()
    build_tiny_llama(tok, hidden=64, layers=2, heads=4, kv_heads=2, seed=0).save_pretrained(path)
    tok.save_pretrained(path)


def parse_config(text: str | None):
    """A preset name / YAML path as given, or a JSON dict (``'{"gradient": {"pipeline": true}}'``)."""
    if text is None or not text.lstrip().startswith("{"):
        return text
    return json.loads(text)


def build_trainer(args, model_dir: Path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    texts = [f"task: {w} -> {w[::-1]}" for w in words(128)]
    config = SFTConfig(
        output_dir=str(args.out / "run"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        max_length=24,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=args.device == "cpu",
        bf16=args.bf16,
    )
    return SFTTrainer(
        model=str(model_dir),  # loaded through the local path (AutoModelForCausalLM.from_pretrained)
        args=config,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


def full_parameters(trainer) -> torch.Tensor:
    """All parameters as one float64 vector; empty on the ranks that receive no gathered state."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # a collective under ZeRO-3 / FSDP
    if not state:
        return torch.empty(0, dtype=torch.float64)
    return torch.cat([state[k].detach().reshape(-1).double().cpu() for k in sorted(state)])


def local_parameters_finite(model) -> bool:
    """Finite on this rank's own tensors (the local shards under ZeRO-3 / FSDP2)."""
    ok = True
    for p in model.parameters():
        t = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps this rank's partition there
        t = t if t is not None else p
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 DTensor shard
        if t.numel():
            ok = ok and bool(torch.isfinite(t.detach().float()).all())
    return ok


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def traceback_tail(lines: int = 25) -> str:
    return "\n".join(traceback.format_exc().rstrip().splitlines()[-lines:])


def run(args) -> dict:
    from accelerate import PartialState

    from rapidfire_hf import enable_rapidfire
    from rapidfire_hf.distributed import describe_engine
    from rapidfire_hf.integrations.parts import STATE_ATTR, find_rapidfire_optimizer

    result: dict = {"rank": rank(), "phase": "setup", "status": "error"}
    try:
        state = PartialState(cpu=args.device == "cpu")
        model_dir = args.out / "model"
        with state.main_process_first():  # rank 0 writes the checkpoint, the others then read it
            if state.is_main_process:
                save_tiny_model(model_dir)
        result["phase"] = "build"
        trainer = build_trainer(args, model_dir)
        if not args.stock:
            result["phase"] = "enable_rapidfire"
            enable_rapidfire(trainer, config=parse_config(args.config))
            rf = getattr(trainer, STATE_ATTR)
            result["installed"], result["skipped"] = list(rf.installed), list(rf.skipped)
        result["phase"] = "train"
        t0 = time.perf_counter()
        trainer.train()
        result["train_seconds"] = time.perf_counter() - t0
        result["phase"] = "collect"
        support = describe_engine(trainer.accelerator, log=False)
        result["engine"] = support.to_dict()
        result["world_size"] = trainer.accelerator.num_processes
        history = trainer.state.log_history
        result["losses"] = [h["loss"] for h in history if "loss" in h]
        result["grad_norms"] = [h.get("grad_norm") for h in history if "loss" in h]
        result["rapidfire_logged"] = sorted({k for h in history for k in h if k.startswith("rapidfire/")})
        result["global_step"] = trainer.state.global_step
        opt = find_rapidfire_optimizer(trainer.optimizer)
        result["optimizer"] = type(opt if opt is not None else trainer.optimizer).__name__
        result["optimizer_stats"] = (
            {k: v for k, v in opt.stats().items() if isinstance(v, (int, float, dict, type(None)))}
            if opt is not None
            else {}
        )
        result["local_params_finite"] = local_parameters_finite(trainer.model)
        params = full_parameters(trainer)
        result["params_numel"] = params.numel()
        result["params_finite"] = bool(torch.isfinite(params).all()) if params.numel() else None
        result["losses_finite"] = bool(result["losses"]) and all(math.isfinite(x) for x in result["losses"])
        result["status"], result["phase"] = "ok", "done"
        torch.save({**result, "params": params}, args.out / f"sft_rank{rank()}.pt")
        trainer.accelerator.wait_for_everyone()
    except Exception as err:  # recorded, so the GPU run says what broke under which engine
        result["error"] = f"{type(err).__name__}: {err}"[:1500]
        result["traceback"] = traceback_tail()
        torch.save(
            {**result, "params": torch.empty(0, dtype=torch.float64)}, args.out / f"sft_rank{rank()}.pt"
        )
    return result


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--batch", type=int, default=4, help="per-device batch")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument(
        "--config",
        default=None,
        help="rapidfire config: preset name, YAML path or JSON dict (default balanced)",
    )
    parser.add_argument("--stock", action="store_true", help="no enable_rapidfire (the stock trainer)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pid_rank{rank()}").write_text(str(os.getpid()))  # a driver ends leftover ranks by pid
    result = run(args)
    if result["rank"] == 0:
        (args.out / "sft.json").write_text(json.dumps(result, indent=1, default=str))
    print(
        json.dumps({k: result.get(k) for k in ("rank", "status", "phase", "world_size", "losses", "error")})
    )
    if result["status"] != "ok":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
