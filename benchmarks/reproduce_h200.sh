#!/usr/bin/env bash
# Regenerate the numbers of README.md, docs/results.md and benchmarks/*/README.md.
#
#   bash benchmarks/reproduce_h200.sh --list               # the entries and the stored folder each one regenerates
#   bash benchmarks/reproduce_h200.sh OUT                  # every one-GPU entry (about 3 hours on one H200)
#   bash benchmarks/reproduce_h200.sh OUT ppo_first_run grpo_lowmem_switch   # the named entries
#
# Each entry writes OUT/<entry>/ (results.json / CSV / PNG as the script writes them, plus log.txt) and
# prints its exit status; a failing entry does not stop the others. Compare OUT/<entry>/ with the stored
# folder that --list names. Entries whose stored results came from two calls (stock on one GPU, ours on
# another) run here as one call, so their ratios become same-run. Entries starting with dist_ need two GPUs
# and run only when named, as does ppo_size7b_table (five entries of the list, then one table of them).
#
# Needs the package installed (pip install -e ".[test]"); for the stock PPO side trl==1.12.0 installed in
# its own folder, never next to trl 1.16 (TRL112_PATH, default /tmp/site112; see
# benchmarks/ppo_vs_trl/README.md); bitsandbytes for the GRPO low-memory rows, torchao for FP8, peft for the
# 7B LoRA rows, deepspeed for the ZeRO engines. benchmarks/common/gpu_env.sh sets up a machine without internet from
# carried wheels.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export TRL112_PATH=${TRL112_PATH:-/tmp/site112} TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
PPO="$PY benchmarks/ppo_vs_trl/run.py"

# name|stored folder (under benchmarks/)|what it measures
ENTRIES=(
  "ppo_first_run|ppo_vs_trl/results/h200/first_run|PPO stock vs ours, batch 8-256 (README rows 1-3)"
  "ppo_trl_large_batches|ppo_vs_trl/results/h200/trl_large_batches|stock PPO at batch 128 and 256"
  "ppo_ours_compiled_decode|ppo_vs_trl/results/h200/ours_compiled_decode|ours with the compiled decode step"
  "ppo_fused_b256_compiled|ppo_vs_trl/results/h200/fused_b256_compiled|fused value head at batch 256"
  "ppo_small_batches|ppo_vs_trl/results/h200/small_batches|batch 8 and 32 with compile / Liger"
  "ppo_best_b256|ppo_vs_trl/results/h200/best_b256|batch 256: stock, ours fused Liger + compile, 3 timed updates (README row 4)"
  "ppo_speedups_b256|ppo_vs_trl/results/h200/speedups_b256|torch_compile / Liger / micro-batch 32 at batch 256"
  "ppo_fused_b4096|ppo_vs_trl/results/h200/fused_b4096_gen_chunks|fused value head at rollout batch 4096"
  "ppo_size7b|ppo_vs_trl/results/h200/size7b|7B shape, full fine-tuning and LoRA, every mode"
  "ppo_size7b_512tok|ppo_vs_trl/results/h200/size7b_512tok|7B LoRA at 128+384 tokens: stock b8-64, ours fused b160-512"
  "ppo_b8|ppo_vs_trl/results/h200/b8|batch 8, separate value model: stock and ours, 3 timed updates"
  "ppo_table_1b|ppo_vs_trl/results/h200/table_1b|1.1B PPO, stock b8-256 next to ours in each run.py call, 3 timed updates (README rows 1-3)"
  "ppo_size7b_full_rm|ppo_vs_trl/results/h200/size7b_full_rm|7B full fine-tuning, 128+384 tokens, 7B reward model: stock b8/b16, ours b160"
  "ppo_size7b_lora_rm|ppo_vs_trl/results/h200/size7b_lora_rm|7B LoRA, 128+384 tokens, 7B reward model: stock b64 (b32 if b64 fails), ours fused b256"
  "ppo_size7b_limits_rm|ppo_vs_trl/results/h200/size7b_limits_rm|7B, 128+384 tokens, 7B reward model: stock LoRA b128, ours separate LoRA b160, ours fused full b256"
  "ppo_size7b_quant_rm|ppo_vs_trl/results/h200/size7b_quant_rm|7B full separate with a 4-bit reference and 8-bit reward model: ours b160 and b256"
  "ppo_size7b_gen_chunks|ppo_vs_trl/results/h200/size7b_gen_chunks|7B full fused b256: generation in chunks of 128 and 256 prompts instead of 80"
  "ppo_size7b_full_b4|ppo_vs_trl/results/h200/size7b_full_b4|7B full fine-tuning, 7B reward model: stock TRL at rollout batch 4, then ours fused at 160, one call"
  "ppo_size7b_table|ppo_vs_trl/results/h200/size7b_table|README's 7B table: the five 7B entries above, then one summary.csv / size7b.png of their rows"
  "ppo_sweep|ppo_vs_trl/results/h200/sweep|LoRA sweeps, 1.1B: N trials one after another (stock, ours) vs PPOSweep (not run yet)"
  "ppo_sweep_7b|ppo_vs_trl/results/h200/sweep_7b|LoRA sweeps, 7B: 4 trials one after another (ours) vs PPOSweep (not run yet)"
  "sweep|sweep/results/h200/first_run|8 LoRA trials, 1.1B: PPOSweep with successive halving vs PPOTrainer one after another vs stock TRL 1.12: time to the best trial, memory (stored: a shorter first call, see sweep/README.md)"
  "sweep_packing|sweep/results/h200/packing|8 LoRA trials, 1.1B: training forwards of 16 rows, the sweep's throughput plan on and off, PPOTrainer one after another (one call; rows32 in packing_rows32, a later call)"
  "sweep_7b|sweep/results/h200_7b|4 LoRA trials, 7B: the same parts as sweep (not run yet)"
  "ppo_learning_sweep|ppo_vs_trl/results/h200/learning_lr_sweep|learning: reward per lr and system, 4-16 seeds"
  "grpo_lowmem_switch|grpo/results/h200/lowmem_switch|GRPO memory.lowmem switch (README row 5)"
  "grpo_balanced|grpo/results/h200/balanced|GRPO balanced config (README row 6)"
  "grpo_release|grpo/results/h200/release|GRPO: balanced and the low-memory switch under the memory.release_after_rollout default (pressure) and the previous one (always), stock, one call (not run yet)"
  "trl_trainers|trl_trainers/results/h200|SFT and DPO at sequence 2048 (README row 7)"
  "optimizer_interleaved|optimizer/results/h200/interleaved|optimizer variants, interleaved paired steps"
  "optimizer_buckets|optimizer/results/h200/buckets_interleaved|bucket sizes, overlap (README row 8)"
  "memory_first_run|memory/results/h200/first_run|allocator, compaction, selective checkpointing"
  "memory_defaults|memory/results/h200/defaults|the default callback, largest micro-batch"
  "memory_defaults_pressure|memory/results/h200/defaults_pressure|native allocator with the pressure rule"
  "presets_b64|presets/results/h200/b64|1.1B batch 64: stock, no config, every preset, advanced.yaml, the snippet, with/without the planner"
  "presets_b256|presets/results/h200/b256|1.1B batch 256 fused + Liger + compile: stock, no config, balanced (exact clip) and balanced with clip_prediction scale (README row 13)"
  "presets_b256_p1|presets/results/h200/b256p1|1.1B batch 256 fused + Liger + compile: no config, conservative, aggressive, stock"
  "presets_b256_p2|presets/results/h200/b256p2|1.1B batch 256 fused + Liger + compile: no config, advanced.yaml, the snippet, balanced"
  "presets_clip64|presets/results/h200/clip64|1.1B batch 64: no config, balanced (clip_prediction exact), balanced with scale, stock (stock timed out in the stored call)"
  "presets_full7b|presets/results/h200/full7b|7B full fine-tuning, 7B reward model, b160: ours aggressive from the batch alone against today's hand-tuned settings"
  "presets_lora7b|presets/results/h200/lora7b|7B LoRA, 7B reward model: stock b64, ours aggressive b256, hand-tuned b256 (stored: ours only, stock left out of that call)"
  "presets_lora7b_cache_plan|presets/results/h200/lora7b_cache_plan|7B LoRA b256: aggressive from the batch alone (KV cache held in the plan) against hand-tuned"
  "presets_full7b_b256|presets/results/h200/full7b_b256|7B full fine-tuning, batch 256 from the batch alone: aggressive with Triton attention, with SDPA, stock TRL at batch 4, one call"
  "presets_full7b_freecache|presets/results/h200/full7b_freecache|7B full fine-tuning, batch 160: aggressive with the KV cache kept and freed after generation (rollout_cache auto), one call (stock left out)"
  "presets_full7b_freecache_stock|presets/results/h200/full7b_freecache_stock|7B full fine-tuning, batch 160: aggressive with rollout_cache keep (stored as the row aggressive, then the default) and auto, stock b4, one call (the rollout_cache default decision)"
  "presets_full7b_b256_cache|presets/results/h200/full7b_b256_cache|7B full fine-tuning, batch 256 from the batch alone: aggressive (rollout_cache auto, the default) and with rollout_cache keep, one call"
  "presets_lora7b_tattn|presets/results/h200/lora7b_tattn|7B LoRA batch 256 from the batch alone: aggressive with Triton attention against SDPA, one call"
  "presets_pipe7b|presets/results/h200/pipe7b|7B full fine-tuning, batch 32: the gradient pipeline on/off at 1, 4, 8 accumulation steps"
  "presets_pipe64|presets/results/h200/pipe64|1.1B batch 64: the gradient pipeline on/off at 1, 4, 8 accumulation steps, stock"
  "presets_b8|presets/results/h200/b8|1.1B batch 8, separate value: no config, every preset, advanced.yaml, the snippet, stock"
  "presets_b8_span_cap|presets/results/h200/b8_span_cap|1.1B batch 8 with the span cap, 6 timed updates a row (stock's row cut by its limit)"
  "presets_release_b8|presets/results/h200/release_b8|1.1B batch 8: balanced and aggressive with memory.release_after_rollout always (the default then) and pressure, stock (cut by its 100 s), one call"
  "presets_release8|presets/results/h200/release8|1.1B batch 8: the memory.release_after_rollout default (pressure) against the previous one (always) with no config and balanced, stock, aggressive, one call; one update of each of ours profiled"
  "presets_release8_rest|presets/results/h200/release8_rest|1.1B batch 8: no config, conservative, advanced.yaml and the snippet under the release default, 4 timed updates a row, no stock"
  "presets_release_b8_stock|presets/results/h200/release_b8_stock|1.1B batch 8: no config, balanced with the release at every update (the default then) and under pressure, stock, one call"
  "presets_lora7b_fuselora|presets/results/h200/lora7b_fuselora|7B LoRA batch 256: aggressive with and without rollout_decode_fuse_lora, one call (not run yet)"
  "presets_b8_8updates|presets/results/h200/b8_8updates|1.1B batch 8: no config and every preset, 7 timed updates a row, no stock"
  "ppo_families_b8|ppo_vs_trl/results/h100/families_b8|PPO batch 8, separate value model, Gemma-3-1B and OLMo-2-1B shapes (random init): stock TRL 1.12 and ours, one call per family (README row 15)"
  "rollout|rollout/results/h200|decode step: generate vs the rollout engine (README row 9)"
  "rollout_generic|rollout/results/h100/generic|decode step at batch 8: generate (dynamic cache) against the engine's generic path on the 1.1B Llama shape (README row 16)"
  "presets_full7b_h100|presets/results/h100/full7b_plan|7B full fine-tuning, batch 160, aggressive, on one 80 GB H100: the plan's per-phase peaks against the measured ones, tokens/s, OOM splits (README)"
  "rollout_families|rollout/results/h100/families|decode step per model family (Llama-1.1B, Gemma-3-1B, OLMo-2-1B, Phi-3-mini, Pythia-1B, 12-layer Qwen3-30B-A3B MoE; random init, bf16) at batch 8 and 64: the engine vs generate dynamic/static, per-byte vs Llama (stored: --budget-s 240, the recorded step and dynamic generate for every family; the compiled rows past the budget)"
  "rollout_lora|rollout/results/h200/lora|decode step with a rank-16 LoRA adapter on q/k/v/o: compiled, fused projections (LoRA layers unfused), fused with LoRA (decode_fuse_lora), batch 8 and 64 (not run yet)"
  "kernels|kernels/results/h200|the Triton decode kernels against sdpa / matmul attention and sample_tokens, then the decode step with them"
  "kernels_call5|kernels/results/h200/call5|GPU kernel tests, attention mid-response with the kv_end bound, the compiled decode step (default SDPA vs Triton attention) at the response's mean cache length"
  "kernels_call6|kernels/results/h200/call6|PPO 1.1B batch 8 / 32: stock TRL 1.12, ours with SDPA, with the Triton attention, with fused projections + Triton attention, one call"
  "kernels_call7|kernels/results/h200/call7|GPU kernel tests; PPO 1.1B: stock (ours' base rows cut by the part's 200 s), ours with the module projections"
  "kernels_call8|kernels/results/h200/call8|PPO 1.1B batch 8 / 32: stock TRL 1.12, ours (fused projections from 'auto'), ours with the module projections, one call (ours' batch 32 cut by the limit)"
  "kernels_call9|kernels/results/h200/call9|PPO 1.1B batch 32: ours (fused from 'auto') against the module projections, one call"
  "precision_torchao|precision/results/h200/torchao|fp16 overflow; FP8 linears per backend; 40-step loss"
  "precision_fp8_7b|precision/results/h200/fp8_loss/llama-7b_bf16|compiled FP8 training, 7B (README row 10)"
  "precision_fp8_1b_bf16|precision/results/h200/fp8_loss/llama-1.1b_bf16|compiled FP8 training, 1.1B bf16 weights"
  "precision_fp8_1b_fp32|precision/results/h200/fp8_loss/llama-1.1b_fp32_master|compiled FP8 training, fp32 master"
  "precision_ppo_ratio|precision/results/h200/ppo_ratio_three_modes|PPO log-prob drift: bf16, adaptive, fp32"
  "kernels_b32_release|kernels/results/h200/b32_release|PPO 1.1B batch 32: stock TRL 1.12 and ours with today's defaults (fused projections, Triton attention, the release only under pressure), one call (issue 31's 7x target; not run yet)"
  "gpu_suite|gpu_tests/results/h200/suite|every GPU test (pytest -m gpu tests) on one visible GPU, JUnit XML and the summary"
  "dist_run|distributed/results/h200x2|2 GPUs: NCCL tests, engine smoke, DDP tokens/s (README row 11)"
  "dist_largest|distributed/results/h200x2/largest_model_bf16|2 GPUs: the largest PPO model per engine"
  "dist_sft_engines|distributed/results/h200x2/sft_engines|2 GPUs: enable_rapidfire (SFT) per engine"
)

entry() {  # the commands of one entry, writing into $1
  local o=$1 name=$2
  case $name in
    ppo_first_run) $PPO --out "$o" --rollout-backend auto --timeout 150 ;;
    ppo_trl_large_batches) $PPO --out "$o" --trl-batches 128,256 --our-batches "" --fused-batches "" --learn-updates 0 --timeout 230 ;;
    ppo_ours_compiled_decode) $PPO --out "$o" --trl-batches "" --our-batches 8,32,256 --fused-batches 64,256 --learn-updates 0 --timeout 85 ;;
    ppo_fused_b256_compiled) $PPO --out "$o" --trl-batches "" --our-batches "" --fused-batches 256 --learn-updates 0 --timeout 85 ;;
    ppo_small_batches) $PPO --out "$o" --part throughput --updates 2 --timeout 120 --trl-batches 8,32 --our-batches 32,8 \
        --fused-batches 32 --ours-variants compile --fused-variants liger+compile ;;
    ppo_best_b256) $PPO --out "$o" --part throughput --updates 4 --timeout 200 --trl-batches 256 --our-batches "" \
        --fused-batches 256 --fused-variants liger+compile ;;
    ppo_speedups_b256)
      $PPO --out "$o/a" --part throughput --trl-batches "" --updates 2 --ours-decode-mode cuda_graph --timeout 150 \
        --our-batches 256 --fused-batches 256 --ours-variants base,liger+compile --fused-variants base,liger+compile
      $PPO --out "$o/b" --part throughput --trl-batches "" --updates 2 --ours-decode-mode cuda_graph --timeout 150 \
        --our-batches 256 --fused-batches 256 --ours-variants m32,liger,compile --fused-variants m32
      $PPO merge "$o" "$o/a/results.json" "$o/b/results.json" ;;
    ppo_fused_b4096) $PPO --out "$o" --part throughput --updates 1 --timeout 195 --trl-batches "" --our-batches "" \
        --fused-batches 4096 --ours-decode-mode cuda_graph --ours-gen-chunk 512 ;;
    ppo_size7b) $PPO --out "$o" --part size7b --size-timeout 400 ;;
    ppo_size7b_512tok)  # four calls on one GPU, each pairing a stock and an our batch; then the summary
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-timeout 300"
      local ours="--only s7_fused_lora --size-micro-ours 8 --ours-score-chunk 16"
      $PPO --out "$o/c1o" $s7 $ours --size-batch-ours 160 && $PPO --out "$o/c1t" $s7 --only s7_trl_lora --size-batches-trl 8
      $PPO --out "$o/c2t" $s7 --only s7_trl_lora --size-batches-trl 16 && $PPO --out "$o/c2o" $s7 $ours --size-batch-ours 256 --ours-gen-chunk 256
      $PPO --out "$o/c3t" $s7 --only s7_trl_lora --size-batches-trl 32
      $PPO --out "$o/c4t" $s7 --only s7_trl_lora --size-batches-trl 64 && $PPO --out "$o/c4o" $s7 $ours --size-batch-ours 512 --ours-gen-chunk 256
      for c in c1o:call1_ours_b160 c1t:call1_trl_b8 c2t:call2_trl_b16 c2o:call2_ours_b256 c3t:call3_trl_b32 \
          c4t:call4_trl_b64 c4o:call4_ours_b512; do cp "$o/${c%%:*}/results.json" "$o/${c##*:}.json"; done
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_families_b8)  # the policy's family at its published size; the value model is that family's classifier
      for f in gemma3-1b olmo2-1b; do
        $PPO --out "$o/$f" --part throughput --shape "$f" --updates 4 --timeout 200 --trl-batches 8 --our-batches 8 \
          --fused-batches "" --learn-updates 0
      done ;;
    ppo_b8) $PPO --out "$o" --part throughput --updates 4 --timeout 120 --trl-batches 8 --our-batches 8 --fused-batches "" ;;
    ppo_table_1b)  # stock and ours one after another in each call, 1 warm-up + 3 timed updates per row (~17 min)
      $PPO --out "$o/a" --part throughput --updates 4 --timeout 150 --trl-batches 8,32,64,256 --our-batches 8,32,64 \
        --fused-batches ""
      $PPO --out "$o/c" --part throughput --updates 4 --timeout 120 --trl-batches 64 --our-batches "" --fused-batches 64
      $PPO --out "$o/d" --part throughput --updates 4 --timeout 150 --trl-batches 256 --our-batches "" \
        --fused-batches 256 --fused-variants liger+compile
      $PY benchmarks/ppo_vs_trl/summarize.py --same-run "$o" ;;
    ppo_size7b_full_rm)  # full fine-tuning; ours with RapidFireOptimizer(adamw8bit, gradient pipeline)
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      local ours="--size-micro-ours 8 --ours-score-chunk 16 --ours-gen-chunk 80 --ours-optimizer adamw8bit --size-batch-ours 160"
      $PPO --out "$o/trl_b8" $s7 --only s7_trl_full --size-batches-trl 8 --size-timeout 150
      $PPO --out "$o/fused_b160" $s7 $ours --only s7_fused_full --size-timeout 200
      $PPO --out "$o/sep_b160" $s7 $ours --only s7_rapidfire_full --size-timeout 220
      $PPO --out "$o/trl_b16" $s7 --only s7_trl_full --size-batches-trl 16 --size-timeout 100
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_lora_rm)  # LoRA r=16 on the policy (the value model trained in full, as both trainers ship)
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      local ours="--size-micro-ours 8 --ours-score-chunk 16"
      $PPO --out "$o/trl_b64" $s7 --only s7_trl_lora --size-batches-trl 64 --size-timeout 200
      $PY -c "import json,sys; sys.exit(json.load(open('$o/trl_b64/results.json'))['rows'][0]['status'] != 'ok')" \
        || $PPO --out "$o/trl_b32" $s7 --only s7_trl_lora --size-batches-trl 32 --size-timeout 150
      $PPO --out "$o/fused_b256" $s7 $ours --only s7_fused_lora --size-batch-ours 256 --ours-gen-chunk 256 --size-timeout 300
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_limits_rm)  # the limits the two entries above leave open
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      local ours="--size-micro-ours 8 --ours-score-chunk 16 --ours-gen-chunk 80 --ours-optimizer adamw8bit"
      $PPO --out "$o/trl_lora_b128" $s7 --only s7_trl_lora --size-batches-trl 128 --size-timeout 300
      $PPO --out "$o/sep_lora_b160" $s7 $ours --only s7_rapidfire_lora --size-batch-ours 160 --size-timeout 240
      $PPO --out "$o/fused_full_b256" $s7 $ours --only s7_fused_full --size-batch-ours 256 --size-timeout 440
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_quant_rm)  # what the frozen models' quantization buys the memory-bound mode (~8 min)
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      local ours="--size-micro-ours 8 --ours-score-chunk 16 --ours-gen-chunk 80 --ours-optimizer adamw8bit"
      ours="$ours --ours-ref-quant 4bit --ours-reward-quant 8bit --only s7_rapidfire_full"
      $PPO --out "$o/sep_b160" $s7 $ours --size-batch-ours 160 --size-timeout 220
      $PPO --out "$o/sep_b256" $s7 $ours --size-batch-ours 256 --size-timeout 300
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_gen_chunks)  # at b256 the fused full run peaked at 91 GiB with chunks of 80 (~7 min)
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      local ours="--size-micro-ours 8 --ours-score-chunk 16 --ours-optimizer adamw8bit --only s7_fused_full"
      $PPO --out "$o/gen128" $s7 $ours --size-batch-ours 256 --ours-gen-chunk 128 --size-timeout 240
      $PPO --out "$o/gen256" $s7 $ours --size-batch-ours 256 --ours-gen-chunk 256 --size-timeout 240
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_full_b4)  # stock ran out of memory at 8 and 16; its weights and AdamW state take ~125 GiB (~7 min)
      local s7="--part size7b --size-prompt-len 128 --size-response-len 384 --size-updates 4 --size-reward model"
      $PPO --out "$o/trl_b4" $s7 --only s7_trl_full --size-batches-trl 4 --size-micro 4 --size-timeout 240
      $PPO --out "$o/fused_b160" $s7 --size-micro-ours 8 --ours-score-chunk 16 --ours-gen-chunk 80 \
        --ours-optimizer adamw8bit --size-batch-ours 160 --only s7_fused_full --size-timeout 200
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" ;;
    ppo_size7b_table)  # about 40 minutes: more than one device call, so each entry can also run on its own
      local part
      for part in ppo_size7b_lora_rm ppo_size7b_full_rm ppo_size7b_limits_rm ppo_size7b_full_b4 ppo_size7b_gen_chunks; do
        mkdir -p "$o/$part" && ( entry "$o/$part" $part ) > "$o/$part/log.txt" 2>&1
      done
      $PY benchmarks/ppo_vs_trl/summarize.py --size7b "$o" --from "$o/ppo_size7b_lora_rm" "$o/ppo_size7b_full_rm" \
        "$o/ppo_size7b_limits_rm" "$o/ppo_size7b_full_b4" "$o/ppo_size7b_gen_chunks" ;;
    ppo_sweep)  # two calls of about 6 and 8 minutes; each ratio pairs rows of one call
      $PPO --out "$o/a" --part sweep --sweep-systems trl,sweep --sweep-trials 4 --timeout 200
      $PPO --out "$o/b" --part sweep --sweep-systems rapidfire,sweep --sweep-trials 2,4,8 --timeout 200
      $PY benchmarks/ppo_vs_trl/summarize.py --sweep "$o" ;;
    ppo_sweep_7b)  # about 9 minutes; the 7B shape's models built on the GPU in bf16
      $PPO --out "$o" --part sweep --sweep-shape llama-7b --sweep-systems rapidfire,sweep --sweep-trials 4 --timeout 240
      $PY benchmarks/ppo_vs_trl/summarize.py --sweep "$o" ;;
    sweep) bash benchmarks/sweep/h200.sh "$o" ;;  # one call of about 8 minutes
    sweep_7b) bash benchmarks/sweep/h200.sh "$o" 7b ;;
    sweep_packing) TRAIN_ROWS=16 SWEEP_PLANS="on off" bash benchmarks/sweep/h200.sh "$o" packing ;;
    ppo_learning_sweep)
      local lr system seeds
      for spec in "3e-4 learn_trl 16" "3e-4 learn_rapidfire_separate 16" "3e-4 learn_rapidfire_fused 8" \
          "6e-4 learn_trl 8" "6e-4 learn_rapidfire_separate 8" "6e-4 learn_rapidfire_fused 8" \
          "1e-3 learn_trl 4" "1e-3 learn_rapidfire_separate 4" "1e-3 learn_rapidfire_fused 16"; do
        set -- $spec
        lr=$1 system=$2 seeds=$(seq -s, 0 $(($3 - 1)))
        $PPO --out "$o/runs/${system}_lr$lr" --part learning --only "$system" --learn-lr "$lr" --learn-seeds "$seeds" --timeout 900
      done
      $PY benchmarks/ppo_vs_trl/lr_sweep.py "$o" "$o/runs" ;;
    grpo_lowmem_switch) $PY benchmarks/grpo/run.py --out "$o" --variants stock,rapidfire_lowmem ;;
    grpo_balanced) $PY benchmarks/grpo/run.py --out "$o" --variants stock,rapidfire --steps 6 ;;
    grpo_release) $PY benchmarks/grpo/run.py --out "$o" --steps 6 \
        --variants stock,rapidfire,rapidfire_alwaysrelease,rapidfire_lowmem,rapidfire_lowmem_alwaysrelease ;;
    trl_trainers) $PY benchmarks/trl_trainers/run.py --out "$o" --systems stock,rapidfire,stock_no_ckpt --max-batch --budget-s 220 ;;
    optimizer_interleaved) $PY benchmarks/optimizer/run.py --out "$o" --rounds 1 --interleave 24 --only torch_adamw \
        rf_pipeline_off rf_pipeline_on rf_verify_only rf_pipeline_rollback torch_adamw_ckpt rf_pipeline_ckpt torch_adamw_accum \
        rf_pipeline_on_accum rf_verify_accum rf_rollback_accum bnb_adamw8bit rf_adamw8bit_pipeline ;;
    optimizer_buckets) $PY benchmarks/optimizer/run.py --out "$o" --rounds 1 --interleave 24 --no-snapshot --bucket-mb 128 256 512 \
        --only torch_adamw rf_pipeline_on rf_pipeline_bucket128 rf_pipeline_bucket256 rf_pipeline_bucket512 \
        rf_pipeline_rollback rf_rollback_overlap rf_pipeline_overlap ;;
    memory_first_run) $PY benchmarks/memory/run.py --out "$o" ;;
    memory_defaults) $PY benchmarks/memory/run.py --out "$o" --groups allocator/native,allocator/expandable ;;
    memory_defaults_pressure) $PY benchmarks/memory/run.py --out "$o" --groups allocator/native --batch-variants none ;;
    presets_b64) bash benchmarks/presets/h200.sh "$o" b64 && mv "$o"/b64/* "$o"/ && rmdir "$o/b64" ;;
    presets_b256) bash benchmarks/presets/h200.sh "$o" b256 && mv "$o"/b256/* "$o"/ && rmdir "$o/b256" ;;
    presets_clip64) bash benchmarks/presets/h200.sh "$o" clip64 && mv "$o"/clip64/* "$o"/ && rmdir "$o/clip64" ;;
    presets_full7b) ROWS_7B=aggressive,handtuned UPDATES_7B=3 bash benchmarks/presets/h200.sh "$o" full7b && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    presets_b256_p1) bash benchmarks/presets/h200.sh "$o" b256p1 && mv "$o"/b256p1/* "$o"/ && rmdir "$o/b256p1" ;;
    presets_b256_p2) bash benchmarks/presets/h200.sh "$o" b256p2 && mv "$o"/b256p2/* "$o"/ && rmdir "$o/b256p2" ;;
    presets_full7b_b256) BATCH_7B=256 ROWS_7B=aggressive+tattn,aggressive+sdpa,trl UPDATES_7B=4 TIMEOUT_7B=245 \
        bash benchmarks/presets/h200.sh "$o" full7b && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    presets_full7b_freecache) ROWS_7B=aggressive+keepcache,aggressive+freecache UPDATES_7B=4 TIMEOUT_7B=265 \
        bash benchmarks/presets/h200.sh "$o" full7b && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    presets_full7b_freecache_stock) ROWS_7B=aggressive+keepcache,aggressive+freecache,trl UPDATES_7B=4 TIMEOUT_7B=180 \
        bash benchmarks/presets/h200.sh "$o" full7b && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    presets_full7b_b256_cache) BATCH_7B=256 ROWS_7B=aggressive,aggressive+keepcache UPDATES_7B=4 TIMEOUT_7B=240 \
        bash benchmarks/presets/h200.sh "$o" full7b && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    presets_lora7b_tattn) ROWS_7B=aggressive+tattn,aggressive+sdpa UPDATES_7B=4 TIMEOUT_7B=190 \
        bash benchmarks/presets/h200.sh "$o" lora7b && mv "$o"/lora7b/* "$o"/ && rmdir "$o/lora7b" ;;
    presets_lora7b_cache_plan) ROWS_7B=aggressive,handtuned UPDATES_7B=3 bash benchmarks/presets/h200.sh "$o" lora7b && mv "$o"/lora7b/* "$o"/ && rmdir "$o/lora7b" ;;
    presets_lora7b) bash benchmarks/presets/h200.sh "$o" lora7b && mv "$o"/lora7b/* "$o"/ && rmdir "$o/lora7b" ;;
    presets_pipe64) bash benchmarks/presets/h200.sh "$o" pipe64 && mv "$o"/pipe64/* "$o"/ && rmdir "$o/pipe64" ;;
    presets_b8) bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_b8_span_cap) B8_UPDATES=7 B8_TIMEOUT=85 B8_ROWS=none,conservative,balanced,aggressive,advanced,snippet,trl \
        bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_release_b8) B8_UPDATES=6 B8_TIMEOUT=100 B8_ROWS=balanced,balanced-pressurerelease,aggressive,aggressive-pressurerelease,trl \
        bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_release8) bash benchmarks/presets/h200.sh "$o" release8 && mv "$o"/release8/* "$o"/ && rmdir "$o/release8" ;;
    presets_release8_rest) B8_UPDATES=5 B8_TIMEOUT=75 B8_ROWS=none,conservative,advanced,snippet \
        bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_release_b8_stock) B8_UPDATES=6 B8_TIMEOUT=210 B8_ROWS=none,balanced,balanced-pressurerelease,trl \
        bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_lora7b_fuselora) ROWS_7B=aggressive,aggressive+fuselora UPDATES_7B=4 TIMEOUT_7B=220 \
        bash benchmarks/presets/h200.sh "$o" lora7b && mv "$o"/lora7b/* "$o"/ && rmdir "$o/lora7b" ;;
    presets_b8_8updates) B8_UPDATES=8 B8_TIMEOUT=70 B8_ROWS=none,advanced,snippet,balanced,aggressive,conservative \
        bash benchmarks/presets/h200.sh "$o" b8 && mv "$o"/b8/* "$o"/ && rmdir "$o/b8" ;;
    presets_pipe7b) bash benchmarks/presets/h200.sh "$o" pipe7b && mv "$o"/pipe7b/* "$o"/ && rmdir "$o/pipe7b" ;;
    rollout) $PY benchmarks/rollout/run.py --out "$o" --batches 8,32,256 --budget-s 270 ;;
    rollout_generic) $PY benchmarks/rollout/run.py --out "$o" --batches 8 --systems hf_dynamic,generic_cuda_graph --budget-s 120 \
      --no-correctness ;;
    presets_full7b_h100) ROWS_7B=aggressive UPDATES_7B=3 TIMEOUT_7B=320 bash benchmarks/presets/h200.sh "$o" full7b \
      && mv "$o"/full7b/* "$o"/ && rmdir "$o/full7b" ;;
    rollout_families) $PY benchmarks/rollout/families.py --out "$o" --budget-s 360 ;;
    rollout_lora) $PY benchmarks/rollout/run.py --out "$o" --batches 8,64 --lora-rank 16 \
        --systems ours_compile,ours_compile+fuse,ours_compile+fuse_lora --budget-s 280 ;;
    kernels) bash benchmarks/kernels/h200.sh "$o" ;;
    kernels_call5) PARTS="tests kernels profile" KERNELS=attention TOTAL_S=545 PROFILE_VARIANTS=sdpa,tattn \
        PROFILE_FIRST_STEP=184 PROFILE_BATCHES=8,256,64 bash benchmarks/kernels/h200.sh "$o" ;;
    kernels_call6) PARTS=ppo PPO_KERNELS="base tattn fuse+tattn" TOTAL_S=560 bash benchmarks/kernels/h200.sh "$o" ;;
    kernels_b32_release) PARTS=ppo PPO_KERNELS=base PPO_BATCHES=32 PPO_TRL_BATCHES=32 PPO_CAP_S=300 TOTAL_S=420 \
        bash benchmarks/kernels/h200.sh "$o" ;;
    gpu_suite) CUDA_VISIBLE_DEVICES=0 $PY -m pytest -q -p no:cacheprovider -m gpu tests --junitxml "$o/junit.xml" \
        --tb=line --show-capture=no > "$o/summary.txt" 2>&1; tail -15 "$o/summary.txt" ;;
    kernels_call7) PARTS="tests ppo" PPO_KERNELS="base nofuse" TOTAL_S=540 bash benchmarks/kernels/h200.sh "$o" ;;
    kernels_call8) PARTS=ppo PPO_KERNELS="base nofuse" PPO_CAP_S=300 TOTAL_S=560 bash benchmarks/kernels/h200.sh "$o" ;;
    kernels_call9) PARTS=ppo PPO_KERNELS="base nofuse" PPO_BATCHES=32 PPO_TRL_BATCHES= PPO_CAP_S=85 TOTAL_S=300 \
        bash benchmarks/kernels/h200.sh "$o" ;;
    precision_torchao) $PY benchmarks/precision/run.py --out "$o" --budget-s 275 ;;
    precision_fp8_7b) $PY benchmarks/precision/run.py --out "$o" --parts fp8_loss --fp8-loss-shape llama-7b --fp8-loss-weights bf16 \
        --fp8-loss-variants bf16_compiled,torchao_tensorwise_compiled,torchao_rowwise_compiled --fp8-loss-steps 30 --budget-s 130 ;;
    precision_fp8_1b_bf16) $PY benchmarks/precision/run.py --out "$o" --parts fp8_loss --fp8-loss-weights bf16 \
        --fp8-loss-variants bf16_compiled,torchao_tensorwise_compiled --fp8-loss-steps 40 --budget-s 60 ;;
    precision_fp8_1b_fp32) $PY benchmarks/precision/run.py --out "$o" --parts fp8_loss \
        --fp8-loss-variants bf16,bf16_compiled,torchao_tensorwise_compiled,torchao_rowwise_compiled --fp8-loss-steps 40 --budget-s 120 ;;
    precision_ppo_ratio) $PY benchmarks/precision/ppo_ratio.py --out "$o" --rollout-decode-mode cuda_graph --updates 20 ;;
    dist_run) bash benchmarks/distributed/run.sh "$o" ;;
    dist_largest) SET=bf16 bash benchmarks/distributed/largest_model.sh "$o" ;;
    dist_sft_engines)
      local engine cfg port=29600
      for engine in ddp zero2 zero3 fsdp2; do
        case $engine in ddp) cfg=multi_gpu ;; zero2) cfg=deepspeed_zero2 ;; zero3) cfg=deepspeed_zero3 ;; fsdp2) cfg=fsdp2 ;; esac
        port=$((port + 11))
        accelerate launch --main_process_port $port --config_file accelerate_configs/$cfg.yaml \
          tests/distributed/scripts/sft_ranks.py "$o/sft_$engine" --device cuda --bf16
      done
      $PY benchmarks/distributed/report.py --sft "$o" ;;
    *) echo "unknown entry $name (see --list)" >&2; return 2 ;;
  esac
}

if [ "${1:-}" = "--list" ] || [ $# -eq 0 ]; then
  printf '%-26s %-52s %s\n' entry "stored in benchmarks/" measures
  for e in "${ENTRIES[@]}"; do IFS='|' read -r name stored what <<< "$e"; printf '%-26s %-52s %s\n' "$name" "$stored" "$what"; done
  [ $# -eq 0 ] && { echo "usage: $0 OUT [ENTRY ...] | --list" >&2; exit 2; }
  exit 0
fi
OUT=$1; shift
mkdir -p "$OUT"
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  # dist_* need two GPUs; ppo_size7b_table repeats five entries of the list: both run only when named
  for e in "${ENTRIES[@]}"; do name=${e%%|*}; [[ $name == dist_* || $name == ppo_size7b_table ]] || names+=("$name"); done
fi
$PY -c "import sys; sys.path.insert(0, '.'); import json; from benchmarks.common import environment; print(json.dumps(environment()))" \
  > "$OUT/environment.json"
status=0
for name in "${names[@]}"; do
  mkdir -p "$OUT/$name"
  start=$(date +%s)
  ( entry "$OUT/$name" "$name" ) > "$OUT/$name/log.txt" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name rc=$rc in $(($(date +%s) - start)) s -> $OUT/$name"
done
exit $status
