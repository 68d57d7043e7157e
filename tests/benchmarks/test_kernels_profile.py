"""The pure pieces of benchmarks/kernels/profile_decode.py: kernel names -> categories, the step window
between the marker kernels, the per-step breakdown, CPU self times and the bandwidth floor's bytes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.benchmarks.loader import load_benchmark

prof = load_benchmark("kernels/profile_decode.py")
KERNELS = Path(__file__).resolve().parents[2] / "src" / "rapidfire_hf" / "kernels"

# kernel names as torch.profiler shows them on Hopper (cuBLAS / cuBLASLt, PyTorch's attention backends,
# inductor's fused kernels, eager ATen kernels, the project's Triton kernels), each with its category
NAMES = {
    "gemm": [
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNN",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)",
        "cutlass3x_sm90_tensorop_s64x128x16gemm_bf16_bf16_f32_bf16_bf16_128x64x64_1x1x1_0_tnn_align8_warpspecialized",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, "
        "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, float> >(float, float)",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, "
        "false, false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*)",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
        "triton_tem_fused_mm_0",
        "aten::mm",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, "
        "cutlass::bfloat16_t, Flash_kernel_traits<64, 64, 128, 4, cutlass::bfloat16_t> >, true, false>(Flash_fwd_params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
        "_partial_kernel",  # kernels/triton_flash_decode.py
        "_merge_kernel",
        "_flash_decode_kernel",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "norm_rope_elementwise": [
        "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        "triton_poi_fused_add_cat_index_copy_mul_neg_slice_4",
        "triton_poi_fused_mul_silu_5",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
        "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, "
        "float, float>, unsigned int, c10::BFloat16, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps"
        "<float, float, float, float>, unsigned int, c10::BFloat16, 4, 4>)",
        "void at::native::(anonymous namespace)::indexSelectSmallIndex<float, long, unsigned int, 2, 2, -2>"
        "(at::cuda::detail::TensorInfo<float, unsigned int>)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType"
        "<2u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*)",
        "aten::rsqrt",
        "aten::mul",
    ],
    "sampling": [
        "_sample_kernel",  # kernels/triton_sampling.py
        "_fused_sample_kernel",
        "triton_red_fused__log_softmax_add_argmax_log_neg_6",
        "triton_per_fused__log_softmax_gather_7",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::"
        "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
        "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)",
        "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, "
        "at::native::templates::cuda::uniform_and_transform<float, float, at::CUDAGeneratorImpl*>(...)>",
        "aten::_log_softmax",
        "aten::uniform_",
    ],
    "other": [
        "Memcpy DtoD (Device -> Device)",
        "Memcpy HtoD (Pageable -> Device)",
        "Memset (Device)",
        "aten::as_strided",
    ],
}


@pytest.mark.parametrize("category,name", [(c, n) for c, names in NAMES.items() for n in names])
def test_classify_kernel_by_name(category, name):
    assert prof.classify_kernel(name) == category


def test_project_kernel_names_are_the_triton_kernels_of_the_kernel_modules():
    """A renamed kernel would silently fall into "other": the table must name real @triton.jit functions."""
    jitted = set()
    for module in ("triton_flash_decode.py", "triton_sampling.py"):
        tree = ast.parse((KERNELS / module).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list
            ):
                jitted.add(node.name)
    assert set(prof.PROJECT_KERNELS) <= jitted, jitted


def _ev(name, ts, dur):
    return {"name": name, "ts": float(ts), "dur": float(dur)}


def test_step_window_keeps_the_kernels_between_the_markers():
    events = [
        _ev("before", 0, 5),
        _ev("spin_kernel(long)", 10, 1),
        _ev("nvjet_a", 12, 3),
        _ev("_sample_kernel", 20, 2),
        _ev("spin_kernel(long)", 30, 1),
        _ev("after", 35, 4),
    ]
    window, span = prof.step_window(events, prof.GPU_MARKER)
    assert [e["name"] for e in window] == ["nvjet_a", "_sample_kernel"]
    assert span == 30 - 11
    rest, none = prof.step_window(events[:1], prof.GPU_MARKER)  # no markers: everything, no span
    assert rest == events[:1] and none is None


def test_breakdown_categories_sum_to_the_kernel_time_and_gap_is_the_rest_of_the_wall_time():
    events = [  # two steps; the two GEMMs overlap by 1 us (busy time counts it once)
        _ev("nvjet_tst_64x8", 0, 10),
        _ev("sm90_xmma_gemm_bf16", 9, 6),
        _ev("_partial_kernel", 20, 4),
        _ev("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3", 30, 2),
        _ev("_sample_kernel", 40, 8),
        _ev("Memset (Device)", 50, 2),
    ]
    out = prof.breakdown(events, steps=2, wall_ms=0.05)
    per_cat = {c: out[f"{c}_ms"] for c in prof.CATEGORIES}
    assert per_cat == pytest.approx(
        {"gemm": 0.008, "attention": 0.002, "norm_rope_elementwise": 0.001, "sampling": 0.004, "other": 0.001}
    )
    assert sum(per_cat.values()) == pytest.approx(out["kernel_ms"]) and out["kernel_ms"] == pytest.approx(
        0.016
    )
    assert out["gap_ms"] == pytest.approx(0.05 - 0.016)
    assert out["busy_ms"] == pytest.approx(0.0155)
    assert out["kernels_per_step"] == 3
    assert out["top_kernels"][0]["name"] == "nvjet_tst_64x8" and out["top_kernels"][0]["us_per_step"] == 5
    assert prof.breakdown(events, steps=2, wall_ms=None)["gap_ms"] is None


def test_self_times_give_nested_cpu_ops_their_own_time():
    events = [
        _ev("aten::linear", 0, 100),
        _ev("aten::t", 1, 4),
        _ev("aten::matmul", 10, 80),
        _ev("aten::mm", 11, 70),
        _ev("aten::add", 120, 5),
    ]
    own = {e["name"]: e["dur"] for e in prof.self_times(events)}
    assert own == {"aten::linear": 16, "aten::t": 4, "aten::matmul": 10, "aten::mm": 70, "aten::add": 5}
    assert sum(own.values()) == 100 + 5


@pytest.mark.parametrize("shape", ["llama-1.1b", "llama-7b", "smoke"])
def test_floor_bytes_from_the_config_match_the_model_parameters(shape):
    config_shape = prof.LLAMA_SHAPES[shape]
    with torch.device("meta"):
        model = prof.build_model(config_shape, "meta", torch.bfloat16, 640)
    for batch in (8, 256):
        assert prof.llama_weight_bytes(config_shape, batch, 2) == prof.weight_read_bytes(model, batch)


def test_kv_bytes_and_floor_arithmetic():
    shape = prof.LLAMA_SHAPES["llama-1.1b"]  # 22 layers, 4 KV heads of 64: 22 * 2 * 4 * 64 * 2 bytes a slot
    assert prof.kv_read_bytes(shape, 8, 512, 2) == 22 * 2 * 4 * 64 * 2 * 8 * 512
    assert prof.floor_ms(4.8e12 * 1e-3, 4.8) == pytest.approx(1.0)  # 4.8 GB at 4.8 TB/s: one millisecond
    assert prof.kv_slots_read("compile", 128, 384, range(9, 25)) == 512
    # recorded uncompiled: filled slots rounded up to the 64-slot bucket (128 + 9..24 -> 192)
    assert prof.kv_slots_read("cuda_graph", 128, 384, range(9, 25)) == 192
