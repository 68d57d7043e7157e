"""One configuration of benchmarks/ppo_vs_trl: `python worker.py '<json config>' <result.json>`.

For system "trl" the caller puts trl 1.12.0 first on PYTHONPATH. Both systems get the same models
(random init, bf16, on the GPU), the same prompts, the same reward module and the same PPO settings;
each trainer keeps its own defaults otherwise (stock TRL: gradient checkpointing on, as it ships).

Part "size7b" builds the models directly in bf16 on the GPU (no fp32 copy first) and only those the
configuration uses: no reference copy with LoRA (both trainers then use the adapter-disabled base) and
no value model with the fused value head. A failure (OOM included) is written as a row with its status,
the peak memory so far and the error, so the runner records it instead of stopping.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from types import SimpleNamespace

import torch
from torch import nn
from transformers import TrainerCallback

TARGET_MOD = 16  # default: a response token scores when id % 16 == 0, 1/16 of the vocabulary


class RuleRewardBackbone(nn.Module):
    """Per-position "hidden state" = share of target tokens among the response tokens so far."""

    def __init__(self, prompt_len: int, response_len: int, target_mod: int = TARGET_MOD):
        super().__init__()
        self.prompt_len, self.response_len, self.target_mod = prompt_len, response_len, target_mod
        self.register_buffer("anchor", torch.zeros(1), persistent=False)  # gives the module a device
        self.seen: list[dict] = []
        self.record = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        mask = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones_like(input_ids, dtype=torch.bool)
        )
        in_response = torch.arange(input_ids.shape[1], device=input_ids.device) >= self.prompt_len
        hits = ((input_ids % self.target_mod) == 0) & (input_ids >= 4) & mask & in_response  # no specials
        hidden = (hits.float().cumsum(1) / self.response_len).unsqueeze(-1)
        if self.record:  # the learning part only (host syncs)
            self.observe(input_ids[:, self.prompt_len :])
        return SimpleNamespace(hidden_states=(hidden,), last_hidden_state=hidden)

    @torch.no_grad()
    def observe(self, responses: torch.Tensor) -> None:
        """Instrumentation only (the output above does not depend on it): what each scored batch looked like,
        the same for both trainers since both score the (post-processed) responses through this forward."""
        pad = responses == 0
        ends = torch.where(pad, torch.arange(pad.shape[1], device=pad.device), pad.shape[1]).min(-1).values
        self.seen.append(
            {
                "response_length": ends.float().mean().item(),  # tokens before the first pad
                "pad_rows": pad.any(-1).float().mean().item(),  # rows that sampled the pad id somewhere
                "pad_first": pad[:, 0].float().mean().item(),  # rows that sampled it first (empty response)
            }
        )


class RuleReward(nn.Module):
    """A reward "model" with the interface both trainers use: `getattr(m, m.base_model_prefix)` + `m.score`."""

    base_model_prefix = "model"

    def __init__(self, prompt_len: int, response_len: int, target_mod: int = TARGET_MOD):
        super().__init__()
        self.model = RuleRewardBackbone(prompt_len, response_len, target_mod)
        self.score = nn.Identity()


def build_tokenizer(vocab_size: int):
    from tokenizers import pre_tokenizers

    from rapidfire_hf.demo.task import wordlevel_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    return wordlevel_tokenizer(vocab, pre_tokenizers.WhitespaceSplit())


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_dtype(cfg: dict, device: str) -> torch.dtype:
    """The models' weight dtype: cfg["dtype"] ("bf16"/"fp32", the learning part's `--learn-dtype`), else bf16 on
    the GPU and fp32 on the CPU. bf16 weights also turn on bf16 mixed precision in both trainers (`bf16=True`),
    as the GPU runs do; so a CPU run with dtype "bf16" repeats the GPU's numerics (not its kernels)."""
    if cfg.get("dtype") not in (None, "auto"):
        return DTYPES[cfg["dtype"]]
    return torch.bfloat16 if device == "cuda" else torch.float32


def build_models(cfg: dict, device: str):
    """policy, ref, value, reward; in part "size7b", ref/value are None where the config does not use them."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo.shapes import llama_config

    dtype = model_dtype(cfg, device)
    if "family" in cfg["shape_kwargs"]:
        return build_family_models(cfg, device, dtype)
    conf = llama_config(cfg["shape_kwargs"], cfg["prompt_len"] + cfg["response_len"] + 8)
    # the model init; the learning part runs several seeds; a sweep's trials all start from one base
    torch.manual_seed(0 if cfg["part"] == "sweep" else cfg.get("seed", 0))
    if cfg["part"] in ("size7b", "sweep"):
        with torch.device(device):  # straight into the target dtype on the device: no fp32 7B copy
            policy = LlamaForCausalLM._from_config(conf, dtype=dtype)
            ref = None
            if not cfg.get("peft"):
                ref = LlamaForCausalLM._from_config(conf, dtype=dtype)
                ref.load_state_dict(policy.state_dict())
            value = None
            if cfg["value_mode"] != "fused":
                value = LlamaForSequenceClassification._from_config(conf, dtype=dtype)
            if cfg.get("reward") == "model":  # a reward model of the policy's shape, one label
                reward = LlamaForSequenceClassification._from_config(conf, dtype=dtype)
                reward.requires_grad_(False)
                return policy, ref, value, reward
        reward = RuleReward(cfg["prompt_len"], cfg["response_len"], cfg.get("target_mod", TARGET_MOD)).to(
            device
        )
        return policy, ref, value, reward
    with torch.device(device):
        policy = LlamaForCausalLM(conf).to(dtype)
        ref = LlamaForCausalLM(conf).to(dtype)
        ref.load_state_dict(policy.state_dict())
        value = LlamaForSequenceClassification(conf).to(dtype)
    reward = RuleReward(cfg["prompt_len"], cfg["response_len"], cfg.get("target_mod", TARGET_MOD)).to(device)
    reward.model.record = cfg["part"] == "learning"
    return policy, ref, value, reward


def build_family_models(cfg: dict, device: str, dtype: torch.dtype):
    """policy, ref, value, reward of another decoder family (``--shape`` one of
    ``rapidfire_hf.demo.shapes.FAMILY_SHAPES``): the family's causal LM as policy and reference, its
    sequence-classification model (one label) as the value model, the rule reward; random init on the device."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rapidfire_hf.demo.shapes import family_config

    shape = cfg["shape_kwargs"]
    conf = family_config(shape["family"], cfg["prompt_len"] + cfg["response_len"] + 8, **shape.get("overrides", {}))
    torch.manual_seed(cfg.get("seed", 0))
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        ref = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        ref.load_state_dict(policy.state_dict())
        value = AutoModelForSequenceClassification.from_config(conf, dtype=dtype)
    reward = RuleReward(cfg["prompt_len"], cfg["response_len"], cfg.get("target_mod", TARGET_MOD)).to(device)
    return policy, ref, value, reward


def dataset(cfg: dict, n: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, cfg["shape_kwargs"]["vocab_size"], (n, cfg["prompt_len"]), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def peft_config(cfg: dict):
    """The LoRA config of the policy (the same for both trainers), or None for full fine-tuning."""
    if not cfg.get("peft"):
        return None
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", bias="none", **cfg["lora"])


def count_trainable(module) -> int:
    seen, n = set(), 0
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def build_inputs(cfg: dict, device: str):
    """Tokenizer, the four models (built and timed: ``build_s``) and the prompt dataset of one run."""
    tok = build_tokenizer(cfg["shape_kwargs"]["vocab_size"])
    _sync()
    t0 = time.perf_counter()
    models = build_models(cfg, device)
    _sync()
    return tok, models, time.perf_counter() - t0, dataset(cfg, cfg["batch"] * cfg["updates"])


def common_args(cfg: dict, device: str) -> dict:
    learning = cfg["part"] == "learning"
    # the learning part's PPO settings, the same for both trainers (TRL 1.12's defaults where not given)
    # max_grad_norm: TRL 1.12's PPO never clips gradients (its train loop calls optimizer.step() without
    # clip_grad_norm_, whatever args.max_grad_norm says); ours clips at it unless it is 0, and
    # TrainingArguments defaults it to 1.0. The learning part turns clipping off (0) so both run the same
    # update; `--learn-max-grad-norm` sets it (it reaches ours only: TRL ignores it).
    learn = dict(kl_coef=cfg.get("kl_coef", 0.05), max_grad_norm=cfg.get("max_grad_norm", 0.0))
    return dict(
        output_dir=f"/tmp/ppo_bench_{cfg['name']}",
        per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["batch"] // cfg["micro"],
        num_ppo_epochs=4 if learning else 1,
        num_mini_batches=1,  # one optimizer step per PPO epoch in both (TRL 1.12 steps once per
        # gradient_accumulation_steps micro-batches, whatever num_mini_batches says; ours once per mini-batch)
        **(learn if learning else {}),
        **({"kl_coef": cfg["kl_coef"]} if cfg["part"] == "sweep" and "kl_coef" in cfg else {}),
        total_episodes=cfg["batch"] * cfg["updates"],
        response_length=cfg["response_len"],
        # TRL generates and scores in chunks of this many rows; ours scores in them (--ours-score-chunk
        # sets it for ours alone: at rollout batch 4096 one scoring forward over every row held 109 GiB)
        local_rollout_forward_batch_size=cfg.get("score_chunk") or cfg["batch"],
        bf16=model_dtype(cfg, device) == torch.bfloat16,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        learning_rate=cfg.get("lr", 2e-5 if learning else 3e-6),  # benchmarks/sweep gives each trial its rate
        temperature=cfg.get("temperature", 1.0) if learning else 0.7,
        seed=cfg.get("seed", 0),
        use_cpu=device == "cpu",
    )


# per-update statistics both trainers log under the same names (the learning part records them side by side)
STAT_KEYS = (
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "policy/entropy_avg",
    "val/ratio",
    "lr",
)


def learning_stats(logs: list[dict], reward) -> dict:
    """Per-update lists of STAT_KEYS from a trainer's logs, plus what the reward "model" saw."""
    stats = {k: [h[k] for h in logs if k in h] for k in STAT_KEYS}
    for k in ("response_length", "pad_rows", "pad_first"):
        stats[k] = [x[k] for x in reward.model.seen]
    return stats


def optimizer_settings(optimizer, scheduler, max_grad_norm_applied) -> dict:
    """What the optimizer really runs with (printed and stored: the like-for-like check of the comparison)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    group = inner.param_groups[0]
    keep = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "foreach", "fused", "maximize")
    out = {k: group[k] for k in keep if k in group}
    out.update(
        optimizer=type(inner).__name__,
        param_groups=len(inner.param_groups),
        scheduler=type(scheduler).__name__,
        scheduler_lambdas=[getattr(f, "func", f).__name__ for f in getattr(scheduler, "lr_lambdas", [])],
        max_grad_norm_applied=max_grad_norm_applied,
    )
    print("optimizer settings:", json.dumps(out, default=str), flush=True)
    return out


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_trl(cfg: dict, device: str) -> dict:
    import trl
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as stock

    assert trl.__version__.startswith("1.12"), f"expected trl 1.12 on PYTHONPATH, got {trl.__version__}"
    gen_times, stamps, rewards, history = [], [], [], []
    original = stock.batch_generation

    def timed_generation(*a, **k):  # instrumentation only: the call and its result are unchanged
        _sync()
        t = time.perf_counter()
        out = original(*a, **k)
        _sync()
        gen_times.append(time.perf_counter() - t)
        return out

    stock.batch_generation = timed_generation

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _sync()
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "objective/scores" in logs:
                rewards.append(logs["objective/scores"])
                history.append(dict(logs))

    tok, (policy, ref, value, reward), build_s, ds = build_inputs(cfg, device)
    args = PPOConfig(
        **{k: v for k, v in common_args(cfg, device).items() if k != "use_cpu"},
        num_sample_generations=0,
        use_cpu=device == "cpu",
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=ds,
        eval_dataset=ds.select(range(2)),
        callbacks=[Clock()],
        **({"peft_config": peft_config(cfg)} if cfg.get("peft") else {}),
    )
    del policy, ref, value
    trainable = count_trainable(trainer.model)
    _sync()
    stamps.append(time.perf_counter())
    trainer.train()
    extra = {}
    if cfg["part"] == "learning":  # TRL 1.12's loop has no clip_grad_norm_ call: nothing applied
        extra["optimizer_settings"] = optimizer_settings(trainer.optimizer, trainer.lr_scheduler, None)
        extra["stats"] = learning_stats(history, reward)
    return {
        **extra,
        "update_times": [b - a for a, b in zip(stamps, stamps[1:])],
        "gen_times": gen_times,
        "rewards": rewards,
        "trl_version": trl.__version__,
        "trainable_params": trainable,
        "build_s": build_s,
        "kl_coef_applied": trainer.args.kl_coef,
    }


# run.py --ours-decode-kernels: the PPOConfig fields of each decode-step option
DECODE_KERNELS = {
    "fuse": {"rollout_decode_fuse_projections": True},
    "nofuse": {"rollout_decode_fuse_projections": False},  # the module projections (the default until 12-04)
    "triton": {"rollout_decode_attention": "triton", "rollout_decode_sampler": "triton"},
    "skinny": {"rollout_decode_fuse_projections": True, "rollout_decode_linear": "triton"},
    "tattn": {"rollout_decode_attention": "triton"},  # the flash-decoding kernel alone
    "sdpa": {"rollout_decode_attention": "sdpa"},  # SDPA named explicitly (whatever the default is)
    "freecache": {"rollout_cache": "auto"},  # not a kernel: the plan may free the KV cache after generation
    "keepcache": {"rollout_cache": "keep"},  # the KV cache kept between updates (the default until 12-04)
    "fuselora": {"rollout_decode_fuse_lora": True},  # LoRA layers in the fused decode projections (opt-in)
}
# options of the same "+"-list that are not PPOConfig fields but the memory callback's release between
# scoring and training, set on the built trainer (a run without a rapidfire config has no other way to it):
# "alwaysrelease" is the default until 12-04 (every update), "pressurerelease" the one since
MEMORY_RELEASE = {"alwaysrelease": "always", "pressurerelease": "pressure"}


def decode_options(cfg: dict) -> list[str]:
    """The row's "+"-separated options (``DECODE_KERNELS`` and ``MEMORY_RELEASE`` names)."""
    return [o for o in (cfg.get("decode_kernels") or "").split("+") if o]


def speedup_args(cfg: dict) -> dict:
    """PPOConfig switches of a speed-up variant (run.py --ours-*); none for a row without them, so the
    baseline runs exactly as before."""
    out = {}
    if cfg.get("rollout_decode_mode", "auto") != "auto":
        out["rollout_decode_mode"] = cfg["rollout_decode_mode"]
    if cfg.get("rollout_generation_batch_size"):
        out["rollout_generation_batch_size"] = cfg["rollout_generation_batch_size"]
    if cfg.get("host_offload"):
        out["host_offload"] = cfg["host_offload"]
    if cfg.get("rollout_kv_cache_dtype"):
        out["rollout_kv_cache_dtype"] = cfg["rollout_kv_cache_dtype"]
    for kernel in decode_options(cfg):
        if kernel not in MEMORY_RELEASE:
            out.update(DECODE_KERNELS[kernel])
    if cfg.get("liger"):
        out["use_liger_kernel"] = True
    if cfg.get("compile"):
        out["torch_compile"] = True
        for key in ("compile_backend", "compile_mode"):
            if cfg.get(key):
                out[f"torch_{key}"] = cfg[key]
    return out


def our_optimizer(cfg: dict):
    """The optimizer a user passes for ``cfg["optimizer"]`` (None: the trainer's default fused AdamW):
    "adamw8bit" is ``RapidFireOptimizer(optimizer="adamw8bit", gradient_pipeline=True)`` (each bucket of
    gradients applied and freed during backward, AdamW state in 8 bits), "adamw8bit_nopipe" the same
    without the pipeline. Built unbound: the trainer binds it to its trainable parameters and PPOConfig's
    learning rate, betas, eps and weight decay."""
    kind = cfg.get("optimizer")
    if kind is None:
        return None
    from rapidfire_hf import RapidFireOptimizer

    return RapidFireOptimizer(optimizer="adamw8bit", gradient_pipeline=kind == "adamw8bit")


def build_ours(cfg: dict, device: str):
    """Our PPOTrainer on the benchmark's models and data (also used by profile_ours.py)."""
    from rapidfire_hf import PPOConfig, PPOTrainer

    tok, (policy, ref, value, reward), build_s, ds = build_inputs(cfg, device)
    fused = cfg["value_mode"] == "fused"
    args = PPOConfig(
        **common_args(cfg, device),
        value_mode=cfg["value_mode"],
        disable_tqdm=True,
        rollout_backend=cfg.get("rollout_backend", "auto"),
        **({"rapidfire_config": cfg["rapidfire_config"]} if cfg.get("rapidfire_config") else {}),
        **({"ref_model_quantization": cfg["ref_quant"]} if cfg.get("ref_quant") else {}),
        **({"reward_model_quantization": cfg["reward_quant"]} if cfg.get("reward_quant") else {}),
        **speedup_args(cfg),
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=None if fused else value,
        train_dataset=ds,
        peft_config=peft_config(cfg),
        optimizer=our_optimizer(cfg),
    )
    del policy, ref, value, reward  # the trainer holds what it uses (a quantized copy frees the original)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trainer.remove_progress_callbacks()
    for option in decode_options(cfg):
        if option in MEMORY_RELEASE:
            trainer.memory_callback.release_after_rollout = MEMORY_RELEASE[option]
    trainer.build_s = build_s
    return trainer


def update_series(log_history: list[dict]) -> dict:
    """Per update of our trainer's (or a sweep trial's) log: seconds of the update and its phases, reward."""
    logs = [h for h in log_history if "time/update" in h]
    keys = {"update": "time/update", "gen": "time/rollout", "score": "time/scoring", "train": "time/training"}
    series = {f"{name}_times": [h[key] for h in logs] for name, key in keys.items()}
    return {**series, "rewards": [h["objective/scores"] for h in logs]}


def run_sweep(cfg: dict, device: str) -> dict:
    """``PPOSweep`` with ``cfg["trials"]`` LoRA trials (trial i: kl_coef ``cfg["trial_kl"][i]``, seed i) on
    one base: each round is one update of every trial. Times are trial t0's log (the round is shared)."""
    import rapidfire_hf
    from rapidfire_hf import PPOConfig, PPOSweep

    tok, (policy, _ref, _value, reward), build_s, ds = build_inputs(cfg, device)
    args = PPOConfig(
        **common_args(cfg, device), value_mode="fused", disable_tqdm=True,
        rollout_backend=cfg.get("rollout_backend", "auto"),
    )  # fmt: skip
    trials = {f"t{i}": {"kl_coef": kl, "seed": i} for i, kl in enumerate(cfg["trial_kl"])}
    sweep = PPOSweep(
        args=args, trials=trials, model=policy, processing_class=tok, train_dataset=ds,
        peft_config=peft_config(cfg), reward_model=reward, progress=False,
    )  # fmt: skip
    results = sweep.train()
    return {
        **update_series(results["t0"].log_history),
        "trial_updates": {name: r.global_step for name, r in results.items()},
        "trial_kl_applied": {name: t.args.kl_coef for name, t in sweep.trials.items()},
        "rapidfire_version": rapidfire_hf.__version__,
        "trainable_params": sum(p.numel() for p in sweep.model.parameters() if p.requires_grad),
        "build_s": build_s,
    }


def inner_optimizer_name(optimizer) -> str:
    """The class that updates the weights: under accelerate's wrapper and RapidFireOptimizer, e.g. AdamW8bit."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return type(getattr(opt, "_inner", opt)).__name__


class ProfileUpdate(TrainerCallback):
    """A trainer callback that runs update ``update`` (0-based) under ``torch.profiler`` and keeps its top
    operators by device time (CPU time where there is no GPU), and the update's host time per phase."""

    def __init__(self, update: int, top: int = 30):
        self.update, self.top, self.prof, self.summary = update, top, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.update:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None or self.summary is not None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.start
        self.prof.__exit__(None, None, None)
        self.summary = profile_summary(self.prof.key_averages(), wall, self.top)


def profile_summary(events, wall_s: float, top: int) -> dict:
    """The update's wall time, summed device (or CPU) self time, and the ``top`` operators by it."""
    cuda = torch.cuda.is_available()

    def self_us(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total)

    rows = sorted(events, key=self_us, reverse=True)
    return {
        "wall_ms": wall_s * 1e3,
        "device_self_ms" if cuda else "cpu_self_ms": sum(self_us(e) for e in events) / 1e3,
        "top": [
            {
                "name": e.key,
                "count": e.count,
                "self_ms": self_us(e) / 1e3,
                "cpu_self_ms": e.self_cpu_time_total / 1e3,
            }
            for e in rows[:top]
        ],
    }


class PhasePeaks:
    """Instrumentation only: each update's allocator peak per phase (rollout, scoring, training), by
    resetting the peak before each phase of ``trainer`` and reading it after; ``overall`` keeps the run's
    peak across the resets (what ``peak_gib`` reports). The phases' calls and results are unchanged."""

    PHASES = (("rollout", "rollout"), ("score", "scoring"), ("optimize", "training"))
    # the running maximum of the last instance (read by main() when the run raised, e.g. out of memory)
    last_overall = 0

    def __init__(self, trainer):
        self.gib = {name: [] for _, name in self.PHASES}
        self.overall = 0
        for method, name in self.PHASES:
            setattr(trainer, method, self._wrap(getattr(trainer, method), name))

    def _wrap(self, fn, name):
        def phase(*a, **k):
            self.overall = max(self.overall, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            out = fn(*a, **k)
            peak = torch.cuda.max_memory_allocated()
            self.overall = max(self.overall, peak)
            PhasePeaks.last_overall = self.overall
            self.gib[name].append(peak / 2**30)
            return out

        return phase


def run_ours(cfg: dict, device: str) -> dict:
    import rapidfire_hf

    trainer = build_ours(cfg, device)
    peaks = PhasePeaks(trainer) if device == "cuda" else None
    trainable = trainer.run_state.trainable_parameters
    profiler = ProfileUpdate(cfg["profile_update"]) if cfg.get("profile_update") is not None else None
    if profiler is not None:
        trainer.add_callback(profiler)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "time/update" in h]
    extra = {}
    if cfg["part"] == "learning":
        clip = (
            trainer.args.max_grad_norm
            if trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0
            else None
        )
        extra["optimizer_settings"] = optimizer_settings(trainer.optimizer, trainer.lr_scheduler, clip)
        extra["stats"] = learning_stats(logs, trainer.reward_model)
    return {
        **extra,
        **update_series(logs),
        "rapidfire_version": rapidfire_hf.__version__,
        "rollout_backend": trainer.run_state.rollout_backend,
        "trainable_params": trainable,
        "build_s": trainer.build_s,
        "kl_coef_applied": trainer.args.kl_coef,
        "oom_splits": trainer.run_state.oom_splits,
        # a decode step that failed to compile or record ran one mode down: say so in the row
        "decode_mode_ran": trainer.run_state.decode_mode_ran,
        "decode_fallbacks": list(trainer.run_state.decode_fallbacks),
        "optimizer_class": inner_optimizer_name(trainer.optimizer),
        "ref_class": type(trainer.ref_model).__name__ if trainer.ref_model is not None else None,
        "reward_class": type(trainer.reward_model).__name__,
        "speedups": trainer.kernel_patches.summary(),
        "plan": trainer.plan.to_dict() if trainer.plan is not None else None,
        # the fused decode projections' weight copies the engine holds (0: the module projections ran)
        "fused_copy_bytes": trainer.run_state.fused_copy_bytes,
        "phase_peak_gib": peaks.gib if peaks is not None else None,
        "run_peak_bytes": peaks.overall if peaks is not None else None,
        "profile": profiler.summary if profiler is not None else None,
        # None: not a RapidFireOptimizer; else whether its gradient pipeline ran
        "pipeline": (
            trainer.rapidfire_optimizer.pipeline_enabled if trainer.rapidfire_optimizer is not None else None
        ),
    }


def cap_card(gib: float | None) -> None:
    """A smaller card on a bigger one (``cfg["gpu_cap_gib"]``, e.g. 79.19 for an H100 80 GB on an H200): the
    caching allocator refuses past ``gib`` (``torch.cuda.set_per_process_memory_fraction``), and every plan
    reads the capped size (``rapidfire_hf.utils.device_memory``). Memory only: the bigger card's bandwidth
    and clocks stay, so tokens/s of a capped row is not the smaller card's."""
    if not gib:
        return
    total = torch.cuda.get_device_properties(0).total_memory
    if gib * 2**30 > total:
        raise SystemExit(f"gpu_cap_gib={gib} is more than this card's {total / 2**30:.2f} GiB")
    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / total)


def card_gib() -> dict:
    """The card's size as every plan reads it (capped), and its physical size."""
    from rapidfire_hf.utils.device_memory import device_capacity_bytes

    return {"gpu_total_gib": device_capacity_bytes() / 2**30,
            "gpu_physical_gib": torch.cuda.get_device_properties(0).total_memory / 2**30}  # fmt: skip


def main() -> None:
    cfg, result_path = json.loads(sys.argv[1]), sys.argv[2]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        cap_card(cfg.get("gpu_cap_gib"))
        torch.cuda.reset_peak_memory_stats()
    try:
        run = {"trl": run_trl, "sweep": run_sweep}.get(cfg["system"], run_ours)
        out = run(cfg, device)
    except Exception as e:  # written as a row (OOM included), so the runner records it and goes on
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        # Liger's kernels are Triton kernels: on a CPU (smoke) the trainer refuses them, a skip, not a failure
        skipped = cfg.get("liger") and device != "cuda" and "needs a CUDA GPU" in str(e)
        row = {
            **cfg,
            "status": "skipped" if skipped else ("oom" if oom else "error"),
            "error": f"{type(e).__name__}: {e}"[:600],
            "traceback": traceback.format_exc()[-2500:],
            "peak_gib": (
                max(torch.cuda.max_memory_allocated(), PhasePeaks.last_overall) / 2**30
                if device == "cuda"
                else None
            ),
        }
        if device == "cuda":
            row.update(card_gib())
        row.pop("shape_kwargs", None)
        with open(result_path, "w") as f:
            json.dump(row, f)
        if skipped:
            print(f"skipped: {e}", flush=True)
            return
        traceback.print_exc()
        sys.exit(1)
    k = cfg.get("profile_update")
    if k is not None:  # the profiled update runs slower: kept apart, out of the medians
        for key in ("update_times", "gen_times", "score_times", "train_times"):
            if k < len(out.get(key) or []):
                out.setdefault("profiled_update", {})[key] = out[key].pop(k)
    timed = out["update_times"][1:] or out["update_times"]  # the first update includes warm-up/compilation
    gens = out["gen_times"][1:] or out["gen_times"]
    s = statistics.median(timed)
    # ours: scoring and training time of the timed updates (what the speed-up variants change)
    phases = {
        f"{k}_s": statistics.median(out[f"{k}_times"][1:] or out[f"{k}_times"])
        for k in ("score", "train")
        if out.get(f"{k}_times")
    }
    row = {
        **cfg,
        **out,
        "status": "ok",
        "s_per_update": s,
        "gen_share": statistics.median(gens) / s if gens else None,
        **phases,
        # a PPOSweep round updates every trial: its rows are trials x batch
        "tokens_per_s": cfg["batch"] * cfg.get("trials", 1) * (cfg["prompt_len"] + cfg["response_len"]) / s,
        # the phase instrumentation resets the allocator's peak: its running maximum is the run's
        "peak_gib": (
            max(torch.cuda.max_memory_allocated(), out.get("run_peak_bytes") or 0) / 2**30
            if device == "cuda"
            else None
        ),
        **(card_gib() if device == "cuda" else {}),
        "reward_first": out["rewards"][0] if out["rewards"] else None,
        "reward_last": out["rewards"][-1] if out["rewards"] else None,
        "reward_max": max(out["rewards"]) if out["rewards"] else None,
        "reward_last5": statistics.mean(out["rewards"][-5:]) if out["rewards"] else None,
    }
    row.pop("shape_kwargs", None)
    with open(result_path, "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
