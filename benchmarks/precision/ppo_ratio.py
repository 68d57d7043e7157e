"""PPO with bf16 everywhere vs adaptive precision (fp32 log-prob path) vs fp32: ratio and KL over training.

Usage:
    python benchmarks/precision/ppo_ratio.py --out benchmarks/precision/results/h200/ppo_ratio   # one H200
    python benchmarks/precision/ppo_ratio.py --out /tmp/ppo_ratio_smoke --smoke                 # CPU, seconds

One PPO run of ``rapidfire_hf.PPOTrainer`` (a random-init Llama of ``--shape``, a separate value model,
random prompts, a rule reward: the share of response tokens whose id is a multiple of 16), done three
ways with the same seed, prompts, optimizer (torch AdamW, passed explicitly to every mode) and settings:

* ``bf16``: policy, reference and value model stored in bf16, accelerate's bf16 autocast. The rollout
  engine and the training forward both take log-probs from bf16 logits (log_softmax in fp32).
* ``adaptive``: the same bf16 models plus the trainer's ``AdaptivePrecisionPlugin`` (made by the trainer
  from ``rapidfire_config={"precision": {"mode": "adaptive"}}``). The layers its sensitivity pass flags
  (run on an fp32 copy of the initial policy) and the log-prob path (final norm + lm_head,
  ``plugin.set_logprob_path()``) run in fp32 with fp32 outputs, in the rollout, scoring and training
  forwards; the benchmark mirrors that schedule onto the frozen reference model (the trainer does not).
* ``fp32``: everything fp32 (TF32 off): the reference.

Per update, besides the trainer's own metrics, a forward hook on the trainer's policy+value module
compares the log-probs of every training forward with the rollout's log-probs of the same tokens (see
``DEFINITIONS``). Writes ``results.json``, ``results.csv`` and ``ppo_ratio.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from rapidfire_hf import PPOConfig, PPOTrainer
from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config, llama_shape
from rapidfire_hf.precision import AdaptivePrecisionPlugin, Precision, logprob_path
from rapidfire_hf.precision.schedule import set_layer_precision

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: benchmarks.common
from benchmarks.common import environment, write_json  # noqa: E402

MODES = ("bf16", "adaptive", "fp32")
TARGET_MOD = 16  # a response token scores when its id is a multiple of 16 (1/16 of the vocabulary)
SHAPES = {
    **{k: LLAMA_SHAPES[k] for k in ("llama-1.1b", "llama-tiny", "smoke")},
    # 162M parameters with its untied 32000-token head (MHA, unlike the benchmarks' GQA llama-160m)
    "llama-160m": llama_shape(
        "llama-160m", num_hidden_layers=12, num_key_value_heads=12, intermediate_size=3072
    ),
}

# What each per-update column means (also written into results.json).
DEFINITIONS = {
    "notation": (
        "For a response token t: d_t = logp_train(t) - logp_rollout(t), where logp_rollout is the log-prob "
        "the rollout engine recorded while sampling t (the trainer's old log-prob) and logp_train the "
        "log-prob of the same token from a training-mode forward of the trainer (train(), autocast of "
        "the mode, grad enabled), both at temperature --temperature; ratio r_t = exp(d_t). Statistics run "
        "over real response tokens (the trainer's padding mask), as float64 on the device."
    ),
    "first_mb_*": (
        "the first micro-batch of the first PPO epoch of the update (per_device_train_batch_size rows). "
        "No optimizer step has happened yet, so with identical numerics r_t would be exactly 1: "
        "ratio_mean = mean r_t, ratio_std = population std of r_t, ratio_max_dev = max |r_t - 1|."
    ),
    "logprob_gap_*": (
        "the same d_t over every micro-batch before the update's first optimizer step (the whole rollout "
        "batch when num_mini_batches is 1): the gap between rollout and training log-probs on the same "
        "tokens and weights. gap_mean = mean d_t (bias), gap_abs_mean = mean |d_t|, gap_rms = "
        "sqrt(mean d_t^2), gap_max_abs = max |d_t|; window0_ratio_std / window0_ratio_max_dev as above."
    ),
    "last_epoch_ratio_*": (
        "r_t over all micro-batches of the last PPO epoch (after num_ppo_epochs - 1 or more optimizer "
        "steps): how far the policy moved from the rollout policy, plus the numerical gap."
    ),
    "ratio_max_dev_by_epoch": "max |r_t - 1| per PPO epoch (results.json only).",
    "trainer metrics": (
        "from PPOTrainer's log of the update: reward = objective/scores (mean rule reward), kl_ref = "
        "objective/kl (sum over tokens of logp_rollout - logp_reference, mean over rows; at update 1 the "
        "policy equals the reference, so this is the rollout-vs-scoring gap), approx_kl = "
        "policy/approxkl_avg (mean over micro-batches of 0.5 * sum(log-ratio^2) / slots, padding "
        "included, as TRL), clipfrac = policy/clipfrac_avg, ratio_mean_trainer = val/ratio (mean over "
        "micro-batches of the per-micro-batch mean ratio over all slots), ratio_var_trainer = "
        "val/ratio_var (variance of those micro-batch means, not of tokens), entropy = objective/entropy."
    ),
    "probe_aligned": "False when a training forward did not see the rows the probe expected (OOM split).",
}

CSV_KEYS = [
    "mode",
    "update",
    "reward",
    "kl_ref",
    "approx_kl",
    "clipfrac",
    "ratio_mean_trainer",
    "ratio_var_trainer",
    "entropy",
    "first_mb_tokens",
    "first_mb_ratio_mean",
    "first_mb_ratio_std",
    "first_mb_ratio_max_dev",
    "first_mb_gap_abs_mean",
    "window0_tokens",
    "logprob_gap_mean",
    "logprob_gap_abs_mean",
    "logprob_gap_rms",
    "logprob_gap_max_abs",
    "window0_ratio_std",
    "window0_ratio_max_dev",
    "last_epoch_ratio_mean",
    "last_epoch_ratio_std",
    "last_epoch_ratio_max_dev",
    "pg_loss",
    "vf_loss",
    "time_update",
    "time_rollout",
    "time_training",
    "probe_aligned",
]

_TRAINER_KEYS = {
    "reward": "objective/scores",
    "kl_ref": "objective/kl",
    "approx_kl": "policy/approxkl_avg",
    "clipfrac": "policy/clipfrac_avg",
    "ratio_mean_trainer": "val/ratio",
    "ratio_var_trainer": "val/ratio_var",
    "entropy": "objective/entropy",
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "time_update": "time/update",
    "time_rollout": "time/rollout",
    "time_training": "time/training",
}


# ----------------------------------------------------------------------------------------- the probe
def _group_stats(stats: list[list[float]]) -> dict:
    """Token statistics of several micro-batches from their sums (see RatioProbe._stats_of)."""
    n = sum(s[0] for s in stats)
    if n == 0:
        return {}
    mean_rm1 = sum(s[5] for s in stats) / n
    var = max(sum(s[6] for s in stats) / n - mean_rm1**2, 0.0)
    return {
        "tokens": int(n),
        "gap_mean": sum(s[1] for s in stats) / n,
        "gap_abs_mean": sum(s[2] for s in stats) / n,
        "gap_rms": math.sqrt(sum(s[3] for s in stats) / n),
        "gap_max_abs": max(s[4] for s in stats),
        "ratio_mean": 1.0 + mean_rm1,
        "ratio_std": math.sqrt(var),
        "ratio_max_dev": max(s[7] for s in stats),
    }


class RatioProbe(TrainerCallback):
    """Compares each training forward's log-probs with the rollout's, without host syncs until the update ends.

    A forward hook on the trainer's policy+value module sees every training forward; which rows it holds
    follows from the per-epoch row orders the benchmark's trainer passes to ``optimize`` (checked on the
    device against the rows themselves). ``on_optimizer_step`` counts optimizer steps; ``on_step_end``
    (once per update) reads everything back in one transfer and appends a row to ``self.rows``.
    """

    def __init__(self, args: PPOConfig):
        self.micro = args.per_device_train_batch_size
        self.mini = args.local_mini_batch_size
        self.micro_per_step = args.micro_batches_per_step
        self.calls_per_epoch = args.num_mini_batches * args.micro_batches_per_step
        self.epochs = args.num_ppo_epochs
        self.rows: list[dict] = []
        self.exp = None

    def start(self, exp, permutations: list[torch.Tensor]) -> None:
        self.exp, self.perms = exp, permutations
        self.calls, self.steps, self.aligned = 0, 0, True
        self.collected: list[tuple[int, int, torch.Tensor]] = []  # (epoch, steps before, stats)

    def hook(self, module, args, output) -> None:
        if self.exp is None or not torch.is_grad_enabled():
            return  # only the training forwards (scoring runs under no_grad and not through this module)
        query_responses, logprobs = args[0], output[0]
        epoch, rest = divmod(self.calls, self.calls_per_epoch)
        mini, micro = divmod(rest, self.micro_per_step)
        self.calls += 1
        start = mini * self.mini + micro * self.micro
        if epoch >= len(self.perms):
            self.aligned = False
            return
        idx = self.perms[epoch][start : start + self.micro].to(query_responses.device)
        rows = self.exp.rollout.query_responses[idx]
        if query_responses.shape != rows.shape:
            self.aligned = False  # an OOM split: the pieces are not whole micro-batches
            return
        stats = self._stats_of(logprobs, idx, (query_responses != rows).any())
        self.collected.append((epoch, self.steps, stats))

    def _stats_of(self, logprobs: torch.Tensor, idx: torch.Tensor, mismatch: torch.Tensor) -> torch.Tensor:
        adv = self.exp.adv
        real = (~adv.padding_mask[idx]).double()
        d = (logprobs.detach().double() - adv.logprobs[idx].double()) * real
        rm1 = torch.expm1(d)  # ratio - 1 without cancellation; 0 on padding
        return torch.stack(
            [
                real.sum(),
                d.sum(),
                d.abs().sum(),
                d.pow(2).sum(),
                d.abs().max(),
                rm1.sum(),
                rm1.pow(2).sum(),
                rm1.abs().max(),
                mismatch.double(),
            ]
        )

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.exp is not None:
            self.steps += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.exp is None:
            return
        values = torch.stack([s for _, _, s in self.collected]).tolist() if self.collected else []
        tags = [(e, k) for e, k, _ in self.collected]
        aligned = self.aligned and bool(values) and not any(v[8] for v in values)
        first = _group_stats(values[:1])
        window0 = _group_stats([v for v, (_, k) in zip(values, tags) if k == 0])
        last = _group_stats([v for v, (e, _) in zip(values, tags) if e == self.epochs - 1])
        by_epoch = [
            _group_stats([v for v, (e, _) in zip(values, tags) if e == epoch]).get("ratio_max_dev")
            for epoch in range(self.epochs)
        ]
        self.rows.append(
            {
                "update": state.global_step,
                "first_mb_tokens": first.get("tokens"),
                "first_mb_ratio_mean": first.get("ratio_mean"),
                "first_mb_ratio_std": first.get("ratio_std"),
                "first_mb_ratio_max_dev": first.get("ratio_max_dev"),
                "first_mb_gap_abs_mean": first.get("gap_abs_mean"),
                "window0_tokens": window0.get("tokens"),
                "logprob_gap_mean": window0.get("gap_mean"),
                "logprob_gap_abs_mean": window0.get("gap_abs_mean"),
                "logprob_gap_rms": window0.get("gap_rms"),
                "logprob_gap_max_abs": window0.get("gap_max_abs"),
                "window0_ratio_std": window0.get("ratio_std"),
                "window0_ratio_max_dev": window0.get("ratio_max_dev"),
                "last_epoch_ratio_mean": last.get("ratio_mean"),
                "last_epoch_ratio_std": last.get("ratio_std"),
                "last_epoch_ratio_max_dev": last.get("ratio_max_dev"),
                "ratio_max_dev_by_epoch": by_epoch,
                "probe_aligned": aligned,
            }
        )
        self.exp = None


class ProbedPPOTrainer(PPOTrainer):
    """PPOTrainer whose per-epoch row orders are drawn here (seeded), so the probe knows each micro-batch."""

    def __init__(self, *a, probe: RatioProbe, order_seed: int, **kw):
        super().__init__(*a, **kw)
        self.probe = probe
        self._orders = torch.Generator().manual_seed(order_seed)
        self.accelerator.unwrap_model(self.model).register_forward_hook(probe.hook)
        self.add_callback(probe)

    def optimize(self, exp, permutations=None):
        if permutations is None:
            n = self.args.local_batch_size
            permutations = [
                torch.randperm(n, generator=self._orders) for _ in range(self.args.num_ppo_epochs)
            ]
        self.probe.start(exp, permutations)
        return super().optimize(exp, permutations)


# ----------------------------------------------------------------------------------------- the run
def _tokenizer(vocab_size: int):
    from tokenizers import pre_tokenizers

    from rapidfire_hf.demo.task import wordlevel_tokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    return wordlevel_tokenizer(vocab, pre_tokenizers.WhitespaceSplit())


def _models(cfg: dict, device: torch.device):
    """fp32 policy, reference (a copy) and value model, the same for every mode (seeded)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    conf = llama_config(SHAPES[cfg["shape"]], cfg["prompt_len"] + cfg["response_len"] + 8)
    torch.manual_seed(cfg["seed"])
    with torch.device(device):
        policy = LlamaForCausalLM(conf)
        value = LlamaForSequenceClassification(conf)
    ref = copy.deepcopy(policy)
    return policy, ref, value


def _prompts(cfg: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    vocab = SHAPES[cfg["shape"]]["vocab_size"]
    return torch.randint(4, vocab, (cfg["batch"] * cfg["updates"], cfg["prompt_len"]), generator=g)


def _reward(response_len: int):
    def target_share(prompts, completions, completion_ids, **columns):
        return [
            sum(1 for t in ids if t >= 4 and t % TARGET_MOD == 0) / response_len for ids in completion_ids
        ]

    return target_share


def _sensitivity(policy_fp32, prompts: torch.Tensor, cfg: dict, device) -> tuple[list[str], list[dict]]:
    """The plugin's sensitivity pass on an fp32 copy of the initial policy: layers over the threshold.

    Batch: the first prompts of the run followed by uniformly random response tokens (a random-init
    policy samples nearly uniformly); loss: the default causal-LM loss (minus the mean log-prob of the
    tokens, what the policy gradient differentiates).
    """
    model = copy.deepcopy(policy_fp32)
    plugin = AdaptivePrecisionPlugin(
        initial="bf16", fallback=[], sensitivity_threshold=cfg["sensitivity_threshold"]
    ).attach(model=model)
    rows = min(cfg["batch"], 16)
    g = torch.Generator().manual_seed(cfg["seed"] + 2)
    responses = torch.randint(4, SHAPES[cfg["shape"]]["vocab_size"], (rows, cfg["response_len"]), generator=g)
    ids = torch.cat([prompts[:rows], responses], dim=1).to(device)
    plugin.calibrate({"input_ids": ids})
    chosen = sorted(n for n, p in plugin.overrides.items() if p is Precision.FP32)
    table = [dict(vars(r)) for r in plugin.sensitivity.values()]
    del model, plugin
    return chosen, table


def _mirror_schedule(plugin: AdaptivePrecisionPlugin, ref) -> dict[str, str]:
    """Give the frozen reference model the policy's per-layer schedule (its log-probs enter the KL term)."""
    modules = dict(ref.named_modules())
    keep_output = {id(m) for m in logprob_path(ref).values()}
    mirrored = {}
    for name, precision in plugin.overrides.items():
        if not name.startswith("policy.") or name[len("policy.") :] not in modules:
            continue
        module = modules[name[len("policy.") :]]
        target = None if precision is plugin.initial else precision
        set_layer_precision(module, target, cast_back=id(module) not in keep_output)
        mirrored[name[len("policy.") :]] = precision.value
    return mirrored


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a process-wide singleton per precision
    GradientState._reset_state()


def run_mode(mode: str, cfg: dict, device: torch.device) -> dict:
    """Train one mode; returns its per-update rows and what the precision plugin did."""
    import transformers

    _reset_accelerate()
    transformers.set_seed(cfg["seed"])
    policy, ref, value = _models(cfg, device)
    prompts = _prompts(cfg)
    out: dict = {"mode": mode}
    if mode == "adaptive" and cfg["sensitivity"]:
        out["sensitive_layers"], out["sensitivity"] = _sensitivity(policy, prompts, cfg, device)
    low = mode != "fp32"
    if low and cfg["weights"] == "bf16":
        for m in (policy, ref, value):
            m.to(torch.bfloat16)
    from datasets import Dataset

    dataset = Dataset.from_dict({"input_ids": prompts.tolist()})
    with tempfile.TemporaryDirectory() as tmp:
        args = PPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=cfg["micro"],
            gradient_accumulation_steps=cfg["batch"] // cfg["micro"],
            num_ppo_epochs=cfg["ppo_epochs"],
            num_mini_batches=cfg["mini_batches"],
            total_episodes=cfg["batch"] * cfg["updates"],
            response_length=cfg["response_len"],
            local_rollout_forward_batch_size=cfg["batch"],
            learning_rate=cfg["lr"],
            temperature=cfg["temperature"],
            kl_coef=cfg["kl_coef"],
            bf16=low,
            use_cpu=device.type == "cpu",
            rollout_backend=cfg["rollout_backend"],
            rollout_decode_mode=cfg["rollout_decode_mode"],
            # the planner off: the probe reads the user's micro-batches, and the modes must split alike
            rapidfire_config={"precision": {"mode": "adaptive", "initial": "bf16"}, "memory": {"planner": False}}
            if mode == "adaptive"
            else None,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=cfg["seed"],
        )
        optimizer = torch.optim.AdamW(
            [p for m in (policy, value) for p in m.parameters()],
            lr=args.learning_rate,
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
        )
        probe = RatioProbe(args)
        trainer = ProbedPPOTrainer(
            args=args,
            processing_class=_tokenizer(SHAPES[cfg["shape"]]["vocab_size"]),
            model=policy,
            ref_model=ref,
            value_model=value,
            reward_funcs=_reward(cfg["response_len"]),
            train_dataset=dataset,
            optimizer=optimizer,
            probe=probe,
            order_seed=cfg["seed"] + 3,
        )
        trainer.remove_progress_callbacks()
        plugin = trainer.precision_plugin
        if mode == "adaptive":
            if plugin is None:
                raise RuntimeError("PPOTrainer made no precision plugin from precision.mode=adaptive")
            for name in out.get("sensitive_layers", []):
                plugin.set_precision("fp32", f"policy.{name}", reason="sensitivity pass", step=0)
            if cfg["logprob_path"] == "fp32":
                plugin.set_logprob_path("fp32")
            out["reference_schedule"] = _mirror_schedule(plugin, ref)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - t0
        out["rollout_engine"] = trainer.run_state.rollout_backend
    logs = {h["step"]: h for h in trainer.state.log_history if "objective/scores" in h}
    rows = []
    for probe_row in probe.rows:
        log = logs.get(probe_row["update"], {})
        row = {"mode": mode, "update": probe_row["update"]}
        row.update({k: log.get(src) for k, src in _TRAINER_KEYS.items()})
        row.update({k: v for k, v in probe_row.items() if k != "update"})
        rows.append(row)
    out["rows"] = rows
    if plugin is not None:
        stats = plugin.stats()
        out["plugin"] = {
            "layer_precision": stats["layer_precision"],
            "switches": [str(a) for a in plugin.history],
            "actions": stats["actions"],
        }
    out["dtypes"] = {
        "policy_body": str(policy.model.layers[0].mlp.up_proj.weight.dtype),
        "lm_head": str(policy.lm_head.weight.dtype),
        "final_norm": str(policy.model.norm.weight.dtype),
        "reference_lm_head": str(ref.lm_head.weight.dtype),
    }
    out["summary"] = _summary(rows)
    del trainer, policy, ref, value, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _reset_accelerate()
    return out


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summary(rows: list[dict]) -> dict:
    tail = rows[-5:]
    return {
        "updates": len(rows),
        "update1_logprob_gap_abs_mean": rows[0]["logprob_gap_abs_mean"] if rows else None,
        "update1_first_mb_ratio_max_dev": rows[0]["first_mb_ratio_max_dev"] if rows else None,
        "mean_first_mb_ratio_max_dev": _mean(r["first_mb_ratio_max_dev"] for r in rows),
        "mean_first_mb_ratio_std": _mean(r["first_mb_ratio_std"] for r in rows),
        "mean_logprob_gap_abs_mean": _mean(r["logprob_gap_abs_mean"] for r in rows),
        "max_logprob_gap_max_abs": max((r["logprob_gap_max_abs"] or 0.0 for r in rows), default=None),
        "mean_approx_kl": _mean(r["approx_kl"] for r in rows),
        "mean_clipfrac": _mean(r["clipfrac"] for r in rows),
        "reward_first": rows[0]["reward"] if rows else None,
        "reward_last5": _mean(r["reward"] for r in tail),
        "kl_ref_last5": _mean(r["kl_ref"] for r in tail),
        "all_probes_aligned": all(r["probe_aligned"] for r in rows),
    }


# ----------------------------------------------------------------------------------------- outputs
def _environment(device: torch.device) -> dict:
    return environment(device)


def _chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [
        ("first_mb_ratio_max_dev", "max |ratio - 1|, 1st micro-batch (before any step)", True),
        ("logprob_gap_abs_mean", "mean |logp_train - logp_rollout| (before 1st step)", True),
        ("approx_kl", "approx KL (policy/approxkl_avg)", True),
        ("clipfrac", "clip fraction (policy/clipfrac_avg)", False),
        ("kl_ref", "KL to reference (objective/kl)", False),
        ("reward", "reward (objective/scores)", False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    for ax, (key, title, log) in zip(axes.flat, panels):
        for mode, run in results["modes"].items():
            pts = [(r["update"], r[key]) for r in run["rows"] if r.get(key) is not None]
            if log:
                pts = [(u, v) for u, v in pts if v > 0]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=mode)
        ax.set(xlabel="update", title=title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(
        f"PPO ratio and KL by precision: {s['shape']}, {s['prompt_len']}+{s['response_len']} tokens, batch "
        f"{s['batch']}, {s['ppo_epochs']} PPO epochs ({results['env']['gpu'] or 'CPU'})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write(results: dict, out: Path) -> None:
    write_json(out / "results.json", results)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_KEYS, extrasaction="ignore")
        writer.writeheader()
        for run in results["modes"].values():
            writer.writerows(run["rows"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path, help="folder for results.json, results.csv, the chart")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, 3 updates, seconds")
    p.add_argument("--shape", default="llama-160m", choices=SHAPES)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=64, help="prompts per rollout (one update)")
    p.add_argument("--micro", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per PPO epoch")
    p.add_argument("--ppo-epochs", type=int, default=4)
    p.add_argument("--updates", type=int, default=25)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--kl-coef", type=float, default=0.05)
    p.add_argument(
        "--weights",
        default="bf16",
        choices=["bf16", "fp32"],
        help="storage of the bf16/adaptive models: bf16, or fp32 master weights under bf16 autocast (then "
        "the rollout runs in fp32: the trainer generates outside autocast)",
    )
    p.add_argument(
        "--logprob-path",
        default="fp32",
        choices=["fp32", "auto"],
        help="adaptive: fp32 = final norm + lm_head in fp32 always; auto = only what the sensitivity pass picks",
    )
    p.add_argument(
        "--no-sensitivity", dest="sensitivity", action="store_false", help="adaptive: skip the pass"
    )
    p.add_argument("--sensitivity-threshold", type=float, default=0.02)
    p.add_argument("--rollout-backend", default="auto", choices=["auto", "static", "hf"])
    p.add_argument(
        "--rollout-decode-mode",
        default="auto",
        choices=["auto", "compile", "cuda_graph", "eager"],
        help="static engine decode step (PPOConfig.rollout_decode_mode); auto compiles on GPU (~15 s per mode)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.prompt_len, args.response_len = "smoke", 8, 8
        args.batch, args.micro, args.ppo_epochs, args.updates, args.lr = 8, 4, 2, 3, 1e-3
        args.rollout_backend = "static"  # the engine the GPU run uses (eager on CPU)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; allowed {list(MODES)}")
    if args.batch % args.micro:
        p.error("--batch must be a multiple of --micro")
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "modes")}
    cfg["device"] = str(device)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"env": _environment(device), "settings": cfg, "definitions": DEFINITIONS, "modes": {}}
    for mode in modes:
        results["modes"][mode] = run_mode(mode, cfg, device)
        _write(results, args.out)  # after each mode: a later failure keeps the finished ones
        s = {k: (float("nan") if v is None else v) for k, v in results["modes"][mode]["summary"].items()}
        print(
            f"{mode:9s} update-1 gap |d| {s['update1_logprob_gap_abs_mean']:.3e}  "
            f"mean max|r-1| (1st mb) {s['mean_first_mb_ratio_max_dev']:.3e}  "
            f"mean approx_kl {s['mean_approx_kl']:.3e}  clipfrac {s['mean_clipfrac']:.3f}  "
            f"reward {s['reward_first']:.3f} -> {s['reward_last5']:.3f}  "
            f"{results['modes'][mode]['seconds']:.1f}s",
            flush=True,
        )
    _chart(results, args.out / "ppo_ratio.png")
    return results


if __name__ == "__main__":
    main()
