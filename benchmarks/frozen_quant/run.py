"""benchmarks/frozen_quant: PPO's learning curve with the frozen reference and reward models as given, in 8 bits
and in 4 bits (issue 46 item 2: ``ref_model_quantization`` / ``reward_model_quantization``, chosen by
``"auto"`` under ``aggressive`` only, because they change the frozen models' arithmetic).

The three variants are the same run (same seed, same models, same prompts, same PPO settings): a Llama of
``--shape`` (random init), a separate frozen reference (PPOTrainer's copy of the policy), a learned reward
model (a random-init sequence classifier of the policy's shape), a fused value head. Only the frozen models'
precision differs. Per update it records the mean score, the mean KL to the reference, the policy loss, and
the largest |log-prob difference| between the run's reference and the as-given reference on the same tokens
(the current policy's greedy responses to a fixed prompt batch), so the curves show what quantization moves.

    python benchmarks/frozen_quant/run.py --out OUT                       # CPU: smoke shape, fp32
    python benchmarks/frozen_quant/run.py --out $OUT --shape llama-1.1b   # CUDA: bf16

Writes ``OUT/results.json`` (the per-update rows of each variant and a summary), ``OUT/command.txt``,
``OUT/versions.json`` and ``OUT/chart.png``. ``--budget-s`` bounds the whole call: each variant gets a third
of it and stops at an update boundary when its share is spent (``updates_done`` says how many ran).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common.charts import pyplot, save_figure  # noqa: E402
from benchmarks.common.env import environment  # noqa: E402
from benchmarks.common.results import write_json  # noqa: E402
from benchmarks.common.shapes import LLAMA_SHAPES, llama_shape  # noqa: E402

VARIANTS = ("given", "8bit", "4bit")
BITS = {"given": None, "8bit": "8bit", "4bit": "4bit"}
METRICS = {"score": "objective/scores", "kl": "objective/kl", "policy_loss": "loss/policy_avg"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", required=True, help="Folder for results.json, command.txt, versions.json, chart.png."
    )
    p.add_argument(
        "--shape", default="smoke", help="A named Llama shape (smoke on the CPU; llama-1.1b on a GPU)."
    )
    p.add_argument("--updates", type=int, default=40, help="PPO updates per variant.")
    p.add_argument("--batch", type=int, default=16, help="Prompts per rollout batch.")
    p.add_argument("--micro", type=int, default=8, help="per_device_train_batch_size.")
    p.add_argument("--prompt-length", type=int, default=8)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--epochs", type=int, default=4, help="num_ppo_epochs.")
    p.add_argument("--lr", type=float, default=None, help="Learning rate (default 1e-3 on smoke, else 1e-5).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reward-scale",
        type=float,
        default=10.0,
        help="Multiplies the random reward head's weights: its scores then vary enough between responses to "
        "learn from (at init they spread ~0.1).",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="Among given, 8bit, 4bit.")
    p.add_argument("--budget-s", type=float, default=None, help="Seconds for the whole call (a third each).")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if args.lr is None:
        args.lr = 1e-3 if args.shape == "smoke" else 1e-5
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    if args.shape not in LLAMA_SHAPES:
        p.error(f"--shape {args.shape!r}: known {', '.join(LLAMA_SHAPES)}")
    for flag in ("updates", "batch", "micro", "prompt_length", "response_length", "epochs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    for flag in ("lr", "budget_s"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            p.error(f"--{flag.replace('_', '-')} {value}: must be a positive number")
    if args.batch % args.micro:
        p.error(f"--batch {args.batch} is not divisible by --micro {args.micro}")
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        p.error(f"--out {args.out}: cannot make the folder ({err.strerror or err})")
    return args


def build(args, device: str, dtype: torch.dtype):
    """Tokenizer, policy, reward model (seeded: every variant gets the same weights) and the prompts."""
    from datasets import Dataset
    from tokenizers import pre_tokenizers
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo.shapes import llama_config
    from rapidfire_hf.demo.task import wordlevel_tokenizer

    shape = llama_shape(args.shape)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, shape["vocab_size"])})
    tok = wordlevel_tokenizer(vocab, pre_tokenizers.WhitespaceSplit())
    conf = llama_config(shape, args.prompt_length + args.response_length + 8)
    with torch.device(device):
        torch.manual_seed(args.seed)
        policy = LlamaForCausalLM(conf).to(dtype)
        torch.manual_seed(args.seed + 1)
        reward = LlamaForSequenceClassification(conf).to(dtype)
    with torch.no_grad():
        reward.score.weight.mul_(args.reward_scale)
    reward.requires_grad_(False)
    g = torch.Generator().manual_seed(args.seed + 2)
    ids = torch.randint(4, shape["vocab_size"], (args.batch * args.updates, args.prompt_length), generator=g)
    return tok, policy, reward, Dataset.from_dict({"input_ids": ids.tolist()})


def response_logprob_gap(trainer, as_given, queries) -> float:
    """Largest |log-prob difference| of the run's reference against the as-given reference on the current
    policy's greedy responses to ``queries`` (the same tokens for both)."""
    from rapidfire_hf.ppo.modeling import policy_logprobs

    pad, ctx, temp = trainer.pad_token_id, queries.shape[1], trainer.args.temperature
    policy = trainer.policy
    with torch.no_grad():
        out = policy.generate(
            input_ids=queries,
            attention_mask=(queries != pad).long(),
            max_new_tokens=trainer.args.response_length,
            do_sample=False,
            pad_token_id=pad,
        )
        ref = trainer.ref_model if trainer.ref_model is not None else as_given
        a = policy_logprobs(ref, out, pad, ctx, temp).float()
        b = policy_logprobs(as_given, out, pad, ctx, temp).float()
    valid = out[:, ctx:] != pad
    return float(((a - b).abs() * valid).max())


def run_variant(variant: str, args, device: str, dtype: torch.dtype, budget_s: float | None) -> dict:
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    start = time.perf_counter()  # the budget counts the models' building and quantization too
    tok, policy, reward, data = build(args, device, dtype)
    as_given = copy.deepcopy(policy).requires_grad_(False).eval()
    bits = BITS[variant]
    out_dir = tempfile.mkdtemp(prefix=f"frozen_quant_{variant}_")
    config = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.batch // args.micro,
        num_ppo_epochs=args.epochs,
        num_mini_batches=1,
        total_episodes=args.batch * args.updates,
        response_length=args.response_length,
        local_rollout_forward_batch_size=args.batch,
        learning_rate=args.lr,
        bf16=dtype == torch.bfloat16,
        use_cpu=device == "cpu",
        seed=args.seed,
        value_mode="fused",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        num_sample_generations=0,
        ref_model_quantization=bits,
        reward_model_quantization=bits,
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tok,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=data,
    )
    queries = trainer.next_prompts(0)["input_ids"][:8].to(trainer.accelerator.device)
    rows, trained = [], time.perf_counter()

    class Record(TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kw):
            if not logs or METRICS["kl"] not in logs:
                return
            row = {"update": len(rows), "seconds": round(time.perf_counter() - trained, 3)}
            row.update({name: float(logs[key]) for name, key in METRICS.items()})
            row["ref_logprob_max_abs_diff"] = response_logprob_gap(trainer, as_given, queries)
            rows.append(row)
            if budget_s is not None and time.perf_counter() - start > budget_s:
                control.should_training_stop = True

    trainer.add_callback(Record())
    trainer.remove_callback(PrinterCallback)  # the rows are printed once per variant, not every log
    trainer.train()
    return {
        "variant": variant,
        "build_s": round(trained - start, 2),
        "ref_quantized": type(trainer.ref_model.model.layers[0].self_attn.q_proj).__name__,
        "reward_quantized": type(trainer.reward_model.model.layers[0].self_attn.q_proj).__name__,
        "updates_done": len(rows),
        "rows": rows,
    }


def summarize(variants: dict) -> dict:
    """Per variant: KL at update 0, means over the updates every variant ran, and the gap to as given."""
    n = min(len(v["rows"]) for v in variants.values())
    out = {"updates_compared": n}
    given = variants.get("given")
    for name, v in variants.items():
        rows = v["rows"][:n]
        s = {
            "kl_update0": rows[0]["kl"] if rows else None,
            "kl_mean": sum(r["kl"] for r in rows) / max(1, n),
            "score_mean": sum(r["score"] for r in rows) / max(1, n),
            "score_last": rows[-1]["score"] if rows else None,
            "policy_loss_mean": sum(r["policy_loss"] for r in rows) / max(1, n),
            "ref_logprob_max_abs_diff": max((r["ref_logprob_max_abs_diff"] for r in rows), default=None),
        }
        if given is not None and name != "given" and n:
            g = given["rows"][:n]
            s["score_mean_minus_given"] = s["score_mean"] - sum(r["score"] for r in g) / n
        out[name] = s
    return out


def chart(variants: dict, path: Path, title: str) -> Path:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (key, label) in zip(
        axes,
        (("score", "mean score"), ("kl", "KL to the reference"), ("policy_loss", "policy loss"),
         ("ref_logprob_max_abs_diff", "max |ref log-prob - as given|")),
    ):  # fmt: skip
        for name, v in variants.items():
            ax.plot([r["update"] for r in v["rows"]], [r[key] for r in v["rows"]], label=name)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = save_figure(fig, path)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and args.shape != "smoke"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    share = args.budget_s / len(args.variants) if args.budget_s else None
    variants = {}
    for name in args.variants:
        variants[name] = run_variant(name, args, device, dtype, share)
        print(json.dumps({name: variants[name]["rows"][-1] if variants[name]["rows"] else None}), flush=True)
    env = environment(device=device)
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "out"}
        | {"device": device, "dtype": str(dtype)},
        "env": env,
        "summary": summarize(variants),
        "variants": variants,
    }
    write_json(out / "results.json", result)
    (out / "command.txt").write_text(env["command"] + "\n")
    write_json(out / "versions.json", {k: v for k, v in env.items() if k not in ("command", "date")})
    dt = "bf16" if cuda else "fp32"
    chart(
        variants, out / "chart.png", f"PPO, {args.shape} ({dt} as given), frozen reference and reward models"
    )
    print(json.dumps(result["summary"], indent=1), flush=True)
    return result


if __name__ == "__main__":
    main()
