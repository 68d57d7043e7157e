"""The PPOConfig of `rapidfire demo` (and of `rapidfire demo --sweep`'s shared settings) from its flags."""

from __future__ import annotations

from pathlib import Path


def demo_ppo_config(args, out_dir: Path):
    """PPO settings of the demo: ``--batch-size`` prompts per update in micro-batches of at most 16, 4 PPO
    epochs, ``--steps`` updates, ``--response-length`` tokens up to EOS, on the GPU unless ``--cpu``."""
    import torch

    from rapidfire_hf.ppo import PPOConfig

    use_gpu = torch.cuda.is_available() and not args.cpu
    micro = min(args.batch_size, 16)
    return PPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=max(1, args.batch_size // micro),
        num_mini_batches=max(1, args.batch_size // micro),
        num_ppo_epochs=4,
        learning_rate=args.learning_rate,
        max_steps=args.steps,
        response_length=args.response_length,
        temperature=1.0,
        stop_token="eos",
        missing_eos_penalty=0.5,
        kl_coef=0.05,
        logging_steps=1,
        num_sample_generations=0,  # the live table shows progress; samples would interleave with it
        report_to=[],
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=not use_gpu,
        bf16=use_gpu and torch.cuda.is_bf16_supported(),
        rapidfire_config=args.config,
    )


def demo_resume_command() -> str:
    """This demo's command line with ``--resume``: what continues it after Ctrl-C or SIGTERM."""
    import shlex
    import sys

    argv = [a for a in sys.argv[1:] if a != "--resume"]
    if "demo" not in argv:  # called from Python, not from the console script
        argv = ["demo", "..."]
    return shlex.join(["rapidfire", *argv, "--resume"])
