"""One part of benchmarks/sweep in its own interpreter: `python worker.py '<json config>' <result.json>`.

Parts ("mode" in the config):

* ``sweep``: one ``PPOSweep`` over every trial of ``cfg["trials"]``, with ``SuccessiveHalving`` when
  ``cfg["halving"]`` is given (rungs, keep), else every trial to the end;
* ``sequential``: the same trials one after another, each with its own ``PPOTrainer`` (fused value head,
  the same LoRA, settings and seed), all in this one process.

The models, prompts, rule reward and shared PPO settings are the ppo_vs_trl suite's (its ``worker.py``), so
a trial here is the same run as a row there. Times are wall-clock stamps taken after each update (the
device synchronised) and measured from the start of ``train()``; the model build and the trainer's
construction are timed apart. The result file is rewritten after every update, so a part stopped by its
timeout still leaves what it measured (``"complete": false``).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()  # before the imports: a part's wall time counts them

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from benchmarks.ppo_vs_trl.worker import build_inputs, common_args, peft_config  # noqa: E402


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


class Recorder:
    """Collects what one part measured and rewrites the result file after every update."""

    def __init__(self, cfg: dict, path: str, device: str):
        self.path, self.device = Path(path), device
        self.data = {"mode": cfg["mode"], "name": cfg["name"], "complete": False, "device": device}
        self.data["import_s"] = time.perf_counter() - T_START

    def write(self) -> None:
        self.data["peak_gib"] = _peak_gib(self.device)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)


def ppo_args(cfg: dict, device: str, output_dir: str, **overrides):
    """The shared PPOConfig of every trial (the ppo_vs_trl suite's settings, fused value head)."""
    from rapidfire_hf import PPOConfig

    base = common_args(cfg, device)
    base.update(output_dir=output_dir, rollout_backend=cfg["rollout_backend"], **overrides)
    extra = {"rollout_decode_mode": cfg["decode_mode"]} if cfg.get("decode_mode", "auto") != "auto" else {}
    return PPOConfig(**base, value_mode="fused", disable_tqdm=True, **extra)


def run_sweep(cfg: dict, rec: Recorder, device: str) -> None:
    """PPOSweep over every trial, with successive halving when ``cfg["halving"]`` is set. Records per trial
    the reward and the wall time (from ``train()``'s start) after each of its updates."""
    from transformers import TrainerCallback

    from rapidfire_hf.sweep import PPOSweep, SuccessiveHalving

    t0 = _now(device)
    tok, (policy, _ref, _value, reward), build_s, ds = build_inputs(cfg, device)
    out_dir = tempfile.mkdtemp(prefix=f"sweep_bench_{cfg['name']}_")
    trials = {name: dict(o) for name, o in cfg["trials"].items()}
    halving = cfg.get("halving")
    rule = SuccessiveHalving(rungs=tuple(halving["rungs"]), keep=halving["keep"]) if halving else None
    per_trial = {name: {"overrides": trials[name], "steps": [], "t": [], "rewards": []} for name in trials}
    start = {}

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, sweep=None, trial=None, **kw):
            row = per_trial[trial]
            row["steps"].append(state.global_step)
            row["t"].append(time.perf_counter() - start["t"])  # the round synchronised the device
            row["rewards"].append(logs.get("objective/scores"))
            row.setdefault("update_s", []).append(logs.get("time/update"))
            row["status"] = "running"
            rec.write()

    # the sweep's throughput plan (sweep/planning.py) is on by default; "off" is the fixed rule it replaced
    plan = {} if cfg.get("sweep_plan", "on") == "on" else {"rapidfire_config": {"memory": {"planner": False}}}
    sweep = PPOSweep(
        args=ppo_args(cfg, device, out_dir, **plan), trials=trials, model=policy, processing_class=tok,
        train_dataset=ds, peft_config=peft_config(cfg), reward_model=reward, callbacks=[Clock()],
        early_stopping=rule, progress=False, train_rows_per_forward=cfg.get("train_rows_per_forward"),
    )  # fmt: skip
    sweep.bank.decode_routing = cfg.get("decode_routing", "auto")
    del policy, reward
    rec.data.update(build_s=build_s, init_s=_now(device) - t0 - build_s, trials=per_trial, output_dir=out_dir)
    start["t"] = _now(device)
    sweep.train()
    rec.data["train_s"] = _now(device) - start["t"]  # includes the final save of every trial
    made = sweep.planner.plan
    rec.data["plan"] = None if made is None else {
        "train_rows": made.train_rows, "scoring_rows": made.scoring_rows, "planned": made.planned,
        "planned_peak_gib": made.planned_peak_bytes / 2**30, "target_gib": made.target_bytes / 2**30,
        "phase_peak_gib": {k: v / 2**30 for k, v in made.phase_peak_bytes.items()},
    }  # fmt: skip
    summary = json.loads((Path(out_dir) / "summary.json").read_text())  # the sweep's own record
    for name, info in summary["trials"].items():
        per_trial[name].update(status=info["state"], reason=info["reason"], updates=info["updates"])
    rec.data.update(decisions=summary.get("decisions", []), rollout_backend=summary.get("rollout_backend"))
    rec.data["complete"] = True


def run_sequential(cfg: dict, rec: Recorder, device: str) -> None:
    """Each trial with its own PPOTrainer, one after another (a fresh base model of the same init each
    time); ``cfg["updates"]`` updates per trial. Each trial's peak memory is measured on its own."""
    from transformers import TrainerCallback

    from rapidfire_hf import PPOTrainer

    per_trial = {}
    rec.data["trials"] = per_trial
    for name, overrides in cfg["trials"].items():
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = _now(device)
        tok, (policy, _ref, _value, reward), build_s, ds = build_inputs(cfg, device)
        out_dir = tempfile.mkdtemp(prefix=f"sweep_bench_seq_{name}_")
        trainer = PPOTrainer(
            args=ppo_args(cfg, device, out_dir, **overrides), processing_class=tok, model=policy,
            reward_model=reward, train_dataset=ds, peft_config=peft_config(cfg),
        )  # fmt: skip
        trainer.remove_progress_callbacks()
        del policy, reward
        row = {
            "overrides": overrides,
            "steps": [],
            "t": [],
            "rewards": [],
            "update_s": [],
            "status": "running",
        }
        row.update(build_s=build_s, init_s=_now(device) - t0 - build_s)
        per_trial[name] = row
        start = {}

        class Clock(TrainerCallback):
            def on_log(self, args, state, control, logs=None, row=row, start=start, **kw):
                if "objective/scores" not in (logs or {}):
                    return
                row["steps"].append(state.global_step)
                row["t"].append(_now(device) - start["t"])
                row["rewards"].append(logs["objective/scores"])
                row["update_s"].append(logs.get("time/update"))
                rec.write()

        trainer.add_callback(Clock())
        start["t"] = _now(device)
        trainer.train()
        row.update(train_s=_now(device) - start["t"], status="finished", updates=trainer.state.global_step)
        row["kl_coef_applied"], row["seed_applied"] = trainer.args.kl_coef, trainer.args.seed
        row["learning_rate_applied"] = trainer.args.learning_rate
        row["peak_gib"] = _peak_gib(device)
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        rec.write()
    rec.data["complete"] = True


def main() -> None:
    cfg, result_path = json.loads(sys.argv[1]), sys.argv[2]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rec = Recorder(cfg, result_path, device)
    try:
        {"sweep": run_sweep, "sequential": run_sequential}[cfg["mode"]](cfg, rec, device)
    except Exception as e:  # recorded (OOM included); what was measured before it stays
        rec.data["error"] = f"{type(e).__name__}: {e}"[:800]
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        rec.data["status"] = "oom" if oom else "error"
        rec.write()
        raise
    rec.data["status"] = "ok"
    rec.data["wall_s"] = time.perf_counter() - T_START
    rec.write()


if __name__ == "__main__":
    main()
