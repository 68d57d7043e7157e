"""`rapidfire plan` for a card you do not have: planned from the shape alone (nothing allocated, under a
memory cap), a plan that does not fit exits 1 with one line saying what would, allocator errors of the
measured path are one line too."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidfire_hf.cli.main import main

TARGET = ["plan", "--shape", "llama-7b", "--gpu-memory", "80", "--batch", "160", "--value-mode", "fused",
          "--config", "aggressive"]  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]
CAP = 8 * 1024**3


def _cap():
    resource.setrlimit(resource.RLIMIT_AS, (CAP, CAP))


@pytest.mark.slow  # ~20 s on a loaded 2-core CPU, most of it importing torch and transformers
def test_the_issue_command_fits_under_an_8_gib_memory_cap():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    probe = "import resource, runpy, sys; sys.argv = ['rapidfire'] + sys.argv[1:]; "
    probe += "runpy.run_module('rapidfire_hf', run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-c", probe, *TARGET, "--json"],
        capture_output=True, text=True, env=env, preexec_fn=_cap, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["fits"] and plan["planned_peak_bytes"] <= plan["target_bytes"]
    assert plan["target_bytes"] == int(0.92 * 80 * 1024**3)
    assert set(plan["phase_peak_bytes"]) == {"training", "scoring", "generation"}
    assert plan["probe"].startswith("analytic") and plan["optimizer_state"] == "8-bit"
    assert "Traceback" not in done.stderr


def test_the_7b_reward_model_run_of_issue_46_is_split_in_the_plan(capsys):
    assert main([*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--host-offload", "off"]) == 0
    out = capsys.readouterr().out
    assert "planned for a 79.19 GiB card from its shape" in out and "weights 37.4 GiB" in out
    assert "8 in 2 pieces of 4" in out and "same mini-batch and optimizer steps" in out
    assert "DOES NOT FIT" not in out


def test_the_7b_reward_model_run_offloads_its_frozen_weights_to_train_whole(capsys):
    """Issue 46 item 2: on the 80 GB card the plan keeps the reference and reward weights in host memory
    outside scoring; the 24.9 GiB it frees trains the micro-batch of 8 whole without recompute and generates
    the batch in one chunk (the optimizer state stays: moving it too would change nothing more)."""
    # with "off" nothing moves
    assert main([*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json", "--host-offload", "off"]) == 0
    assert json.loads(capsys.readouterr().out)["offload_frozen"] is False
    assert (
        main([*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json", "--host-offload", "auto"]) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["offload_frozen"] is True and plan["offload_state"] is False
    assert (plan["splits"], plan["checkpointing"], plan["generation_rows"]) == (0, "none", 160)
    assert "24.9 GiB away outside scoring" in plan["reasons"]["offload_frozen"]
    assert "not needed" in plan["reasons"]["offload_state"]
    peaks = plan["phase_peak_bytes"]  # the frozen weights are counted only where they are held
    assert peaks["scoring"] - peaks["generation"] < 24.9 * 1024**3


@pytest.mark.parametrize("card, level", [("192", "aggressive"), ("79.19", "conservative")])
def test_no_offload_where_everything_fits_or_the_level_forbids_it(capsys, card, level):
    main(["plan", "--shape", "llama-7b", "--gpu-memory", card, "--batch", "160", "--value-mode", "fused",
          "--config", level, "--reward", "model", "--json", "--host-offload", "auto"])  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert plan["offload_frozen"] is False and plan["offload_state"] is False


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_plan_that_does_not_fit_exits_1_with_one_line_saying_what_would(capsys, json_flag):
    code = main(["plan", "--shape", "llama-15b", "--gpu-memory", "80", "--batch", "64", "--value-mode",
                 "fused", "--config", "balanced", *json_flag])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1
    # with --json, what libraries print on first import is on stderr too (transformers' WANDB [INFO] line)
    lines = [ln for ln in captured.err.strip().splitlines() if ln.startswith("rapidfire")]
    assert len(lines) == 1 and lines[0].startswith("rapidfire plan: does not fit: planned peak"), captured.err
    assert "fits with a card of at least" in lines[0] and "LoRA (--peft)" in lines[0]
    assert "Traceback" not in captured.err
    if json_flag:
        assert json.loads(captured.out)["fits"] is False
    else:
        assert "DOES NOT FIT" in captured.out
    # what the line says would make it fit does: the card it names, or LoRA
    need = int(lines[0].split("at least ")[1].split(" GiB")[0])
    assert main(["plan", "--shape", "llama-15b", "--gpu-memory", str(need), "--batch", "64",
                 "--value-mode", "fused", "--config", "balanced", "--json"]) == 0  # fmt: skip
    assert main(["plan", "--shape", "llama-15b", "--gpu-memory", "80", "--batch", "64",
                 "--value-mode", "fused", "--config", "balanced", "--peft", "--json"]) == 0  # fmt: skip


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf", "eighty", "1e300"])
def test_a_bad_gpu_memory_is_one_line_and_status_2(capsys, value):
    assert main(["plan", "--shape", "llama-7b", "--gpu-memory", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"rapidfire plan: error: --gpu-memory {value!r}: expected a number of GiB above 0, e.g. 80"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the measured path runs on this GPU")
def test_a_reward_model_or_lora_needs_the_shape_path(capsys):
    assert main(["plan", "--shape", "smoke", "--reward", "model"]) == 2
    assert "add --gpu-memory GiB" in capsys.readouterr().err


def test_a_local_model_is_planned_from_its_config_alone(tmp_path, capsys):
    """Only config.json is read: a folder with no weights at all plans (7B Llama's config)."""
    from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config

    llama_config(LLAMA_SHAPES["llama-7b"], 4096).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "141", "--batch", "64", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["held_gib"]["weights"] == pytest.approx(
        2 * 6.738415616e9 * 2 / 2**30, abs=1e-3
    )
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "80"]) == 2
    assert "no decoder shape in its config.json" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the measured path runs on this GPU")
def test_an_allocator_error_while_building_is_one_line_and_status_1(monkeypatch, capsys):
    import rapidfire_hf.cli.plan as plan_cli

    def build(args, out_dir):  # a real allocator error: far more than any host has
        torch.empty(2**60, dtype=torch.uint8)

    monkeypatch.setattr(plan_cli, "_build_trainer", build)
    assert main(["plan", "--shape", "smoke"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "does not fit this machine to build and probe" in lines[0], captured.err
    assert "--gpu-memory" in lines[0] and "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("shape", ["llama-7b", "llama-1.1b"])
def test_the_analytic_parameter_counts_are_the_meta_models(shape):
    """The counts the plan holds are those of the models built on the meta device (no memory)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config
    from rapidfire_hf.memory.estimate import DecoderShape

    config = llama_config(LLAMA_SHAPES[shape], 520)
    s = DecoderShape.from_config(config)
    with torch.device("meta"):
        lm, score = LlamaForCausalLM(config), LlamaForSequenceClassification(config)
    assert s.params("lm") == sum(p.numel() for p in lm.parameters())
    assert s.params("score") == sum(p.numel() for p in score.parameters())
    assert s.params("value") == s.params("lm") + s.hidden + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the measured path runs on this GPU")
def test_a_measured_plan_that_does_not_fit_exits_1_with_one_line(monkeypatch, capsys, tmp_path):
    import rapidfire_hf.ppo.recipe.planning as planning
    from rapidfire_hf.memory.planner import Budget

    monkeypatch.setattr(planning, "level_budget", lambda *a, **k: Budget(target_bytes=1024))  # 1 KiB device
    code = main(["plan", "--shape", "smoke", "--batch", "8", "--micro", "2", "--prompt-length", "8",
                 "--response-length", "8", "--output-dir", str(tmp_path)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1 and "DOES NOT FIT" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rapidfire plan: does not fit: planned peak"), captured.err
    assert "fits with a GPU of at least 1 GiB (planned from the shape)" in lines[0]


def test_frozen_models_in_8_bits_are_counted_and_suggested_where_they_make_it_fit(capsys):
    """PPOConfig's ref_model_quantization / reward_model_quantization, planned from the shape: int8 decoder
    weights (embeddings, norms and heads kept in bf16); the does-not-fit line names it where it fits."""
    from rapidfire_hf.demo.shapes import LLAMA_SHAPES, llama_config
    from rapidfire_hf.memory.estimate import DecoderShape, frozen_bytes

    s = DecoderShape.from_config(llama_config(LLAMA_SHAPES["llama-7b"], 520))
    linear = s.layers * (s.layer_params() - 2 * s.hidden)
    assert frozen_bytes(s, "lm", None) == 2 * s.params("lm")
    assert frozen_bytes(s, "lm", "8bit") == linear + 2 * (s.params("lm") - linear)
    assert frozen_bytes(s, "lm", "4bit") < frozen_bytes(s, "lm", "8bit")
    base = [*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json", "--host-offload", "off"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--frozen-quantization", "8bit"]) == 0
    eight = json.loads(capsys.readouterr().out)
    saved = plain["held_gib"]["weights"] - eight["held_gib"]["weights"]
    assert saved == pytest.approx(2 * (2 * s.params("lm") - frozen_bytes(s, "lm", "8bit")) / 2**30, rel=0.02)
    assert eight["splits"] == 0 and plain["splits"] == 1  # the micro-batch of 8 fits whole beside int8 models
    # 7B, batch 160, balanced (no 8-bit AdamW state) on 80 GiB: does not fit; the line names what does
    assert main(["plan", "--shape", "llama-7b", "--gpu-memory", "80", "--batch", "160", "--value-mode",
                 "fused", "--reward", "model", "--config", "balanced"]) == 1  # fmt: skip
    line = capsys.readouterr().err.strip()
    assert "--config aggressive" in line and "--frozen-quantization" in line, line


def test_the_plan_command_plans_ppoconfigs_host_offload_default(capsys):
    """`rapidfire plan` without --host-offload plans what PPOConfig would run (its default, read from there)."""
    from rapidfire_hf.ppo.config import PPOConfig

    default = PPOConfig.__dataclass_fields__["host_offload"].default
    assert default == "auto"
    capsys.readouterr()  # what this test's own import printed (transformers' WANDB [INFO] line when first)
    assert main([*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json", "--host-offload", default]) == 0
    assert json.loads(capsys.readouterr().out) == plain


def test_an_8bit_kv_cache_grows_the_generation_chunk_and_the_table_names_it(capsys):
    """Issue 46 item 2: with nothing offloaded, the 7B batch of 160 generates in 2 chunks of 80 with the model's
    dtype, at once with int8."""
    off = [*TARGET, "--json", "--host-offload", "off"]
    assert main([*off, "--kv-cache-dtype", "model"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*off, "--kv-cache-dtype", "int8"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert (plain["generation_rows"], small["generation_rows"]) == (80, 160)
    # "auto" (the default) takes int8 here under aggressive: one chunk instead of two (memory.kv_choice)
    assert main(off) == 0
    auto = json.loads(capsys.readouterr().out)
    assert (auto["generation_rows"], auto["kv_cache_dtype"], auto["asked"]["kv_cache_dtype"]) == (160, "int8", "auto")
    assert auto["reasons"]["kv_cache_dtype"].startswith(
        "auto, aggressive: generation in 1 chunk of 160 rows, not 2 of 80; 264.0 KiB a token of a row"
    )
    assert {k: v for k, v in auto.items() if k != "reasons" and k != "asked"} == {
        k: v for k, v in small.items() if k != "reasons" and k != "asked"
    }
    assert (plain["kv_cache_dtype"], small["kv_cache_dtype"]) == ("model dtype", "int8")
    assert small["kv_bytes_per_token"] / plain["kv_bytes_per_token"] == (128 + 4) / 256
    assert main([*TARGET, "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"KV cache dtype +int8 +int8 +your rollout_kv_cache_dtype: 264\.0 KiB", out)


def test_an_8bit_kv_cache_makes_room_for_the_fused_decode_projections_in_the_issue_run(capsys):
    """The issue's run (7B full fine-tuning, reward model, batch 160, aggressive, 80 GB card, PPOConfig's
    defaults): the frozen weights offloaded already generate the batch at once; int8 halves the generation
    peak's cache, and the 8.38 GiB of fused decode projections then fit beside the unchanged plan."""
    run = [*TARGET, "--reward", "model", "--gpu-memory", "79.19", "--json"]
    assert main(run) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*run, "--kv-cache-dtype", "int8"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert plain["generation_rows"] == small["generation_rows"] == 160
    assert (plain["fuse_projections"], small["fuse_projections"]) == (False, True)
    assert "would change the generation chunk 160 -> 80" in plain["reasons"]["fuse_projections"]
    for key in ("train_rows", "checkpointing", "splits", "scoring_rows", "offload_frozen"):
        assert plain[key] == small[key], key
    drop = plain["phase_peak_bytes"]["generation"] - small["phase_peak_bytes"]["generation"]
    cache = 160 * 512 * 2 * 32 * 32 * (2 * 128 - (128 + 4))  # rows x tokens x K and V of 32 layers' 32 heads
    copies = 32 * 4096 * (4096 + 2 * 4096 + 2 * 11008) * 2  # q/k/v and gate/up of every layer, bf16
    assert drop == cache - copies  # 19.4 GiB less of cache, 8.38 GiB more of weight copies held
    assert abs(copies / 2**30 - 8.375) < 1e-3


@pytest.mark.parametrize("bad", ["int4", "INT8", ""])
def test_an_unknown_kv_cache_dtype_is_one_line_and_exit_2(capsys, bad):
    assert main([*TARGET, "--kv-cache-dtype", bad]) == 2
    err = capsys.readouterr().err
    assert f"--kv-cache-dtype {bad!r}: expected one of 'auto', 'model', 'fp8', 'int8'" in err
    assert len(err.strip().splitlines()) == 1


def test_the_fit_hint_offers_an_8bit_kv_cache_where_it_makes_the_plan_fit(capsys):
    # 7B LoRA with 4,096-token responses on a 40 GiB card: the KV cache of one generated row is 2.1 GiB
    long = ["plan", "--shape", "llama-7b", "--gpu-memory", "40", "--batch", "8", "--micro", "1", "--peft",
            "--response-length", "4096", "--value-mode", "fused", "--config", "aggressive"]  # fmt: skip
    assert main([*long, "--kv-cache-dtype", "model"]) == 1
    assert "an 8-bit KV cache (--kv-cache-dtype int8; changes the arithmetic)" in capsys.readouterr().err
    assert main([*long, "--kv-cache-dtype", "int8"]) == 0
    capsys.readouterr()
    # "auto" (the default) takes it under aggressive: the plan in the model's dtype does not fit
    assert main([*long, "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["kv_cache_dtype"] == "int8" and auto["fits"]
    assert auto["reasons"]["kv_cache_dtype"].startswith(
        "auto, aggressive: the plan in the model's dtype does not fit the card"
    )
    main([*long[:-2], "--config", "balanced", "--json"])  # balanced keeps the arithmetic: the model's dtype
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_dtype"] == "model dtype" and "only aggressive may" in plan["reasons"]["kv_cache_dtype"]


def _generation_peak(tmp_path, capsys, name: str, config) -> int:
    folder = tmp_path / name
    config.save_pretrained(folder)
    argv = ["plan", "--model", str(folder), "--gpu-memory", "80", "--batch", "64", "--prompt-length", "64",
            "--response-length", "448", "--json"]  # fmt: skip
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["phase_peak_bytes"]["generation"]


def test_a_local_windowed_model_counts_its_ring_only_where_the_native_path_runs(tmp_path, capsys):
    """A sliding window shorter than the rollout is a ring of ``window`` KV slots on the engine's native path;
    the generic path (here Phi-3 with longrope scaling) keeps full-length caches, and ``rapidfire plan
    --model`` counts them as PPOTrainer does (the shape alone would count a ring)."""
    from transformers import MistralConfig, Phi3Config

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024, pad_token_id=0)  # fmt: skip
    native = {w: _generation_peak(tmp_path, capsys, f"mistral{w}", MistralConfig(**small, sliding_window=w))
              for w in (16, None)}  # fmt: skip
    assert native[16] < native[None]  # the ring: 16 slots a layer instead of 512
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32, "original_max_position_embeddings": 256}  # fmt: skip
    generic = {
        w: _generation_peak(
            tmp_path, capsys, f"phi{w}", Phi3Config(**small, sliding_window=w, rope_parameters=dict(rope))
        )
        for w in (16, None)
    }
    assert generic[16] == generic[None]  # full-length caches either way


def test_auto_kv_for_a_model_the_native_path_does_not_run_keeps_its_dtype(tmp_path, capsys):
    """``rapidfire plan --model``: the int8 cache needs the engine's native path, so a model on the generic
    path (Phi-3 with longrope scaling) keeps the model's dtype and says why; a Llama-family one may take it."""
    from transformers import MistralConfig, Phi3Config

    small = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=1024, pad_token_id=0)  # fmt: skip
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 32,
            "long_factor": [2.0] * 32, "original_max_position_embeddings": 256}  # fmt: skip
    reasons = {}
    for name, config in (("phi", Phi3Config(**small, rope_parameters=rope)), ("mistral", MistralConfig(**small))):
        config.save_pretrained(tmp_path / name)
        argv = ["plan", "--model", str(tmp_path / name), "--gpu-memory", "80", "--batch", "64",
                "--config", "aggressive", "--json"]  # fmt: skip
        assert main(argv) == 0
        reasons[name] = json.loads(capsys.readouterr().out)["reasons"]["kv_cache_dtype"]
    assert reasons["phi"] == "auto: the model's dtype (the policy runs the engine's generic decode path)"
    assert reasons["mistral"].startswith("auto, aggressive: the model's dtype (8 bits would generate")



def test_frozen_auto_is_planned_with_the_kv_cache_auto_chooses(capsys):
    """``--frozen-quantization auto`` with ``--kv-cache-dtype auto`` (the default) plans the frozen models with
    the cache "auto" takes, as PPOTrainer does: 7B LoRA batch 320 on 48 GiB quantizes the reward model (int8
    cache, no offload); with the model's dtype named it keeps them as given."""
    base = ["plan", "--shape", "llama-7b", "--gpu-memory", "48", "--batch", "320", "--value-mode", "fused",
            "--peft", "--reward", "model", "--config", "aggressive", "--frozen-quantization", "auto", "--json"]  # fmt: skip
    assert main(base) == 0
    auto = json.loads(capsys.readouterr().out)
    assert (auto["frozen"], auto["kv_cache_dtype"], auto["offload_frozen"]) == ("8bit", "int8", False), auto
    assert main([*base, "--kv-cache-dtype", "model"]) == 0
    model = json.loads(capsys.readouterr().out)
    assert (model["frozen"], model["kv_cache_dtype"]) == ("as given", "model dtype"), model
