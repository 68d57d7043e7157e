"""Which expert form fails under the compiled decode step on a GPU (tiny MoE cases of the tests, bf16)?

    CUDA_LAUNCH_BLOCKING=1 python3 moe_diag.py CASE FORM BATCH [GEMM]   # one form per process (a CUDA error
                                                                         # poisons it)

GEMM "raw" hands the compiler torch's ``_grouped_mm`` itself (as before ``rapidfire_hf::grouped_mm``), to see
whether the opaque op is what makes the compiled step record; "op" (the default) runs the code as it is.

Prints one JSON line: the form forced (StaticLlama.moe_form; "auto" leaves the default), the decode mode that
ran, fallbacks, the warnings' text, and the greedy tokens' equality with the recorded (cuda_graph) engine."""
import json
import sys
import warnings

sys.path[:0] = ["tests/rollout", "tests"]
import torch  # noqa: E402
from family_cases import build, case  # noqa: E402

from rapidfire_hf.demo import build_char_tokenizer  # noqa: E402
from rapidfire_hf.rollout import RolloutEngine, SamplingParams  # noqa: E402

name, form, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
gemm = sys.argv[4] if len(sys.argv) > 4 else "op"
if gemm == "raw":
    from rapidfire_hf.rollout import moe_decode

    moe_decode._gmm = moe_decode._grouped_mm_eager
tok = build_char_tokenizer()
prompts = ["task: abc ->", "task: zq ->", "hello there, world ->", "x", "task: mnopq ->"][:batch]
enc = tok(prompts, return_tensors="pt", padding=True)
ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
model = build(case(name), len(tok)).cuda().to(torch.bfloat16)
params = SamplingParams(max_new_tokens=32, do_sample=False)
out = {"case": name, "form": form, "batch": batch, "gemm": gemm}
for mode in ("cuda_graph", "compile"):
    engine = RolloutEngine(model, pad_token_id=0, stop_token_ids=[], backend="static", decode_mode=mode)
    if form != "auto":
        engine._static.net.moe_form = form
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            r = engine.generate(ids, mask, params).responses
            out[mode] = {"ran": engine.decode_mode_ran, "fallbacks": str(engine.decode_fallbacks)[:300]}
            out[mode + "_tokens"] = r.tolist()
        except Exception as exc:  # noqa: BLE001
            out[mode] = {"error": repr(exc)[:1500]}
    out[mode]["warnings"] = [str(w.message)[:1500] for w in caught]
if "cuda_graph_tokens" in out and "compile_tokens" in out:
    out["equal"] = out.pop("cuda_graph_tokens") == out.pop("compile_tokens")
print(json.dumps(out))
