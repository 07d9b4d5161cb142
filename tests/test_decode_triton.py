"""The decoding steps' Triton kernels on the CPU (skipped where triton does not import): the
attention (kernels/decode_attention.py) through Triton's interpreter, fp32, against a float64
reference and a slot's beams alone vs among other slots' bit for bit; and the attention and
the GEMMs of a step's tiles (kernels/triton_matmul.STEP_CONFIGS) compiled for sm_90, where
the interpreter checks nothing of the compiled path (no GPU needed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .conftest import triton_interpreted
from .decode_steps import STEPS, close_to_reference, slots_alone_as_in_their_step

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")


def reference_cases() -> None:
    for heads, kv_heads, dim, window in [(16, 8, 256, 64), (4, 1, 256, None), (8, 2, 512, None)]:
        err = close_to_reference(heads, kv_heads, dim, window, torch.float32, "cpu")
        assert err < 1e-5, (heads, kv_heads, dim, window, err)


def invariance_cases() -> None:
    for beam_slot in STEPS:
        for window in (None, 50):
            slots_alone_as_in_their_step(window, beam_slot, "cpu")


def test_decode_attention_equals_reference_interpreted():
    triton_interpreted(__name__, "reference_cases")


def test_a_slots_bits_do_not_depend_on_its_step_interpreted():
    triton_interpreted(__name__, "invariance_cases")


def _compile(kernel, types: dict[str, str], consts: dict, warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    assert compiled.asm["cubin"]


@pytest.mark.parametrize(("group", "dim", "windowed"),
                         [(2, 256, True), (4, 256, False), (2, 512, True), (1, 128, False)])
def test_decode_attention_compiles_for_sm90(group, dim, windowed):
    """At the models' head layouts (Gemma 3 12B, 270M, Gemma 4's global layers, no GQA),
    and with one generated token so far (Triton then takes ``n_gen`` as a constant)."""
    import triton

    from spinf_worker.kernels import decode_attention as da

    types = {name: "*bf16" for name in ("q_ptr", "kk_ptr", "kv_ptr", "gk_ptr", "gv_ptr",
                                        "o_ptr")}
    types |= {name: "*i64" for name in ("gen_rows_ptr", "ctx_rows_ptr", "ctx_pos_ptr",
                                        "ctx_len_ptr", "gen_pos_ptr", "beam_slot_ptr",
                                        "q_pos_ptr")}
    types |= {"chunks_ptr": "*i32", "scale": "fp32"}
    for n_gen in ({}, {"n_gen": 1}):
        consts = dict(BEAMS=da.beams_per_program(group), GROUP=group,
                      GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=dim, DIM_P2=dim,
                      BLOCK=da.block_keys(dim), GEN_BLOCK=16, WINDOWED=windowed, **n_gen)
        _compile(da._decode_kernel, types, consts, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_step_gemm_tiles_compile_for_sm90(dtype):
    from spinf_worker.kernels import fused, triton_matmul

    bm, bn, bk, gm, warps, stages = triton_matmul.STEP_CONFIGS[dtype]
    operand = {torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv"}[dtype]
    quant = dtype == torch.float8_e4m3fn
    types = {"a_ptr": operand, "w_ptr": operand, "out_ptr": "*bf16", "h_ptr": "*bf16",
             "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "amax_ptr": "*fp32"}
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm)
    _compile(triton_matmul._matmul_kernel, types,
             dict(HAS_SCALE=quant, A_SCALAR=False, **tiles), warps)
    _compile(fused._gate_up_act_kernel, types,
             dict(HAS_SCALE=quant, A_SCALAR=False, AMAX=quant, STATIC_OUT=False, ACT=0,
                  **tiles), warps)
