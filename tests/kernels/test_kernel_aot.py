"""Ahead-of-time compilation for real GPUs, on a machine without one.

triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)) runs the whole GPU
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas) without a driver. It needs
real @triton.jit kernels, which the interpreter replaces, so it runs in a subprocess
with TRITON_INTERPRET=0. The PTX proves the tensor cores are used: wgmma on Hopper
(sm_90), tcgen05.mma on Blackwell (sm_100), mma.sync on Ampere (sm_80).
"""

import json
import os
import subprocess
import sys

import pytest

COMPILE_ALL = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qlab.kernels import dequant, fp8, w4a16

def compile_(fn, sig, consts, cc):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32)).asm["ptx"]

def mma(ptx):
    return sorted(set(re.findall(r"(?:wgmma\.mma_async|tcgen05\.mma|mma\.sync)\S*", ptx)))

i32 = "i32"
out = {}
dq_sig = dict(packed_ptr="*u8", scales_ptr="*fp16", out_ptr="*fp32", R=i32, K=i32,
              stride_pr=i32, stride_sr=i32, stride_or=i32)
dq_c = dict(GROUP_SIZE=128, BLOCK_R=16, BLOCK_K=128)
for cc in (80, 90, 100):
    out[f"dequant_{cc}"] = len(compile_(dequant._dequant_int4_kernel, dq_sig, dq_c, cc))
for dt in ("fp16", "bf16"):
    g_sig = dict(x_ptr="*" + dt, packed_ptr="*u8", scales_ptr="*fp16", out_ptr="*" + dt,
                 M=i32, N=i32, K=i32, stride_xm=i32, stride_pn=i32, stride_sn=i32,
                 stride_om=i32)
    g_c = dict(GROUP_SIZE=128, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, UPCAST_DOT=False)
    for cc in (80, 90, 100):
        out[f"w4a16_gemm_{dt}_{cc}"] = mma(compile_(w4a16._w4a16_gemm_kernel, g_sig, g_c, cc))
v_sig = dict(x_ptr="*fp16", packed_ptr="*u8", scales_ptr="*fp16", out_ptr="*fp16",
             N=i32, K=i32, stride_pn=i32, stride_sn=i32)
out["w4a16_gemv_90"] = len(compile_(w4a16._w4a16_gemv_kernel, v_sig,
                                    dict(GROUP_SIZE=128, BLOCK_N=32, BLOCK_K=128), 90))
a_sig = dict(x_ptr="*bf16", scale_ptr="*fp32", q_ptr="*fp8e4nv", M=i32, K=i32,
             stride_xm=i32, stride_s=i32, stride_qm=i32)
ptx = compile_(fp8._act_quant_fp8_kernel, a_sig, dict(BLOCK_M=16, BLOCK_K=128), 90)
out["act_quant_90_div"] = sorted(set(re.findall(r"div\.\w+\.f32", ptx)))
r_sig = dict(x_ptr="*bf16", scale_ptr="*fp32", K=i32, stride_xm=i32)
out["row_scale_90"] = len(compile_(fp8._row_scale_kernel, r_sig, dict(BLOCK_K=256), 90))
f_sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", sa_ptr="*fp32", sb_ptr="*fp32",
             out_ptr="*bf16", M=i32, N=i32, K=i32, stride_am=i32, stride_bn=i32,
             stride_sa=i32, stride_sb=i32, stride_om=i32)
for cc in (89, 90, 100):
    ptx = compile_(fp8._fp8_gemm_kernel, f_sig, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128), cc)
    out[f"fp8_gemm_{cc}"] = mma(ptx)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", COMPILE_ALL], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_fp8_gemm_uses_e4m3_tensor_cores(compiled):
    hopper = compiled["fp8_gemm_90"]
    assert any(i.startswith("wgmma.mma_async") and "e4m3.e4m3" in i for i in hopper), hopper
    assert any("tcgen05.mma" in i and "f8f6f4" in i for i in compiled["fp8_gemm_100"])
    assert any(i.startswith("mma.sync") and "e4m3.e4m3" in i for i in compiled["fp8_gemm_89"])


@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_w4a16_gemm_uses_16bit_tensor_cores(compiled, dt):
    operands = {"fp16": "f16.f16", "bf16": "bf16.bf16"}[dt]  # PTX spells fp16 as f16
    assert any(operands in i for i in compiled[f"w4a16_gemm_{dt}_80"] if "mma.sync" in i)
    assert any(operands in i for i in compiled[f"w4a16_gemm_{dt}_90"] if "wgmma" in i)
    assert any("tcgen05.mma" in i for i in compiled[f"w4a16_gemm_{dt}_100"])


def test_other_kernels_compile(compiled):
    assert all(compiled[f"dequant_{cc}"] > 0 for cc in (80, 90, 100))
    assert compiled["w4a16_gemv_90"] > 0 and compiled["row_scale_90"] > 0
    # Activation scaling must be a correctly rounded division, like qlab's.
    assert compiled["act_quant_90_div"] == ["div.rn.f32"]
