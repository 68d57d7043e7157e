"""README.md rows 5-11 (GRPO, SFT/DPO, the optimizer step, the decode step, FP8, DDP) are the stored results', as
are README's other measured numbers outside the table (the DDP ratio and the 15.6B FSDP2 model under "More
than one GPU", the sweep's time to the best trial, the "up to 36%" spread of stock's median) and the numbers of
docs/results.md's headline rows' section that no other test reads. Each stored file is the one docs/results.md
names for the row ("Commands"); each shown number is the stored one, rounded as printed. A re-run that changes
a stored file, or a README or docs edit, that leaves the two apart fails here."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "docs" / "results.md").read_text()
WORDS = {3: "three", 5: "five", 6: "six", 9: "nine"}


def _row(number: int) -> list[str]:
    """README's headline row ``number``: #, comparison, stock, ours, ratio."""
    line = next(x for x in README.splitlines() if x.startswith(f"| {number} | "))
    return [c.strip() for c in line.strip("|").split("|")]


def _paragraph(text: str, start: str) -> str:
    """The paragraph of ``text`` that holds ``start``, from there, on one line."""
    i = text.index(start)
    return " ".join(text[i : text.index("\n\n", i)].split())


def _headline_section() -> str:
    """docs/results.md's "README.md's headline rows" section, on one line per paragraph as written."""
    start = RESULTS.index("## README.md's headline rows")
    return RESULTS[start : RESULTS.index("\n## ", start + 1)]


def _load(path: str) -> dict:
    return json.loads((BENCH / path).read_text())


def _grpo_workload(data: dict) -> str:
    """``128 + 256 tokens`` from the stored run's workload line."""
    m = re.search(r"(\d+)-token prompts, \d+ x (\d+) completion tokens", data["workload"])
    assert m, data["workload"]
    return f"{m[1]} + {m[2]} tokens"


def test_row_5_is_the_lowmem_switch_call():
    data = _load("grpo/results/h200/lowmem_switch/results.json")
    assert data["environment"]["gpu"] == "NVIDIA H200"
    stock, ours = data["runs"]["stock"], data["runs"]["rapidfire_lowmem4"]
    settings = data["variants"]["rapidfire_lowmem4"]["settings"][0]["setting"]
    assert '"lowmem": "on_8bit_embedding"' in settings
    _, what, s, o, ratio = _row(5)
    assert 'memory.lowmem="on_8bit_embedding"' in what and _grpo_workload(data) in what
    steady = [r["speed"]["steady_state_steps_2_on"] for r in (stock, ours)]
    for cell, run, speed in ((s, stock, steady[0]), (o, ours, steady[1])):
        assert cell == f"{speed['tokens_per_sec']:,.0f}; {run['peak_allocated_gib']:.2f} GiB"
    stored = data["ratios_by_variant"]["rapidfire_lowmem4"]
    speedup, memory = stored["tokens_per_sec_steady_state_steps_2_on"], stored["peak_allocated"]
    assert abs(speedup - steady[1]["tokens_per_sec"] / steady[0]["tokens_per_sec"]) < 1e-9
    assert abs(memory - ours["peak_allocated_gib"] / stock["peak_allocated_gib"]) < 1e-9
    assert ratio == f"**{speedup:.2f}×; {memory:.2f}×**"
    # the note on the row, and "GRPO rows five or nine steps": steps 2.. of the ten
    assert f"GRPO rows {WORDS[5]} or {WORDS[steady[1]['steps']]} steps" in " ".join(
        _headline_section().split()
    )


def test_row_6_is_the_balanced_call():
    data = _load("grpo/results/h200/balanced/results.json")
    assert data["environment"]["gpu"] == "NVIDIA H200"
    stock, ours = data["runs"]["stock"], data["runs"]["rapidfire"]
    assert "MemoryCompactionCallback (balanced)" in ours["installed"]
    _, what, s, o, ratio = _row(6)
    assert "`enable_rapidfire` balanced config" in what and _grpo_workload(data) in what
    a, b = stock["tokens_per_sec_after_first_step"], ours["tokens_per_sec_after_first_step"]
    assert s == f"{a:,.0f}" and o == f"{b:,.0f}"
    assert abs(data["ratios"]["tokens_per_sec_after_first_step"] - b / a) < 1e-9
    assert ratio == f"**{b / a:.2f}×**"
    timed = stock["steps"] - 1  # steps 2..
    assert f"GRPO rows {WORDS[timed]} or nine steps" in " ".join(_headline_section().split())


def test_row_7_is_the_trl_trainers_call():
    data = _load("trl_trainers/results/h200/results.json")
    assert data["environment"]["gpu"] == "NVIDIA H200"
    with open(BENCH / "trl_trainers" / "results" / "h200" / "results.csv") as fh:
        rows = {(r["trainer"], r["system"]): r for r in csv.DictReader(fh)}
    _, what, s, o, ratio = _row(7)
    assert f"sequence {data['settings']['shape']['seq']}" in what
    assert data["settings"]["systems"]["rapidfire"]["preset"] == "balanced" and "balanced" in what
    stock = [float(rows[t, "stock"]["tokens_per_s"]) for t in ("sft", "dpo")]
    ours = [float(rows[t, "rapidfire"]["tokens_per_s"]) for t in ("sft", "dpo")]
    assert all(rows[t, x]["status"] == "ok" for t in ("sft", "dpo") for x in ("stock", "rapidfire"))
    assert s == " / ".join(f"{x:,.0f}" for x in stock) and o == " / ".join(f"{x:,.0f}" for x in ours)
    assert ratio == " / ".join(f"{b / a:.2f}×" for a, b in zip(stock, ours))


def test_row_8_is_the_interleaved_buckets_call():
    data = _load("optimizer/results/h200/buckets_interleaved/results.json")
    assert data["device_name"] == "NVIDIA H200"
    mib = 256
    vs = data["interleaved"][f"rf_pipeline_bucket{mib}"]["vs_reference"]
    assert vs["reference"] == "torch_adamw"  # torch.optim.AdamW(fused=True), benchmarks/optimizer/run.py
    _, what, s, o, ratio = _row(8)
    assert f"({mib} MiB buckets)" in what and f"median of {vs['pairs']} paired steps" in what
    low, high = vs["median_ci95"]
    assert s == "1" and o == f"{vs['median']:.2f} [{low:.2f}, {high:.2f}]"
    assert ratio == f"{vs['median']:.2f}×"


def test_row_9_is_the_rollout_call():
    data = _load("rollout/results/h200/results.json")
    assert data["gpu"] == "NVIDIA H200" and data["model"]["shape"] == "llama-1.1b"
    assert (data["prompt_len"], data["new_tokens"]) == (128, 384)  # the table's "unless stated"
    batch = 8
    rows = {r["system"]: r for r in data["results"] if r["batch"] == batch}
    dyn, static, ours = (rows[x]["ms_per_step"] for x in ("hf_dynamic", "hf_static", "ours_compile"))
    _, what, s, o, ratio = _row(9)
    assert f"at batch {batch}:" in what and "dynamic / static cache" in what and "compiled" in what
    assert s == f"{dyn:.1f} / {static:.2f} ms" and o == f"{ours:.2f} ms"
    assert ratio == f"**{dyn / ours:.0f}× / {static / ours:.1f}×**"


def test_row_10_is_the_fp8_loss_7b_call():
    data = _load("precision/results/h200/fp8_loss/llama-7b_bf16/results.json")
    assert data["env"]["gpu"] == "NVIDIA H200" and data["fp8_loss"]["shape"] == "llama-7b"
    variants = data["fp8_loss"]["variants"]
    bf16, fp8 = variants["bf16_compiled"], variants["torchao_tensorwise_compiled"]
    _, what, s, o, ratio = _row(10)
    assert "7B shape" in what and "compiled bf16" in what and "torchao tensorwise FP8" in what
    assert s == f"{bf16['median_step_ms']:.1f} ms" and o == f"{fp8['median_step_ms']:.1f} ms"
    speedup = bf16["median_step_ms"] / fp8["median_step_ms"]
    assert abs(fp8["speedup_vs_bf16_compiled"] - speedup) < 1e-9
    assert ratio == f"**{speedup:.2f}×**"


def test_row_11_and_its_mention_are_the_ddp_call():
    data = _load("distributed/results/h200x2/results.json")
    one, two = data["throughput"]["1"], data["throughput"]["2"]
    assert (one["engine"], one["processes"], two["engine"], two["processes"]) == ("single", 1, "ddp", 2)
    assert one["device"] == two["device"] == "NVIDIA H200"
    assert one["optimizer"] == two["optimizer"] == "rapidfire"  # "ours both"
    _, what, s, o, ratio = _row(11)
    shape = f"({one['prompt_length']} + {one['response_length']} tokens, {one['rollout_batch_per_rank']} prompts per rank"
    assert shape in what and (two["prompt_length"], two["response_length"]) == (128, 128)
    assert one["rollout_batch_per_rank"] == two["rollout_batch_per_rank"]
    a, b = one["tokens_per_second"], two["tokens_per_second"]
    assert s == f"{a:,.0f}" and o == f"{b:,.0f}"
    assert abs(data["speedup_2_vs_1"] - b / a) < 1e-9
    assert ratio == f"**{b / a:.2f}×**"
    assert f"DDP runs PPO at {b / a:.2f}× one GPU (row 11)" in _paragraph(README, "Single GPU, DDP, ZeRO-2")


def test_the_fsdp2_model_one_gpu_cannot_train_is_largest_model_bf16():
    runs = {
        r["name"]: r
        for r in _load("distributed/results/h200x2/largest_model_bf16/largest_model.json")["runs"]
    }
    fsdp2, single = runs["fsdp2_fused_15b"], runs["single_fused_15b"]
    assert (fsdp2["engine"], fsdp2["status"], single["engine"], single["status"]) == (
        "fsdp2",
        "ok",
        "single",
        "oom",
    )
    assert fsdp2["model"] == single["model"] and fsdp2["trainable_params"] == single["trainable_params"]
    size = f"{fsdp2['trainable_params'] / 1e9:.1f}B"
    assert f"FSDP2 trains a {size}-shape PPO model that one GPU cannot" in _paragraph(
        README, "Single GPU, DDP, ZeRO-2"
    )


def test_the_sweeps_time_to_the_best_trial_is_index_vs_sequential():
    data = _load("sweep/results/h200/index_vs_sequential/results.json")
    summary = data["summary"]
    assert data["environment"]["gpu"] == "NVIDIA H200" and summary["same_best_trial"] is True
    text = _paragraph(README, "`PPOSweep` trains many trials")
    assert (
        f"On one H200 (1.1B, {summary['trials']} trials), a halving sweep found the same best trial "
        f"{summary['time_to_best_speedup']:.1f}x sooner than the eight trials run one after another" in text
    )
    assert summary["trials"] == 8


def _table_1b_stock_b64() -> list[float]:
    """Stock TRL's tokens/s at batch 64 in the two calls of README row 3 (table_1b/a and table_1b/c)."""
    with open(BENCH / "ppo_vs_trl" / "results" / "h200" / "table_1b" / "same_run.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["batch"] == "64"]
    return [float(r["stock_tokens_per_s"]) for f in ("a/", "c/") for r in rows if r["file"].startswith(f)]


def test_the_spread_of_stocks_median_is_row_3s_two_calls():
    stock = _table_1b_stock_b64()
    assert len(stock) == 2
    spread = f"{100 * (max(stock) / min(stock) - 1):.0f}%"
    assert f"stock TRL's own median moved by up to {spread} between two calls of one row" in _paragraph(
        README, "Each row compares stock TRL"
    )
    timing = " ".join(_headline_section().split())
    assert (
        f"moved by up to {spread} between two calls of the same row "
        f"(batch 64: {stock[0]:,.0f} and {stock[1]:,.0f} tokens/s)" in timing
    )


def test_row_14s_previous_default_is_the_stored_call():
    with open(BENCH / "presets" / "results" / "h200" / "full7b_freecache_stock" / "results.csv") as fh:
        rows = {r["row"]: r for r in csv.DictReader(fh)}
    assert rows["aggressive"]["status"] == "ok" and rows["aggressive"]["batch"] == "160"
    line = next(x for x in _headline_section().splitlines() if x.startswith("# 14 -> "))
    assert (
        f"(with the previous rollout_cache default: {float(rows['aggressive']['tokens_per_s']):,.0f})" in line
    )


def test_the_7b_tables_out_of_memory_batches_are_size7b_table():
    with open(BENCH / "ppo_vs_trl" / "results" / "h200" / "size7b_table" / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    oom = {(r["system"], r["peft"], r["batch"]) for r in rows if r["status"] == "oom"}
    start = RESULTS.index("**7B PPO on one H200**")
    table = RESULTS[start : RESULTS.index("\n\n", RESULTS.index("| mode |", start))]
    lora, full = (
        next(x for x in table.splitlines() if x.startswith(f"| {m}, fused")) for m in ("LoRA", "full")
    )
    assert ("trl", "lora", "128") in oom and "(batch 128: OOM)" in lora
    assert {("trl", "", "8"), ("trl", "", "16")} <= oom and "(batch 8 and 16: OOM)" in full
    (chunks,) = [r for r in rows if r["file"].startswith("size7b_gen_chunks/gen128/")]
    assert (
        chunks["status"] == "ok"
        and f"batch {chunks['batch']}: {float(chunks['tokens_per_s']):,.0f} tok/s" in full
    )
    assert "(generation in chunks of 128)" in full
    call = {(r["system"], r["peft"], r["value_mode"], r["batch"]): r["file"].split("/")[0] for r in rows}
    lora_sep, full_sep = (next(x for x in table.splitlines() if x.startswith(f"| {m}, separate")) for m in ("LoRA", "full"))  # fmt: skip
    assert call["trl", "lora", "separate", "128"] == call["rapidfire", "lora", "separate", "160"]
    assert "stock OOM at 128 in that call" in lora_sep and "batch 160:" in lora_sep
    assert call["trl", "", "separate", "4"] != call["rapidfire", "", "separate", "160"]
    assert "stock's batch 4 ran in another call" in full_sep and "batch 160:" in full_sep
    assert all(r["micro"] == "8" for r in rows if r["system"] == "rapidfire" and r["micro"])
    assert "Ours: micro-batch 8," in " ".join(table.split())


def test_the_80gb_paragraphs_plan_is_full7b_plan():
    rows = _load("card80/results/h100_2026-12-06/full7b_trades/results.json")["rows"]
    (row,) = [r for r in rows if r["row"] == "full7b_offload"]
    (off,) = [r for r in rows if r["row"] == "full7b_off"]
    plan, off_plan = row["plan"], off["plan"]
    start = RESULTS.index("**7B full fine-tuning on one H100 80 GB**")
    text = " ".join(RESULTS[start : RESULTS.index("### Commands", start)].split())
    assert f"`aggressive` given only the rollout batch {row['batch']};" in text
    assert plan["offload_frozen"] and not plan["offload_state"] and "keeps the frozen reference and reward weights" in text
    assert plan["splits"] == 0 and plan["checkpointing"] == "none" and plan["train_rows"] == 8
    assert "the micro-batch of 8 trains whole without recompute" in text
    assert plan["generation_rows"] == row["batch"] and f"the batch of {row['batch']} generates in one chunk" in text
    assert plan["optimizer_state"] == "8-bit" and "it chose 8-bit AdamW state" in text
    pieces = re.search(r"(\d+) pieces of (\d+) rows", off_plan["reasons"]["train_rows"])
    assert pieces and f"({pieces[1]} pieces of {pieces[2]} rows, same optimizer steps" in text
    assert off_plan["checkpointing"] == "elementwise" and "element-wise recompute" in text
    assert f"generation in chunks of {off_plan['generation_rows']})" in text
    assert f"| generation (chunk of {plan['generation_rows']}) |" in text
    assert f"| scoring (chunk of {plan['scoring_rows']}) |" in text


def test_the_7b_ceiling_range_is_size7b_table_against_the_stated_estimate():
    """docs/results.md's "39-53% of the arithmetic ceiling in full fine-tuning": every stored full fine-tuning
    run of ours against benchmarks/ppo_vs_trl/README.md's estimate of the ceiling (separate value model: its
    forward-equivalents per token at its FLOP/s; fused: its stated tokens/s). The estimate itself is prose, not
    a measurement; the tokens/s are the stored ones."""
    text = " ".join((BENCH / "ppo_vs_trl" / "README.md").read_text().split())
    m = re.search(
        r"about (\d+) forward-equivalents of ([\d.]+) GFLOP per token at (\d+) TFLOP/s, ~(\d+)k tokens/s with a "
        r"separate value model; ~([\d.]+)k fused\), full separate reaches (\d+)%, full fused (\d+)% at batch 160 "
        r"and (\d+)% at batch 256",
        text,
    )
    assert m, "benchmarks/ppo_vs_trl/README.md's 7B ceiling estimate moved"
    separate = float(m[3]) * 1e12 / (int(m[1]) * float(m[2]) * 1e9)
    assert f"{separate / 1e3:.0f}" == m[4]
    ceiling = {"separate": separate, "fused": float(m[5]) * 1e3}
    with open(BENCH / "ppo_vs_trl" / "results" / "h200" / "size7b_table" / "summary.csv") as fh:
        rows = [
            r
            for r in csv.DictReader(fh)
            if r["status"] == "ok" and r["system"] == "rapidfire" and r["peft"] == ""
        ]
    shares = [100 * float(r["tokens_per_s"]) / ceiling[r["value_mode"]] for r in rows]
    assert {r["value_mode"] for r in rows} == {"separate", "fused"}
    assert f"{min(shares):.0f}" == m[6] and f"{max(shares):.0f}" == m[8]
    section = " ".join(_headline_section().split())
    assert f"{min(shares):.0f}-{max(shares):.0f}% of the arithmetic ceiling in full fine-tuning" in section


def test_the_timing_note_counts_the_stored_updates():
    """ "PPO rows time three updates after a warm-up (median; row 1 six)": the stored updates of each PPO row's
    call, less the warm-up; row 11's tokens/s is the median of its timed updates."""
    files = [
        "ppo_vs_trl/results/h200/table_1b/a/results.json",
        "ppo_vs_trl/results/h200/table_1b/c/results.json",
        "ppo_vs_trl/results/h200/best_b256/results.json",
        "presets/results/h200/b64/results.json",
        "presets/results/h200/b256/results.json",
        "presets/results/h200/full7b_freecache_stock/results.json",
        "ppo_vs_trl/results/h100/families_b8/gemma3-1b/results.json",
        "ppo_vs_trl/results/h100/families_b8/olmo2-1b/results.json",
    ]
    timed = {r["updates"] - 1 for f in files for r in _load(f)["rows"] if r.get("status") == "ok"}
    (row1,) = {r["updates"] - 1 for r in _load("presets/results/h200/release8/results.json")["rows"]}
    assert len(timed) == 1
    note = " ".join(_headline_section().split())
    assert f"PPO rows time {WORDS[timed.pop()]} updates after a warm-up (median; row 1 {WORDS[row1]})" in note
    for n in ("1", "2"):
        run = _load("distributed/results/h200x2/results.json")["throughput"][n]
        per = sorted(u["tokens_per_second"] for u in run["per_update"][1:])
        assert len(per) == 3 and run["tokens_per_second"] == per[1], n


# The PPO rows' stored calls (the files the number tests read): README row -> (file, stored row names).
PPO_ROWS = {
    1: ("presets/results/h200/release8/results.json", ["trl_b8", "none_b8"]),
    2: ("ppo_vs_trl/results/h200/table_1b/a/results.json", ["tp_trl_b32", "tp_rapidfire_b32"]),
    3: ("ppo_vs_trl/results/h200/table_1b/a/results.json", ["tp_trl_b64", "tp_rapidfire_b64"]),
    4: ("ppo_vs_trl/results/h200/best_b256/results.json", ["tp_trl_b256", "tp_fused_b256_liger_compile"]),
    12: ("presets/results/h200/b64/results.json", ["none_b64"]),
    13: ("presets/results/h200/b256/results.json", ["none_b256", "balanced_b256"]),
    14: ("presets/results/h200/full7b_freecache_stock/results.json", ["trl_b4", "aggressive+freecache_b160"]),
    15: ("ppo_vs_trl/results/h100/families_b8/gemma3-1b/results.json", ["tp_trl_b8", "tp_rapidfire_b8"]),
}


def test_the_ppo_rows_say_the_stored_workload():
    """Each PPO row's rollout batch, value mode and card as its stored call ran them, and the table's "one H200
    unless stated; 1.1B Llama shape, 128 + 384 tokens unless stated" holds for each row that states neither."""
    header = next(x for x in README.splitlines() if x.startswith("| # | comparison ("))
    m = re.search(
        r"\(one (H\d+) unless stated; ([\d.]+)B Llama shape, (\d+) \+ (\d+) tokens unless stated\)", header
    )
    assert m, header
    card, default_shape, tokens = f"NVIDIA {m[1]}", f"llama-{m[2]}b", (int(m[3]), int(m[4]))
    for number, (path, names) in PPO_ROWS.items():
        data = _load(path)
        rows = {r["name"]: r for r in data["rows"]}
        ours = rows[names[-1]]
        what = _row(number)[1]
        gpu = data["environment"]["gpu"]
        assert ("H100" in what and "H100 80GB" in gpu) or ("H100" not in what and gpu == card), number
        assert {(rows[n]["prompt_len"], rows[n]["response_len"]) for n in names} == {tokens}, number
        shape = {rows[n]["shape"] for n in names}
        if number == 14:
            assert shape == {"llama-7b"} and {rows[n]["reward"] for n in names} == {"model"}, number
            assert "7B full fine-tuning with a 7B reward model" in what and not ours["peft"]
        elif number == 15:
            assert shape == {"gemma3-1b"} and "H100 80 GB" in what, number
        else:
            assert shape == {default_shape}, number
        if number != 14:  # row 14: stock's largest batch against ours
            assert f"rollout batch {ours['batch']}" in what, number
        mode = {"separate": "separate value model", "fused": "fused value head"}[ours["value_mode"]]
        assert mode in what, number
        if ours.get("liger") and ours.get("compile"):
            assert "Liger + " in what and "compile" in what, number
    row3_fused = {r["name"]: r for r in _load("ppo_vs_trl/results/h200/table_1b/c/results.json")["rows"]}[
        "tp_fused_b64"
    ]
    assert row3_fused["value_mode"] == "fused" and "fused value head (two calls)" in _row(3)[1]
    olmo = _load("ppo_vs_trl/results/h100/families_b8/olmo2-1b/results.json")
    assert {r["shape"] for r in olmo["rows"]} == {"olmo2-1b"} and "H100 80GB" in olmo["environment"]["gpu"]
    generic = _load("rollout/results/h100/generic/results.json")
    assert (
        generic["model"]["shape"] == default_shape and generic["batches"] == [8] and "H100" in generic["gpu"]
    )
    assert "at batch 8 on one H100, 1.1B Llama shape" in _row(16)[1]
    lowmem = _load("grpo/results/h200/lowmem_switch/results.json")["variants"]["rapidfire_lowmem4"][
        "settings"
    ]
    assert any("adamw_8bit" in s["effect"] and "max_grad_norm=0.0" in s["effect"] for s in lowmem)
    assert "(8-bit AdamW, no clipping)" in _row(5)[1]


def test_the_7b_tables_settings_are_the_stored_runs():
    """ "Ours: micro-batch 8, scoring in chunks of 16, and for all but fused LoRA generation in chunks of 80 and
    RapidFireOptimizer(optimizer="adamw8bit", ...)" and "LoRA r=16": each run of ours stored with its results."""
    start = RESULTS.index("**7B PPO on one H200**")
    text = " ".join(RESULTS[start : RESULTS.index("| mode |", start)].split())
    m = re.search(r"Ours: micro-batch (\d+), scoring in chunks of (\d+), and for all but fused LoRA generation in "
                  r"chunks of (\d+) and `RapidFireOptimizer\(optimizer=\"(\w+)\"", text)  # fmt: skip
    assert m, text
    with open(BENCH / "ppo_vs_trl" / "results" / "h200" / "size7b_table" / "summary.csv") as fh:
        files = [
            r["file"]
            for r in csv.DictReader(fh)
            if r["system"] == "rapidfire" and r["file"].endswith(".json")
        ]
    runs = [
        (f, r)
        for f in files
        for r in _load(f"ppo_vs_trl/results/h200/{f}")["rows"]
        if r["system"] == "rapidfire" and r["status"] == "ok"
    ]
    assert len(runs) >= 5
    head = re.search(
        r"\(Llama-2-7B shape, (\d+) \+ (\d+) tokens, a 7B sequence-classification reward model", text
    )
    assert head, text
    assert {(r["shape"], r["prompt_len"], r["response_len"]) for _, r in runs} == {
        ("llama-7b", *map(int, head.groups()))
    }
    assert {r["reward_class"] for _, r in runs if r.get("reward_class")} == {"LlamaForSequenceClassification"}
    for f, r in runs:
        assert (str(r["micro"]), str(r["score_chunk"])) == (m[1], m[2]), f
        if r["peft"] == "lora":
            assert f"three with LoRA r={r['lora']['r']})" in text, f
        if r["peft"] == "lora" and r["value_mode"] == "fused":
            continue
        assert r["optimizer"] == m[4], f
        if f.startswith(
            "size7b_gen_chunks/"
        ):  # the chunks the table's row says, "(generation in chunks of 128)"
            assert f"generation in chunks of {r['rollout_generation_batch_size']})" in RESULTS[start:], f
        else:
            assert str(r["rollout_generation_batch_size"]) == m[3], f


def test_the_commands_of_rows_5_to_11_are_the_stored_calls():
    """The "# N ->" commands of rows 5-11 in docs/results.md: the stored call's arguments (its --out aside)."""
    section = _headline_section()

    def command(number: int) -> str:
        lines = section.splitlines()
        i = next(k for k, x in enumerate(lines) if x.startswith(f"# {number} -> "))
        return lines[i + 1]

    def args(cmd: str) -> list[str]:
        words = cmd.split()
        return words[words.index("--out") + 2 :]

    stored = _load("trl_trainers/results/h200/results.json")["command"]
    assert args(command(7)) == args(stored)
    stored = _load("rollout/results/h200/results.json")["command"]
    assert args(command(9)) == args(stored)
    balanced = _load("grpo/results/h200/balanced/results.json")
    assert f"--variants stock,rapidfire --steps {balanced['runs']['stock']['steps']}" in command(6)
    assert set(balanced["runs"]) == {"stock", "rapidfire"}
    lowmem = _load("grpo/results/h200/lowmem_switch/results.json")
    assert args(lowmem["command"]) == ["--variants", "stock,rapidfire_lowmem4"]
    assert args(command(5)) == [
        "--variants",
        "stock,rapidfire_lowmem",
    ]  # the variant's name since, said there
    assert "stored under the variant's earlier name, rapidfire_lowmem4" in section
    fp8 = _load("precision/results/h200/fp8_loss/llama-7b_bf16/results.json")["env"]["command"]
    entry = command(10).split()[-1]
    reproduce = (BENCH / "reproduce_h200.sh").read_text()
    assert entry == "precision_fp8_7b" and "--fp8-loss-shape llama-7b" in fp8 and entry in reproduce
