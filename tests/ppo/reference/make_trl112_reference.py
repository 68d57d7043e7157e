"""Produce the PPO reference data of the parity tests by running stock TRL 1.12.0 PPO.

TRL removed ``trl.experimental.ppo`` after 1.12.0; ``rapidfire_hf.PPOTrainer`` keeps its math. This script
installs ``trl==1.12.0`` (no dependencies) into ``<repo>/.trl112`` (git-ignored; reused when present) and
runs, in a subprocess whose ``PYTHONPATH`` starts with that folder, stock
``trl.experimental.ppo.PPOTrainer`` for ONE update per configuration of ``CONFIGS``, on CPU in fp32, on
tiny models built with ``rapidfire_hf.demo``. It only *records*: TRL's module-level helpers that
``PPOTrainer.train`` calls by global name (``batch_generation``, ``selective_log_softmax``, ``forward``,
``get_reward``, ``truncate_response``, ``masked_whiten``) and ``np.random.permutation`` are wrapped by
functions that store a detached copy of their inputs/outputs and return the original result unchanged;
an optimizer step hook counts optimizer steps; a callback stores the logged metrics. Nothing in TRL's
math is replaced.

Compatibility: trl 1.12.0's PPOTrainer runs unchanged with transformers 5.24 / accelerate 1.15 / torch 2.13
(CPU), so no shim is applied (only FutureWarnings about `gradient_checkpointing` and `generation_config`).
A rerun reproduces the committed data bit for bit (``--check``). Runs take ~1 minute on 2 CPU cores.

Output (committed): ``trl112_ppo_reference.pt`` (tensors, loaded with ``torch.load(weights_only=True)``)
and ``trl112_ppo_reference.json`` (versions, command, date, configurations, logged metrics).

Usage::

    python tests/ppo/reference/make_trl112_reference.py           # writes next to this file
    python tests/ppo/reference/make_trl112_reference.py --check    # rerun and compare with the committed data
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TRL_DIR = REPO / ".trl112"
TRL_VERSION = "1.12.0"
OUT_PT = HERE / "trl112_ppo_reference.pt"
OUT_JSON = HERE / "trl112_ppo_reference.json"

# The tiny setup (shared by every run). ``initializer_range`` 0.2 (not Llama's 0.02) makes the random
# policy's next-token distributions far from uniform, so log-probs, ratios and clipping are not all
# trivially ~0 (see _tiny_models for the EOS boost and the noisy reference policy).
MODEL = dict(hidden=32, layers=2, heads=4, kv_heads=2, initializer_range=0.2)
SEEDS = dict(policy=0, value=1, reward=2, ref=3)
EOS_BOOST = 4.0
REF_NOISE = 0.05
NUM_PROMPTS = 64  # > one rollout batch, so accelerate's end-of-dataloader sync never triggers

# TRL 1.12 PPOConfig fields shared by every run; one update (total_episodes == batch size).
COMMON = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    total_episodes=8,
    response_length=8,
    stop_token="eos",
    missing_eos_penalty=1.0,
    temperature=0.7,
    kl_coef=0.05,
    cliprange=0.2,
    cliprange_value=0.2,
    vf_coef=0.1,
    gamma=1.0,
    lam=0.95,
    learning_rate=1e-3,
    optim="adamw_torch",
    lr_scheduler_type="linear",
    warmup_steps=0,
    weight_decay=0.0,
    seed=42,
    bf16=False,
    fp16=False,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    logging_steps=1,
    disable_tqdm=True,
    num_sample_generations=0,
)

# name -> overrides of COMMON. TRL steps the optimizer every `gradient_accumulation_steps` micro-batches
# whatever `num_mini_batches` is, so "k3_mb2" records one optimizer step per epoch across two mini-batches.
CONFIGS = {
    "k1": dict(kl_estimator="k1", num_ppo_epochs=1, num_mini_batches=1),
    "k3": dict(kl_estimator="k3", num_ppo_epochs=1, num_mini_batches=1),
    "k1_epochs2": dict(kl_estimator="k1", num_ppo_epochs=2, num_mini_batches=1),
    "k1_whiten": dict(kl_estimator="k1", num_ppo_epochs=1, num_mini_batches=1, whiten_rewards=True),
    "k3_epochs2_mb2": dict(kl_estimator="k3", num_ppo_epochs=2, num_mini_batches=2),
}

# Locals of PPOTrainer.train() snapshotted at the first np.random.permutation call of an update, i.e.
# after the rollout, scoring, rewards and advantages and before any gradient step.
TRAIN_LOCALS = [
    "queries",
    "context_length",
    "query_responses",
    "responses",
    "postprocessed_responses",
    "logprobs",
    "ref_logprobs",
    "values",
    "scores",
    "sequence_lengths",
    "contain_eos_token",
    "padding_mask",
    "padding_mask_p1",
    "kl",
    "non_score_reward",
    "rewards",
    "advantages",
    "returns",
]
STAT_LOCALS = [
    "approxkl_stats",
    "pg_clipfrac_stats",
    "pg_loss_stats",
    "vf_loss_stats",
    "vf_clipfrac_stats",
    "entropy_stats",
    "ratio_stats",
]


def ensure_trl112() -> Path:
    """Install trl==1.12.0 without dependencies into REPO/.trl112 unless it is already there."""
    if (TRL_DIR / "trl" / "experimental" / "ppo" / "ppo_trainer.py").exists():
        return TRL_DIR
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--target",
        str(TRL_DIR),
        f"trl=={TRL_VERSION}",
    ]
    subprocess.run(cmd, check=True)
    return TRL_DIR


# --------------------------------------------------------------------------------------------------
# Worker: runs inside the subprocess, where `import trl` is 1.12.0.
# --------------------------------------------------------------------------------------------------


def _tiny_models(tok, prompts):
    import torch

    from rapidfire_hf.demo import build_tiny_llama, build_tiny_value_model

    sizes = {k: MODEL[k] for k in ("hidden", "layers", "heads", "kv_heads")}
    policy = build_tiny_llama(
        tok, **sizes, seed=SEEDS["policy"], initializer_range=MODEL["initializer_range"]
    )
    value = build_tiny_value_model(tok, **sizes, seed=SEEDS["value"])
    reward = build_tiny_value_model(tok, **sizes, seed=SEEDS["reward"])
    # Setup choices, made before TRL sees the models (none of them touches TRL):
    with torch.no_grad():
        # 1. Raise the EOS logit by ~EOS_BOOST on average (along the mean final hidden state of the prompts),
        #    so that some responses stop early and truncation, masks and the missing-EOS penalty all matter.
        x = torch.tensor([ids[:8] for ids in prompts["input_ids"][:16]])
        h = policy.model(x).last_hidden_state.mean((0, 1))
        policy.lm_head.weight[tok.eos_token_id] += EOS_BOOST * h / h.square().sum()
        # 2. The reference policy: the policy with small Gaussian noise, so the KL penalty is not ~0.
        ref = copy.deepcopy(policy)
        gen = torch.Generator().manual_seed(SEEDS["ref"])
        for p in ref.parameters():
            p.add_(REF_NOISE * torch.randn(p.shape, generator=gen))
        # 3. Value and reward heads scaled so that values and scores are O(1).
        value.score.weight.mul_(10.0)
        reward.score.weight.mul_(30.0)
    return policy, ref, value, reward


def _state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _clone(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, tuple | list):
        return type(x)(_clone(v) for v in x)
    return x


class Recorder:
    """Wraps TRL 1.12 PPO helpers with functions that record and return the original result unchanged."""

    def __init__(self, mod, train_code):
        self.mod = mod
        self.train_code = train_code
        self.calls: dict[str, list] = {}
        self.permutations: list = []
        self.train_locals: dict = {}
        self.stats: dict = {}
        self.optimizer_steps: list = []
        self._saved = {}

    def _train_frame(self):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not self.train_code:
            frame = frame.f_back
        if frame is None:
            raise RuntimeError("PPOTrainer.train frame not found on the stack")
        return frame

    def wrap(self, name, record):
        original = getattr(self.mod, name)
        self._saved[name] = original

        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            self.calls.setdefault(name, []).append(record(args, kwargs, out))
            return out

        setattr(self.mod, name, wrapper)

    def install(self):
        import numpy as np

        self.wrap("batch_generation", lambda a, k, out: {"query_responses": _clone(out[0])})
        self.wrap("selective_log_softmax", lambda a, k, out: {"index": _clone(a[1]), "logprobs": _clone(out)})
        self.wrap(
            "forward",
            lambda a, k, out: {
                "query_responses": _clone(a[1]),
                # policy forward returns a ModelOutput; the PolicyAndValueWrapper returns (output, value logits)
                "logits": _clone(out[0].logits if isinstance(out, tuple) else out.logits),
                "value_logits": _clone(out[1]) if isinstance(out, tuple) else None,
            },
        )
        self.wrap(
            "get_reward",
            lambda a, k, out: {
                "query_responses": _clone(a[1]),
                "reward_logits": _clone(out[0]),
                "final_rewards": _clone(out[1]),
                "sequence_lengths": _clone(out[2]),
            },
        )
        self.wrap("truncate_response", lambda a, k, out: {"responses": _clone(a[2]), "out": _clone(out)})
        self.wrap("masked_whiten", lambda a, k, out: {"values": _clone(a[0]), "out": _clone(out)})

        original_perm = np.random.permutation
        self._saved["np.random.permutation"] = original_perm

        def permutation(*args, **kwargs):
            out = original_perm(*args, **kwargs)
            if not self.permutations:  # first PPO epoch: everything up to the advantages is computed
                f_locals = self._train_frame().f_locals
                self.train_locals = {n: _clone(f_locals[n]) for n in TRAIN_LOCALS}
            self.permutations.append(out.copy())
            return out

        np.random.permutation = permutation

    def uninstall(self):
        import numpy as np

        for name, fn in self._saved.items():
            if name == "np.random.permutation":
                np.random.permutation = fn
            else:
                setattr(self.mod, name, fn)

    def snapshot_stats(self):
        """Called from on_log: the per-(epoch, mini-batch, micro-batch) statistics TRL averages for its log."""
        f_locals = self._train_frame().f_locals
        self.stats = {n: _clone(f_locals[n]) for n in STAT_LOCALS}


def run_one(name: str, overrides: dict, tmp: str) -> dict:
    import numpy as np
    import torch
    import transformers
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_mod
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from rapidfire_hf.demo import build_char_tokenizer, make_prompt_dataset

    assert trl.__version__ == TRL_VERSION, (
        f"expected trl {TRL_VERSION}, imported {trl.__version__} from {trl.__file__}"
    )
    transformers.set_seed(COMMON["seed"])  # also seeds numpy's global RNG, which TRL's permutations use

    tok = build_char_tokenizer()
    prompts = make_prompt_dataset(NUM_PROMPTS, seed=0)
    dataset = prompts.map(lambda r: {"input_ids": tok(r["prompt"])["input_ids"]}, remove_columns=["prompt"])
    policy, ref, value, reward = _tiny_models(tok, dataset)
    initial = {"policy": _state(policy), "ref": _state(ref), "value": _state(value), "reward": _state(reward)}

    rec = Recorder(ppo_mod, PPOTrainer.train.__code__)

    class LogRecorder(TrainerCallback):
        logs: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            rec.snapshot_stats()
            LogRecorder.logs.append(dict(logs))

    args = PPOConfig(output_dir=os.path.join(tmp, name), **{**COMMON, **overrides})
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        callbacks=[LogRecorder()],
    )
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    params = {id(p): n for n, p in trainer.model.named_parameters()}

    def pre_step(optimizer, a, k):
        sq = sum(
            float(p.grad.double().pow(2).sum())
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None
        )
        n_grads = sum(p.grad is not None for g in optimizer.param_groups for p in g["params"])
        rec.optimizer_steps.append({"grad_norm": sq**0.5, "params_with_grad": n_grads})

    opt.register_step_pre_hook(pre_step)
    rec.install()
    try:
        trainer.train()
    finally:
        rec.uninstall()

    assert len(LogRecorder.logs) == 1, LogRecorder.logs
    c = rec.calls
    n_train_mb = overrides["num_ppo_epochs"] * COMMON["gradient_accumulation_steps"]
    # selective_log_softmax: [generation logprobs, reference logprobs, one per training micro-batch]
    assert len(c["selective_log_softmax"]) == 2 + n_train_mb
    # forward: [reference model, one per training micro-batch (policy+value wrapper)]
    assert len(c["forward"]) == 1 + n_train_mb
    assert len(c["get_reward"]) == 2  # value model, reward model
    tl = rec.train_locals
    assert torch.equal(c["batch_generation"][0]["query_responses"], tl["query_responses"])
    ctx = tl["context_length"]
    train_forwards = c["forward"][1:]
    record = {
        "config": {**COMMON, **overrides},
        "initial": initial,
        "final": {
            "policy": _state(trainer.model.policy),
            "value": _state(trainer.model.value_model),
        },
        "rollout": {
            k: tl[k]
            for k in (
                "queries",
                "query_responses",
                "responses",
                "postprocessed_responses",
                "sequence_lengths",
                "contain_eos_token",
            )
        },
        "context_length": ctx,
        # raw (unmasked) outputs of the scoring phase, as TRL computed them
        "gen_logprobs": c["selective_log_softmax"][0]["logprobs"],
        "ref_logprobs_raw": c["selective_log_softmax"][1]["logprobs"],
        "values_raw": c["get_reward"][0]["reward_logits"][:, ctx - 1 : -1].squeeze(-1),
        "scores_raw": c["get_reward"][1]["final_rewards"],
        "reward_input": c["get_reward"][1]["query_responses"],
        # after masking / penalty / shaping, as used by the PPO epochs
        "scoring": {
            k: tl[k]
            for k in (
                "logprobs",
                "ref_logprobs",
                "values",
                "scores",
                "padding_mask",
                "padding_mask_p1",
                "kl",
                "non_score_reward",
                "rewards",
                "advantages",
                "returns",
            )
        },
        "advantages_unwhitened": c["masked_whiten"][-1]["values"],
        "permutations": [torch.as_tensor(p) for p in rec.permutations],
        "microbatches": {
            "new_logprobs_raw": [d["logprobs"] for d in c["selective_log_softmax"][2:]],
            "vpred_raw": [d["value_logits"][:, ctx - 1 : -1].squeeze(-1) for d in train_forwards],
            # policy logits of the response positions, before TRL divides them in place by the temperature
            "logits": [d["logits"][:, ctx - 1 : -1] for d in train_forwards],
        },
        "stats": rec.stats,
        "optimizer_steps": rec.optimizer_steps,
        "optimizer": {
            "class": f"{type(opt).__module__}.{type(opt).__name__}",
            "param_groups": [
                {
                    k: v
                    for k, v in g.items()
                    if k != "params" and isinstance(v, int | float | bool | tuple | type(None))
                }
                for g in opt.param_groups
            ],
            "num_params": sum(len(g["params"]) for g in opt.param_groups),
            "param_names": sorted(params.values()),
        },
        "logs": LogRecorder.logs[0],
    }
    np.testing.assert_equal(len(rec.permutations), overrides["num_ppo_epochs"])
    return record


def worker(out_path: str, names: list[str]) -> None:
    import torch

    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            overrides = CONFIGS[name]
            print(f"[trl112 reference] running {name}: {overrides}", flush=True)
            records[name] = run_one(name, overrides, tmp)
    torch.save(records, out_path)


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def _versions(env) -> dict:
    code = (
        "import json, torch, transformers, accelerate, trl, numpy;"
        "print(json.dumps({m.__name__: m.__version__ for m in (torch, transformers, accelerate, trl, numpy)}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _to_json(x):
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_to_json(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    return x


def pack(records: dict) -> dict:
    """Deduplicate the initial state dicts (identical across runs) and cast booleans/ints compactly."""
    import torch

    first = next(iter(records.values()))["initial"]
    for name, r in records.items():
        for role, sd in r["initial"].items():
            for k, v in sd.items():
                if not torch.equal(v, first[role][k]):
                    raise RuntimeError(f"initial {role}.{k} differs in run {name}")
    runs = {}
    for name, r in records.items():
        r = dict(r)
        r.pop("initial")
        runs[name] = r
    return {"initial": first, "runs": runs}


def _flatten(x, prefix="") -> dict:
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _flatten(val, f"{prefix}{key}.").items()}
    if isinstance(x, list | tuple):
        return {k: v for i, val in enumerate(x) for k, v in _flatten(val, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): x}


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--check", action="store_true", help="compare a fresh run with the committed data")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.configs)
        return

    trl_dir = ensure_trl112()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(trl_dir), str(REPO / "src")] + env.get("PYTHONPATH", "").split(os.pathsep)
    )
    env.update(
        CUDA_VISIBLE_DEVICES="",
        TRL_EXPERIMENTAL_SILENCE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
    )
    versions = _versions(env)
    if versions["trl"] != TRL_VERSION:
        raise RuntimeError(f"the subprocess imports trl {versions['trl']}, expected {TRL_VERSION}")

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "records.pt")
        subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--worker", raw, "--configs", *args.configs],
            env=env,
            check=True,
        )
        data = pack(torch.load(raw, weights_only=False))

    if args.check:
        old, new = _flatten(torch.load(OUT_PT, weights_only=True)), _flatten(data)
        for flat in (old, new):  # episodes per second: wall-clock time, not math
            for k in [k for k in flat if k.endswith(".logs.eps")]:
                del flat[k]
        bad = sorted(set(old) ^ set(new)) + [
            k for k in sorted(set(old) & set(new)) if not _same(old[k], new[k])
        ]
        print(
            "identical to the committed reference"
            if not bad
            else f"differs at {len(bad)} entries: {bad[:10]}"
        )
        sys.exit(1 if bad else 0)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(data, args.out_dir / OUT_PT.name)
    meta = {
        "produced_by": "tests/ppo/reference/make_trl112_reference.py",
        "command": "python tests/ppo/reference/make_trl112_reference.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": "cpu",
        "dtype": "float32",
        "model": MODEL,
        "seeds": SEEDS,
        "num_prompts": NUM_PROMPTS,
        "configs": {name: {**COMMON, **o} for name, o in CONFIGS.items()},
        "logs": {name: run["logs"] for name, run in data["runs"].items()},
        "optimizer": {name: _to_json(run["optimizer"]) for name, run in data["runs"].items()},
        "optimizer_steps": {name: run["optimizer_steps"] for name, run in data["runs"].items()},
    }
    (args.out_dir / OUT_JSON.name).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    size = (args.out_dir / OUT_PT.name).stat().st_size
    print(f"wrote {args.out_dir / OUT_PT.name} ({size / 1e6:.2f} MB) and {OUT_JSON.name}")


if __name__ == "__main__":
    main()
