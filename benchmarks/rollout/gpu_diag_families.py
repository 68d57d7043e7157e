"""Issue 45's gemma2 / mixtral GPU failures, one line per variant (run by gpu_diag_families.sh; on the CPU:
``python benchmarks/rollout/gpu_diag_families.py --device cpu``).

The tiny models and prompts of tests/rollout (family_cases.py, conftest.py), greedy, 100 tokens:

- gemma2 fp32, the engine (eager decode step) against ``model.generate`` with the reference's attention
  eager (applies the attention soft-cap; expected equal) and sdpa (transformers 5.17's default for Gemma-2,
  which drops the cap; expected to leave at row 0 step 22 with a top-2 gap of 0.057, as the GPU log did),
  each with TF32 off and on;
- gemma2 / mixtral bf16: the engine's greedy tokens against the argmax of the model's own forward, the
  misses and the positions excused as ties (top-2 logit gap or, for mixtral, the router's k-th / (k+1)-th
  expert gap within 2**-5), each with its gaps;
- mixtral fp32 against ``generate``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "rollout"))
from _rollout_helpers import BF16_TIE, argmax_misses, fresh_logits, hf_greedy  # noqa: E402
from family_cases import GREEDY_TOKENS, build, case  # noqa: E402

from rapidfire_hf.demo import build_char_tokenizer  # noqa: E402
from rapidfire_hf.rollout import RolloutEngine, SamplingParams  # noqa: E402

PROMPTS = ["task: abc ->", "task: zq ->", "hello there, world ->", "x", "task: mnopq ->"]  # tests/rollout


def first_divergence(model, ids, mask, got, ref) -> str:
    if torch.equal(got, ref):
        return "equal"
    row, step = ((got != ref).float().cumsum(-1) == 1).nonzero()[0].tolist()
    logits = fresh_logits(model, torch.cat([ids, ref], 1), mask)[row, ids.shape[1] - 1 + step]
    top = logits.topk(2)
    return (
        f"DIVERGES row {row} step {step}: engine {got[row, step].item()} vs ref {ref[row, step].item()}, "
        f"ref forward's top-2 {top.indices.tolist()} gap {(top.values[0] - top.values[1]).item():.4g}"
    )


def engine_greedy(model, ids, mask, tokens: int):
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode="eager")
    return engine.generate(ids, mask, SamplingParams(max_new_tokens=tokens, do_sample=False))


def fp32_variants(name, tok, ids, mask, device, attentions, tokens: int):
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        model = build(case(name), len(tok)).to(device)
        got = engine_greedy(model, ids, mask, tokens).responses
        for attn in attentions:
            label = f"{name} fp32 tf32={'on' if tf32 else 'off'} reference attention={attn}"
            try:
                model.config._attn_implementation = attn  # the reference's attention (the engine ignores it)
                ref = hf_greedy(model, ids, mask, tokens, stop=None)
                print(f"{label}: {first_divergence(model, ids, mask, got, ref)}", flush=True)
            except Exception as e:  # transformers >= 5.2x refuses sdpa with a soft-cap: say so, go on
                print(f"{label}: reference refused ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    torch.backends.cuda.matmul.allow_tf32 = False


def bf16_variant(name, tok, ids, mask, device, tokens: int):
    model = build(case(name), len(tok)).to(device).to(torch.bfloat16)
    out = engine_greedy(model, ids, mask, tokens)
    misses, exact = argmax_misses(model, out, mask)
    excused, _ = argmax_misses(model, out, mask, tie=0.0)  # every token off the argmax, with its gaps
    print(
        f"{name} bf16: {len(misses)} misses, {exact:.3f} exact argmax, {len(excused)} off the argmax "
        f"(ties within {BF16_TIE:g} are excused)",
        flush=True,
    )
    for line in misses[:5]:
        print(f"  {name} bf16 MISS {line}")
    for line in excused[:8]:
        print(f"  {name} bf16 off-argmax {line}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=GREEDY_TOKENS, help="greedy tokens per variant")
    args = parser.parse_args(argv)
    import transformers

    device = torch.device(args.device)
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}")
    start = time.perf_counter()
    with torch.no_grad():
        fp32_variants("gemma2", tok, ids, mask, device, ("eager", "sdpa"), args.tokens)
        fp32_variants("mixtral", tok, ids, mask, device, ("sdpa",), args.tokens)
        bf16_variant("gemma2", tok, ids, mask, device, args.tokens)
        bf16_variant("mixtral", tok, ids, mask, device, args.tokens)
    print(f"variants done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
