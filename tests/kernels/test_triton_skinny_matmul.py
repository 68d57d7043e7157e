"""The Triton skinny matmul (``kernels/triton_skinny_matmul.py``) against ``x.float() @ W.float().T``.

On a CPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``) at
tiny shapes; the GPU tests at the end run the compiled kernels at the 1.1B / 7B projection shapes.

Tolerances, against the fp32 product of the same (already rounded) inputs:

- fp32: ``rtol = atol = 1e-4``; only the summation order differs (observed ~1e-7 of ``|x| @ |W|.T``).
- bf16: one bf16 rounding of the fp32 result. Every product is exact in fp32 and the sums are fp32, so
  the only real error is the final cast: under round-to-nearest (the GPU) at most half a unit in the last
  place, ``2**-9`` relative, within ``rtol = 2**-8``; Triton's interpreter casts fp32 to bf16 by
  truncation (a whole unit, ``< 2**-7``), so the CPU tests use ``rtol = 2**-7``. ``atol = 1e-3`` covers
  outputs that cancel to near zero (sums of ~10 magnitude here).
- fp16: ``rtol = 2**-10`` (one fp16 unit), ``atol = 1e-3``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rapidfire_hf.kernels.triton_skinny_matmul import (  # noqa: E402
    PROGRAMS_PER_SM,
    launch_config,
    num_splits,
    skinny_linear,
    skinny_matmul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-4},
    torch.bfloat16: {"rtol": 2**-8 if DEVICE == "cuda" else 2**-7, "atol": 1e-3},
    torch.float16: {"rtol": 2**-10, "atol": 1e-3},
}


def _inputs(m, n, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    return x, w


def _check_close(out, x, w):
    ref = x.float() @ w.float().T
    assert out.dtype == x.dtype and out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out.float(), ref, **TOL[x.dtype])


# N and K odd and not multiples of the blocks (BLOCK_N 64; BLOCK_K 64 in fp32, 128 in bf16): column tails,
# K tails, one and several blocks of each
SHAPES = [(200, 300), (37, 129), (64, 128), (130, 70)]


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_fp32_matches_the_fp32_product(m, n, k, splits):
    x, w = _inputs(m, n, k, seed=m + n + k)
    _check_close(skinny_matmul(x, w, splits=splits), x, w)


@pytest.mark.parametrize("splits", [1, 2, None])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
def test_bf16_matches_the_fp32_product_within_one_rounding(m, splits):
    x, w = _inputs(m, 200, 300, torch.bfloat16, seed=m)
    _check_close(skinny_matmul(x, w, splits=splits), x, w)


def test_fp16_matches_the_fp32_product():
    x, w = _inputs(5, 97, 200, torch.float16, seed=7)
    _check_close(skinny_matmul(x, w, splits=2), x, w)


@pytest.mark.parametrize("splits", [1, 2])
def test_more_rows_than_one_block_walk_row_blocks(splits):
    # 70 rows: two 64-row blocks (the third grid axis), the second one mostly padding
    x, w = _inputs(70, 90, 150, seed=3)
    _check_close(skinny_matmul(x, w, splits=splits), x, w)


def test_default_split_count_splits_on_the_interpreter_and_the_result_is_the_same():
    x, w = _inputs(3, 200, 300, seed=4)
    if DEVICE == "cpu":  # the interpreter counts as 4 SMs: 4 column blocks leave it wanting 2 splits
        assert num_splits(3, 200, 300, 4, 4) == 2
    one, default = skinny_matmul(x, w, splits=1), skinny_matmul(x, w)
    torch.testing.assert_close(default, one, rtol=1e-5, atol=1e-5)


def test_more_splits_than_k_blocks_is_clamped():
    x, w = _inputs(4, 50, 130, seed=5)  # 3 fp32 K blocks
    _check_close(skinny_matmul(x, w, splits=100), x, w)


def test_the_same_inputs_give_bit_identical_outputs():
    x, w = _inputs(8, 200, 300, seed=6)
    first = skinny_matmul(x, w, splits=3)
    assert torch.equal(first, skinny_matmul(x, w, splits=3))


def test_non_contiguous_x_is_read_through_its_strides():
    x, w = _inputs(6, 40, 2 * 75, seed=8)
    every_other = x[:, ::2]  # [6, 75], column stride 2
    transposed = torch.randn(75, 6).to(DEVICE).T  # [6, 75], row stride 1
    w = w[:, :75].contiguous()
    for view in (every_other, transposed, x[1:4, :75]):
        assert not view.is_contiguous()
        _check_close(skinny_matmul(view, w, splits=2), view, w)


def test_skinny_linear_flattens_leading_dims():
    x, w = _inputs(6, 33, 65, seed=9)
    out = skinny_linear(x.reshape(2, 3, 65), w)
    assert out.shape == (2, 3, 33)
    _check_close(out.reshape(6, 33), x, w)
    one_row = skinny_linear(x[0], w)  # [K] -> [N]
    assert one_row.shape == (33,)
    torch.testing.assert_close(one_row, out[0, 0], rtol=1e-5, atol=1e-5)


def test_empty_dimensions_give_empty_or_zero_outputs():
    x, w = _inputs(0, 10, 20)
    assert skinny_matmul(x, w).shape == (0, 10)
    x, w = _inputs(3, 0, 20)
    assert skinny_matmul(x, w).shape == (3, 0)
    x, w = _inputs(3, 10, 0)
    assert torch.equal(skinny_matmul(x, w), torch.zeros(3, 10, device=DEVICE))


def test_bad_inputs_are_refused_with_what_is_wrong():
    x, w = _inputs(4, 10, 20)
    cases = [
        ((x[0], w), "2-D x"),
        ((x.reshape(2, 2, 20), w), "2-D x .*skinny_linear"),
        ((x, w.reshape(10, 2, 10)), "2-D weight"),
        ((x, w[:, :19].contiguous()), "K = 20 .*K = 19"),
        ((x.double(), w.double()), "supports float32, bfloat16 and float16"),
        ((x.long(), w.long()), "supports float32"),
        ((x, w.bfloat16()), "same dtype"),
        ((x, w.T.contiguous().T), "contiguous weight"),
        ((x, w[:, ::2]), "K = 20 .*K = 10"),
        ((x, torch.empty(10, 20, device="meta")), "x is on .* but weight is on meta"),
        ((x.numpy(), w) if DEVICE == "cpu" else (x.cpu().numpy(), w), "takes tensors"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            skinny_matmul(*args)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        skinny_matmul(x, w, splits=0)
    with pytest.raises(ValueError, match="at least one dimension"):
        skinny_linear(torch.tensor(1.0), w)


def test_launch_parameters_are_a_function_of_the_shapes_and_fill_an_h200():
    sms = 132
    # batch 8 bf16, 1.1B shapes: the 32 column blocks of q/o split K until ~2 programs per SM
    for n, k in [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632)]:
        splits = num_splits(8, n, k, 2, sms)
        blocks = -(-n // 64)
        assert splits == num_splits(8, n, k, 2, sms)  # deterministic
        assert 1 < splits <= -(-k // 128)  # a split has at least one K block
        assert blocks * splits >= min(sms, blocks * (-(-k // 128))), (n, k, splits)
        assert blocks * splits <= 2 * PROGRAMS_PER_SM * sms
    assert num_splits(8, 2048, 2048, 2, sms) == 8  # 32 blocks x 8 splits of 256 = 256 programs
    assert num_splits(8, 32000, 2048, 2, sms) == 1  # 500 column blocks fill the GPU alone
    # the workspace cap: at 64 rows 2048 x 2048 splits at most 4 ways (splits x 64 x N x 4 B x 2 <= W / 2)
    assert num_splits(64, 2048, 2048, 2, sms) == 4
    assert launch_config(1, 2).block_m == 16 and launch_config(17, 2).block_m == 32
    assert launch_config(64, 2).block_m == 64 and launch_config(300, 4).block_m == 64
    assert launch_config(8, 4).block_k == 64 and launch_config(8, 2).block_k == 128


# GPU: the compiled kernels at the decode projections of the 1.1B and 7B Llama
# (q/o, gate/up, k/v, down, lm_head of the 1.1B; q/k/v/o and gate/up of the 7B)
GPU_SHAPES = [(2048, 2048), (5632, 2048), (256, 2048), (2048, 5632), (32000, 2048)]
GPU_SHAPES += [(4096, 4096), (11008, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
@pytest.mark.parametrize("m", [8, 64])
def test_bf16_on_cuda_at_the_projection_shapes(m, n, k):
    x, w = _inputs(m, n, k, torch.bfloat16, seed=n + k + m)
    w = w / k**0.5  # outputs ~N(0, 1), as a linear layer's
    out = skinny_matmul(x, w)
    ref = x.float() @ w.float().T
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-3)
    assert torch.equal(out, skinny_matmul(x, w))  # two-pass split-K: bit-reproducible


@pytest.mark.gpu
def test_fp32_on_cuda_is_not_tf32():
    x, w = _inputs(8, 2048, 2048, seed=1)
    w = w / 2048**0.5  # outputs ~N(0, 1): TF32 (10-bit mantissas) would be off by ~1e-3
    torch.testing.assert_close(skinny_matmul(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_under_torch_compile_fullgraph_matches_eager():
    x, w = _inputs(8, 2048, 2048, torch.bfloat16, seed=2)
    eager = skinny_matmul(x, w)
    compiled = torch.compile(lambda a, b: skinny_matmul(a, b), fullgraph=True)(x, w)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.gpu
def test_replays_from_a_cuda_graph_with_new_inputs():
    x, w = _inputs(8, 5632, 2048, torch.bfloat16, seed=3)
    static_x = x.clone()
    skinny_matmul(static_x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_matmul(static_x, w)
    new_x = torch.randn_like(x)
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, skinny_matmul(new_x, w), atol=0, rtol=0)
