"""PPO tokens/s and peak memory of rapidfire_hf.PPOTrainer on however many processes it is launched with.

Weak scaling: every rank rolls out and trains the same per-rank batch, so N ranks process N times
the tokens per update; ``tokens/s`` counts prompt + response tokens of all ranks per update second
(the trainer's ``tokens_per_second``). The first update (CUDA graph capture, allocator warm-up) is
reported but left out of the median.

Models have a shape of ``rapidfire_hf.demo.shapes`` (``--shape``, default ``llama-1.1b``), random init,
built directly on the GPU in bf16 (no fp32 copy: a 7B policy is 12.6 GiB per rank while it waits for
``accelerator.prepare``). Under ZeRO-3 and FSDP2 the trainer gathers the weights once per rollout and
scoring phase (``rapidfire_hf.distributed.gathered_for_generation``) and generates with the HF backend.

``--precision`` (what the rows compare): ``auto`` is bf16 weights with accelerate's bf16 mixed precision
on the GPU (autocast; ZeRO-3 and FSDP2 then keep fp32 master weights in their shards, so a sharded run
holds more bytes per parameter than a one-GPU run) and fp32 on the CPU. ``bf16`` is pure bf16 on any
device: weights, the fused value head, gradients and AdamW state all bf16, accelerate's mixed precision
off (``PPOConfig(bf16=False)``), so FSDP2 keeps bf16 shards (its groups need one dtype: the value head is
built in bf16 too) and one GPU and N GPUs run the same numerics. Launch FSDP2 with
``accelerate launch --mixed_precision no`` to match. ``--cpu-fsdp2`` is for the CPU smoke only (see
:func:`fsdp2_on_cpu`).

Every rank writes ``<out stem>.ranks/rank<r>.json``: status (``ok``, ``oom``, ``error``, ``timeout``), the
phase it was in (build, prepare, rollout, score, train), the peak of ``torch.cuda.max_memory_allocated``
per phase and over the run (GiB) and, on failure, the error and the last lines of its traceback. Rank 0
adds ``<out>`` (throughput and the gathered per-rank peaks) when the run finishes. An out-of-memory
error exits with code 0 so that a driver script goes on to the next configuration; ``--deadline S``
writes a ``timeout`` row and exits after S seconds (a rank left waiting in a collective by a rank that
failed). :func:`load_run` merges the files into one row.

Usage:
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml \
        benchmarks/distributed/ppo_throughput.py --out results/tput_2gpu.json
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml \
        benchmarks/distributed/ppo_throughput.py --out r/zero3.json --shape llama-7b --reward rule \
        --optimizer adamw --per-device-batch 2 --accumulation 2 --response-length 64 --updates 2
    accelerate launch --mixed_precision no --config_file accelerate_configs/fsdp2.yaml \
        benchmarks/distributed/ppo_throughput.py --out r/fsdp2_15b.json --shape llama-15b --value-mode fused \
        --precision bf16 --reward rule --optimizer adamw --per-device-batch 2 --accumulation 2 --updates 2
    torchrun --standalone --nproc_per_node 2 benchmarks/distributed/ppo_throughput.py --tiny --out x.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

DEFAULT_SHAPE = "llama-1.1b"  # the 1.1B shape of the README's numbers
TINY_SHAPE = "smoke"  # --tiny: CPU, fp32
TARGET_MOD = 16  # rule reward: a response token scores when its id is a multiple of 16
# a merged row takes the first of these that any rank reports; "running" is what a rank killed without
# warning (SIGKILL: host OOM killer, the launcher's last resort) left, reported as "killed"
STATUSES = ("oom", "error", "timeout", "running", "ok")


class _RuleBackbone(nn.Module):
    """Per position: the share of response tokens so far whose id is a multiple of ``TARGET_MOD``."""

    def __init__(self, prompt_length: int, response_length: int):
        super().__init__()
        self.prompt_length, self.response_length = prompt_length, response_length
        self.register_buffer("anchor", torch.zeros(1), persistent=False)  # so that .to(device) places it

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        mask = (
            attention_mask.bool()
            if attention_mask is not None
            else torch.ones_like(input_ids, dtype=torch.bool)
        )
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hits = (input_ids % TARGET_MOD == 0) & mask & (positions >= self.prompt_length)
        share = hits.float().cumsum(1) / self.response_length
        return SimpleNamespace(last_hidden_state=share.unsqueeze(-1))


class RuleReward(nn.Module):
    """A weightless reward model with the interface PPOTrainer scores through (``base_model_prefix`` +
    ``score``): for the size runs, where a third 7B model would only add its own 12.6 GiB."""

    base_model_prefix = "backbone"

    def __init__(self, prompt_length: int, response_length: int):
        super().__init__()
        self.backbone = _RuleBackbone(prompt_length, response_length)
        self.score = nn.Identity()


def build_models(
    shape: dict,
    device: torch.device,
    dtype: torch.dtype,
    value_mode: str = "separate",
    reward: str = "model",
    max_positions: int = 1024,
    prompt_length: int = 128,
    response_length: int = 128,
    seed: int = 0,
):
    """Policy, value model (``None`` when fused) and reward model, random init, built on ``device`` in
    ``dtype`` directly (``_from_config(dtype=...)``: no full-precision copy on the way)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo.shapes import llama_config

    config = llama_config(shape, max_positions)  # one label: the same config builds value/reward models
    torch.manual_seed(seed)  # same init on every rank (DDP and DeepSpeed also broadcast rank 0's weights)
    with device:
        policy = LlamaForCausalLM._from_config(config, dtype=dtype)
        value = (
            LlamaForSequenceClassification._from_config(config, dtype=dtype)
            if value_mode == "separate"
            else None
        )
        if reward == "model":
            reward_model = LlamaForSequenceClassification._from_config(config, dtype=dtype)
        else:
            reward_model = RuleReward(prompt_length, response_length)
    return policy, value, reward_model


def prompt_dataset(n: int, length: int, vocab: int, seed: int = 0):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)  # no pad/bos/eos inside prompts
    return Dataset.from_dict({"input_ids": ids.tolist()})


def rank_dir(out: Path) -> Path:
    return out.parent / f"{out.stem}.ranks"


def classify(err: BaseException) -> str:
    """``"oom"`` for CUDA out-of-memory errors (also when a library re-raises them as RuntimeError)."""
    text = str(err).lower()
    return "oom" if isinstance(err, torch.OutOfMemoryError) or "out of memory" in text else "error"


def requested_gib(message: str) -> float | None:
    """The allocation an out-of-memory message says failed ("Tried to allocate 1.50 GiB"), in GiB."""
    m = re.search(r"tried to allocate ([\d.]+) (gib|mib|kib|b)", message.lower())
    if not m:
        return None
    return float(m.group(1)) / {"gib": 1, "mib": 1024, "kib": 1024**2, "b": 1024**3}[m.group(2)]


class RankRecorder:
    """This rank's phase, per-phase peak memory and outcome, written to ``<out stem>.ranks/rank<r>.json``."""

    def __init__(self, out: Path, device: torch.device, info: dict):
        self.rank = int(os.environ.get("RANK", 0))
        self.path = rank_dir(out) / f"rank{self.rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        # for the driver: a rank still alive after its launcher was killed is ended by this pid
        (self.path.parent / f"pid{self.rank}").write_text(str(os.getpid()))
        self.device, self.cuda = device, device.type == "cuda"
        self.start = time.perf_counter()
        self.row = {**info, "rank": self.rank, "status": "running", "phase": "setup", "update": 0}
        self.phase_peaks: dict[str, float] = {}
        self.peak = 0.0
        self.written = threading.Lock()
        self.done = False
        self.timer: threading.Timer | None = None

    def _allocated_peak(self) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else 0.0

    @contextmanager
    def phase(self, name: str):
        """Record the peak of ``name`` (its maximum over updates) and of the run so far."""
        self.row["phase"] = name
        if name == "rollout":
            self.row["update"] += 1
        self._dump("running", {})  # what a rank killed without warning (SIGKILL) leaves behind
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        yield
        self._close_phase(name)

    def _close_phase(self, name: str) -> None:
        peak = self._allocated_peak()
        self.phase_peaks[name] = max(self.phase_peaks.get(name, 0.0), peak)
        self.peak = max(self.peak, peak)

    def snapshot(self, key: str) -> None:
        """Memory allocated right now (what stays resident: weights, optimizer state), GiB."""
        if self.cuda:
            self.row[key] = torch.cuda.memory_allocated(self.device) / 2**30

    def write(self, status: str, **extra) -> None:
        """The rank's outcome (once: a later call, e.g. a deadline after the end, changes nothing)."""
        with self.written:
            if self.done:
                return
            self.done = True
            if status != "ok":
                self._close_phase(self.row["phase"])  # the failed phase's peak so far
            self._dump(status, extra)

    def _dump(self, status: str, extra: dict) -> None:
        row = {
            **self.row,
            **extra,
            "status": status,
            "peak_gib": self.peak if self.cuda else None,
            "phase_peak_gib": self.phase_peaks if self.cuda else {},
            "seconds": time.perf_counter() - self.start,
        }
        if self.cuda:
            try:  # a failed CUDA context must not cost the row
                row["gpu_total_gib"] = torch.cuda.mem_get_info(self.device)[1] / 2**30
                row["max_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
            except RuntimeError as err:
                row["cuda_error"] = str(err)[:300]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(row, indent=1, default=str))
        tmp.replace(self.path)  # never a half-written row

    def fail(self, err: BaseException) -> str:
        status = classify(err)
        message = f"{type(err).__name__}: {err}"
        self.write(
            status,
            error=message[:1500],
            requested_gib=requested_gib(message) if status == "oom" else None,
            traceback="\n".join(traceback.format_exc().rstrip().splitlines()[-20:]),
        )
        return status

    def arm_deadline(self, seconds: float | None) -> None:
        """After ``seconds``: write a ``timeout`` row and end the process (exit code 124)."""
        if not seconds:
            return

        def expire():
            self.write("timeout", error=f"deadline of {seconds:.0f}s passed in phase {self.row['phase']!r}")
            os._exit(124)

        self.timer = threading.Timer(seconds, expire)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def phase_trainer(base, recorder: RankRecorder):
    """``base`` (PPOTrainer) with each update's rollout, scoring and training phases recorded."""

    class PhaseRecordingPPOTrainer(base):
        def rollout(self, batch):
            with recorder.phase("rollout"):
                return super().rollout(batch)

        def score(self, rollout):
            with recorder.phase("score"):
                return super().score(rollout)

        def optimize(self, exp, permutations=None):
            with recorder.phase("train"):
                return super().optimize(exp, permutations)

    return PhaseRecordingPPOTrainer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tiny", action="store_true", help=f"CPU smoke: fp32, shape {TINY_SHAPE!r} by default"
    )
    parser.add_argument(
        "--shape", default=None, help=f"a shape of rapidfire_hf.demo.shapes (default {DEFAULT_SHAPE})"
    )
    parser.add_argument("--value-mode", default="separate", choices=["separate", "fused"])
    parser.add_argument(
        "--reward",
        default="model",
        choices=["model", "rule"],
        help="a reward model of the policy's shape, or a weightless rule reward (the size runs)",
    )
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--response-length", type=int, default=128)
    parser.add_argument("--per-device-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--optimizer", default="rapidfire", choices=["rapidfire", "adamw"])
    parser.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "bf16"],
        help="auto: bf16 weights + accelerate bf16 mixed precision on the GPU (fp32 masters under ZeRO-3/"
        "FSDP2), fp32 on the CPU; bf16: pure bf16 weights, value head, gradients and AdamW state everywhere",
    )
    parser.add_argument(
        "--cpu-fsdp2",
        action="store_true",
        help="CPU smoke only: run accelerate's FSDP2 engine on the gloo group (launch with the fsdp2 config)",
    )
    parser.add_argument(
        "--rollout-backend",
        default="auto",
        choices=["auto", "static", "hf"],
        help="PPOConfig.rollout_backend (auto: the compiled engine on one GPU / DDP, hf under ZeRO-3 and FSDP2)",
    )
    parser.add_argument(
        "--max-oom-splits",
        type=int,
        default=None,
        help="PPOConfig.max_oom_splits (default: the trainer's); 0 makes an OOM in training a result row",
    )
    parser.add_argument(
        "--deadline", type=float, default=None, help="seconds before a 'timeout' row and exit"
    )
    args = parser.parse_args(argv)
    args.shape = args.shape or (TINY_SHAPE if args.tiny else DEFAULT_SHAPE)
    if args.cpu_fsdp2 and not args.tiny:
        parser.error("--cpu-fsdp2 is a CPU smoke option: give --tiny as well")
    return args


def precision_of(args, cuda: bool) -> tuple[torch.dtype, str]:
    """The weights' dtype and the row's precision: ``bf16`` (pure), ``bf16-mixed`` (bf16 weights under
    accelerate's bf16 autocast; fp32 masters under ZeRO-3/FSDP2) or ``fp32`` (the CPU smoke)."""
    if args.precision == "bf16":
        return torch.bfloat16, "bf16"
    return (torch.bfloat16, "bf16-mixed") if cuda else (torch.float32, "fp32")


@contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules made inside (PPOTrainer's fused value head) get ``dtype``; the default is restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def fsdp2_on_cpu() -> None:
    """CPU smoke of the FSDP2 path: accelerate builds its FSDP plugin only for process groups of
    accelerators (a gloo group on CPUs is MULTI_CPU and gets DDP), while torch's ``fully_shard`` runs on
    CPUs. Telling accelerate's shared state that the group is multi-GPU makes the trainer's Accelerator
    take the FSDP2 plugin from the launcher's environment (``accelerate launch --config_file
    accelerate_configs/fsdp2.yaml``): sharding, the unsharded rollout and the DTensor optimizer step then
    run as on the GPUs. Call it after ``PPOConfig`` (whose device setup resets that state)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() != "true" or os.environ.get("FSDP_VERSION") != "2":
        raise ValueError(
            "--cpu-fsdp2 needs the FSDP2 launcher environment: accelerate launch --config_file "
            "accelerate_configs/fsdp2.yaml --mixed_precision no ..."
        )
    state = PartialState(cpu=True)
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise ValueError(f"--cpu-fsdp2 needs a multi-process CPU group, got {state.distributed_type}")
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    local = args.per_device_batch * args.accumulation
    info = {
        "model": args.shape,
        "value_mode": args.value_mode,
        "reward": args.reward,
        "optimizer": args.optimizer,
        "precision": precision_of(args, cuda)[1],
        "device_type": device.type,
        "rollout_backend_option": args.rollout_backend,
        "max_oom_splits": args.max_oom_splits,
        "dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}[precision_of(args, cuda)[0]],
        "prompt_length": args.prompt_length,
        "response_length": args.response_length,
        "rollout_batch_per_rank": local,
        "processes": int(os.environ.get("WORLD_SIZE", 1)),
        "launcher": _launcher(),
    }
    recorder = RankRecorder(args.out, device, info)
    recorder.arm_deadline(args.deadline)
    if recorder.rank == 0:
        args.out.unlink(missing_ok=True)
    try:
        result = run(args, device, cuda, local, recorder)
    except Exception as err:  # noqa: BLE001 - every failure becomes a row; OOM is a result, not a crash
        status = recorder.fail(err)
        traceback.print_exc()
        print(
            json.dumps({"rank": recorder.rank, "status": status, "phase": recorder.row["phase"]}), flush=True
        )
        sys.stderr.flush()
        os._exit(0 if status == "oom" else 1)  # not a collective shutdown: a peer may be stuck in one
    recorder.disarm()
    if result is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(json.dumps({k: result[k] for k in ("processes", "tokens_per_second", "seconds_per_update")}))


def run(args, device: torch.device, cuda: bool, local: int, recorder: RankRecorder) -> dict | None:
    from rapidfire_hf.demo.shapes import llama_shape

    shape = llama_shape(args.shape)  # an unknown name fails here, before the heavy imports

    from rapidfire_hf.demo.task import build_char_tokenizer
    from rapidfire_hf.optim import RapidFireOptimizer
    from rapidfire_hf.ppo import PPOConfig, PPOTrainer

    dtype, precision = precision_of(args, cuda)
    with recorder.phase("build"):
        t_build = time.perf_counter()
        policy, value, reward = build_models(
            shape,
            device,
            dtype,
            value_mode=args.value_mode,
            reward=args.reward,
            max_positions=max(1024, args.prompt_length + args.response_length + 8),
            prompt_length=args.prompt_length,
            response_length=args.response_length,
        )
        if cuda:
            torch.cuda.synchronize(device)
        build_s = time.perf_counter() - t_build
    config = PPOConfig(
        output_dir=str(args.out.parent / "tput_run"),
        use_cpu=not cuda,
        bf16=precision == "bf16-mixed",  # pure bf16: accelerate's mixed precision off (no fp32 masters)
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
        value_mode=args.value_mode,
        rollout_backend=args.rollout_backend,
        **({} if args.max_oom_splits is None else {"max_oom_splits": args.max_oom_splits}),
    )
    optimizer = (
        RapidFireOptimizer(lr=1e-6, gradient_pipeline=True, rollback="auto")
        if args.optimizer == "rapidfire"
        else None  # PPOTrainer's own torch AdamW
    )
    if args.cpu_fsdp2:
        fsdp2_on_cpu()
    with (
        recorder.phase("prepare"),
        default_dtype(dtype if precision == "bf16" else torch.get_default_dtype()),
    ):
        trainer = phase_trainer(PPOTrainer, recorder)(
            args=config,
            processing_class=build_char_tokenizer(),
            model=policy,
            ref_model=None,  # a frozen copy of the policy, made by the trainer
            reward_model=reward,
            value_model=value,
            optimizer=optimizer,
            train_dataset=prompt_dataset(local * 8 * 8, args.prompt_length, shape["vocab_size"]),
        )
        del policy, value, reward
    recorder.snapshot("resident_gib_after_prepare")
    support = trainer.engine_support
    recorder.row["engine"] = support.engine.value
    # ZeRO-3 leaves each parameter an empty placeholder: counted at its full size (ds_numel)
    recorder.row["trainable_params"] = trainer.run_state.trainable_parameters
    # what the engine holds: bf16 under --precision bf16 (FSDP2 shards included), fp32 masters otherwise
    recorder.row["param_dtypes"] = list(trainer.run_state.trainable_dtypes)
    trainer.train()
    acc = trainer.accelerator
    logs = [h for h in trainer.state.log_history if "tokens_per_second" in h]
    steady = logs[1:] or logs
    state = getattr(trainer.optimizer, "state", None)
    recorder.row["optimizer_state_dtypes"] = _dtypes(  # AdamW's moments (not its step counters)
        v
        for st in (state.values() if isinstance(state, dict) else [])
        if isinstance(st, dict)
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    recorder.write(
        "ok",
        tokens_per_second=statistics.median(h["tokens_per_second"] for h in steady),
        rollout_backend=trainer.run_state.rollout_backend,
        oom_splits=trainer.run_state.oom_splits,
    )
    peak = torch.tensor([recorder.peak], device=acc.device)
    peaks = acc.gather(peak).tolist()
    result = None
    if acc.is_main_process:
        result = {
            **recorder.row,
            "status": "ok",
            "processes": acc.num_processes,
            "engine": support.engine.value,
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "shape": shape,
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
            "peak_gib_per_rank": peaks if cuda else [None] * len(peaks),
            "phase_peak_gib": recorder.phase_peaks,
            "build_seconds": build_s,
            "rollout_backend": trainer.run_state.rollout_backend,
            "versions": _versions(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        for key in ("phase", "update", "rank"):
            result.pop(key, None)
    acc.wait_for_everyone()
    acc.end_training()
    return result


def load_run(out: Path) -> dict:
    """One row for the run that wrote ``out``: rank 0's result when it finished, else the rank rows.

    The status is the first of ``oom``, ``error``, ``timeout``, ``killed``, ``ok`` that any rank reports
    (a rank that timed out waiting for a peer that ran out of memory makes the run ``oom``; ``killed``: a
    rank ended without writing its outcome, its row says in which phase); ``missing`` when nothing was
    written (the launcher failed before the ranks started, or the step was never run).
    """
    ranks = []
    for path in sorted(rank_dir(out).glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank"))):
        ranks.append(json.loads(path.read_text()))
    main = json.loads(out.read_text()) if out.is_file() else {}
    if not ranks and not main:
        return {"name": out.stem, "status": "missing"}
    row = {k: v for k, v in (ranks[0] if ranks else {}).items() if k not in _PER_RANK}
    row.update(main)
    row["name"] = out.stem
    statuses = [r.get("status") for r in ranks]
    if not main:
        row["status"] = next((s for s in STATUSES if s in statuses), "missing")
        if row["status"] == "running":
            row["status"] = "killed"
            row["failed_phase"] = next(r.get("phase") for r in ranks if r.get("status") == "running")
    expected = row.get("processes") or len(ranks)
    by_rank = {r["rank"]: r for r in ranks}
    row["peak_gib_per_rank"] = [by_rank.get(i, {}).get("peak_gib") for i in range(expected)]
    row["ranks"] = [
        {k: by_rank[i].get(k) for k in _PER_RANK if k in by_rank[i]}
        if i in by_rank
        else {"rank": i, "status": "missing"}
        for i in range(expected)
    ]
    failed = [r for r in ranks if r.get("status") == row["status"] and r.get("error")]
    if failed and row["status"] != "ok":
        row["error"] = failed[0]["error"]
        row["failed_phase"] = failed[0].get("phase")
        row["failed_update"] = failed[0].get("update")
        row["requested_gib"] = failed[0].get("requested_gib")
    return row


_PER_RANK = (
    "rank",
    "status",
    "phase",
    "update",
    "peak_gib",
    "phase_peak_gib",
    "resident_gib_after_prepare",
    "max_reserved_gib",
    "gpu_total_gib",
    "seconds",
    "error",
    "requested_gib",
    "traceback",
)


def _dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


def _launcher() -> str:
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "accelerate+deepspeed"
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "accelerate+fsdp"
    return "torchrun/accelerate" if "WORLD_SIZE" in os.environ else "python"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    for name in ("transformers", "accelerate", "trl", "deepspeed"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    main()
