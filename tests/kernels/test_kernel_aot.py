"""Ahead-of-time builds for real GPUs, on a machine without one (qlab.kernels.compile_for).

compile_for builds exactly the launch the wrapper would make for a shape (its plan, the
bucket's default config, the split-K an H100 gets, Triton's own argument specialization)
and runs Triton's whole GPU pipeline to PTX and a cubin. These tests read what a kernel
engineer would read in that PTX: vector widths of the weight loads, grid sizes, spills,
the tensor-core instruction, and whether the K loop ever drains the MMA pipeline.
All builds run in one subprocess per module (Triton caches them between runs).
"""

import re

import pytest
import torch

from qlab.kernels import W4A16Weight, aot, compile_for, configs
from qlab.kernels import w4a16 as w4a16_module

H100_SMS = configs.H100_SMS
SQUARE = dict(N=4096, K=4096)
DOWN = dict(N=8192, K=28672)  # Llama-2-70B down projection: the largest decode GEMV
REQUESTS = {
    "gemv": dict(kernel="w4a16", M=1, **SQUARE),
    "gemv_fp16": dict(kernel="w4a16", M=1, dtype="fp16", **SQUARE),
    "gemv_down": dict(kernel="w4a16", M=1, **DOWN),
    "w4_small": dict(kernel="w4a16", M=16, **SQUARE),
    "w4_medium_fp16": dict(kernel="w4a16", M=64, dtype="fp16", **SQUARE),
    "w4_large": dict(kernel="w4a16", M=4096, **SQUARE),
    "w4_large_fp16_g256": dict(kernel="w4a16", M=4096, dtype="fp16", group_size=256, **SQUARE),
    "fp8_1": dict(kernel="fp8", M=1, **SQUARE),
    "fp8_16": dict(kernel="fp8", M=16, **SQUARE),
    "fp8_128": dict(kernel="fp8", M=128, **SQUARE),
    "fp8_4096": dict(kernel="fp8", M=4096, **SQUARE),
    "fp8_4096_fast": dict(kernel="fp8", M=4096, fast_accum=True, **SQUARE),
    "fp8_1_fast": dict(kernel="fp8", M=1, fast_accum=True, **SQUARE),
    "dequant_90": dict(kernel="dequant", M=1, N=256, K=256),
    # other architectures: Ampere (mma.sync), Ada (FP8 mma.sync), Blackwell (tcgen05)
    "w4_small_80": dict(kernel="w4a16", M=16, arch=80, **SQUARE),
    "gemv_80": dict(kernel="w4a16", M=1, arch=80, **SQUARE),
    "w4_large_100": dict(kernel="w4a16", M=4096, arch=100, **SQUARE),
    "fp8_1_89": dict(kernel="fp8", M=1, arch=89, **SQUARE),
    "fp8_4096_100": dict(kernel="fp8", M=4096, arch=100, **SQUARE),
    "dequant_100": dict(kernel="dequant", M=1, N=256, K=256, arch=100),
}


# every config the autotuner may pick, at a shape of its bucket, both FP8 accumulations
BUCKET_M = {"decode": 1, "small": 16, "medium": 64, "large": 4096}
for (_kernel, _bucket), _configs in configs.CONFIGS.items():
    for _i, _c in enumerate(_configs):
        for _fast in (False, True) if _kernel == "fp8" else (False,):
            REQUESTS[f"every_{_kernel}_{_bucket}_{_i}_{_fast}"] = dict(
                kernel=_kernel, M=BUCKET_M[_bucket], config=_c.as_dict(), **SQUARE,
                **({"fast_accum": True} if _fast else {}),
            )  # fmt: skip


@pytest.fixture(scope="module")
def built() -> dict:
    results = aot.compile_many(list(REQUESTS.values()))
    return dict(zip(REQUESTS, results, strict=True))


def _loop_waits(ptx: str) -> set[str]:
    return set(re.findall(r"wgmma\.wait_group\.sync\.aligned \d+", aot.k_loop(ptx)))


@pytest.mark.parametrize("name", ["gemv", "gemv_fp16", "gemv_down"])
def test_gemv_reads_weights_16_bytes_at_a_time_and_fills_an_h100(built, name):
    gemv = built[name]
    assert gemv["kernel"] == "_w4a16_gemv_kernel"
    loads = aot.global_load_widths(gemv["ptx"])
    # packed weights: 16-byte cp.async into the pipeline; never a byte at a time
    assert loads.get("cp.async 16B", 0) > 0 and "ld.global 1B" not in loads, loads
    assert "cp.async" in aot.k_loop(gemv["ptx"])  # the K loop prefetches the next stages
    programs = gemv["grid"][0] * gemv["grid"][1]
    assert programs >= 2 * H100_SMS, gemv["grid"]
    if name == "gemv":
        assert gemv["grid"] == [128, 4]  # 128 blocks of 32 rows, K split 4 ways


def test_no_build_spills_registers(built):
    # every default launch above and every config of configs.CONFIGS (the autotuner's choices)
    assert sum(name.startswith("every_") for name in built) == sum(
        len(c) * (2 if k == "fp8" else 1) for (k, _), c in configs.CONFIGS.items()
    )
    spilled = {name: r["n_spills"] for name, r in built.items() if r["n_spills"]}
    assert not spilled, spilled
    for r in built.values():
        assert 0 < r["n_regs"] <= 255 and r["shared"] <= 227 * 1024  # Hopper's per-SM limits
        for launch in r["launches"]:
            assert launch["n_spills"] == 0, launch


@pytest.mark.parametrize("name", ["fp8_1", "fp8_16", "fp8_128", "fp8_4096", "fp8_1_fast"])
def test_fp8_runs_on_e4m3_wgmma_at_every_m(built, name):
    mma = aot.mma_instructions(built[name]["ptx"])
    assert any(i.startswith("wgmma.mma_async") and "e4m3.e4m3" in i for i in mma), mma
    swap = built[name]["kernel"] == "_fp8_gemm_swap_kernel"
    assert swap == (REQUESTS[name]["M"] <= 128)
    if swap:  # features on the 64-row side, 16 tokens on the narrow one: m64n16
        assert REQUESTS[name]["M"] > 16 or any("m64n16k32" in i for i in mma), mma


@pytest.mark.parametrize(
    "name",
    ["w4_small", "w4_medium_fp16", "w4_large", "w4_large_fp16_g256",
     "fp8_1", "fp8_16", "fp8_128", "fp8_4096", "fp8_4096_fast"],
)  # fmt: skip
def test_gemm_k_loops_are_pipelined(built, name):
    ptx = built[name]["ptx"]
    loop = aot.k_loop(ptx)
    waits = _loop_waits(ptx)
    assert waits and "wgmma.wait_group.sync.aligned 0" not in waits, waits
    # both operands (for W4A16: the packed weights too) arrive by 16-byte cp.async stages
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*0x10", loop), "no 16-byte cp.async"


@pytest.mark.parametrize("name, dtype", [("w4_small", "bf16"), ("w4_medium_fp16", "f16")])
def test_w4a16_gemm_is_swap_ab_on_16_bit_wgmma(built, name, dtype):
    mma = aot.mma_instructions(built[name]["ptx"])
    tokens = REQUESTS[name]["M"]
    assert any(f"m64n{tokens}k16.f32.{dtype}.{dtype}" in i for i in mma), mma


def test_fp8_accumulation_mode_is_what_was_asked(built):
    # precise: each K step's wgmma result is added into a separate fp32 accumulator
    # (add.f32 in the K loop); fast: the MMA accumulates the whole loop itself.
    assert "add.f32" in aot.k_loop(built["fp8_4096"]["ptx"])
    assert "add.f32" not in aot.k_loop(built["fp8_4096_fast"]["ptx"])
    assert built["fp8_4096"]["meta"]["MAX_IMPRECISE"] == 128
    assert built["fp8_4096_fast"]["meta"]["MAX_IMPRECISE"] is None


def test_activation_quantization_is_one_launch_with_a_true_division(built):
    for name, m in (("fp8_1", 1), ("fp8_4096", 4096)):
        launches = built[name]["launches"]
        assert [lc["kernel"] for lc in launches] == [built[name]["kernel"], "_act_quant_kernel"]
        assert launches[1]["grid"] == [m]  # one program per token: amax and quantize fused
    # s = amax / 448 and x / s are correctly rounded divisions, as qlab's
    divisions = set(re.findall(r"div\.\w+\.f32", built["fp8_1"]["launches"][1]["ptx"]))
    assert divisions == {"div.rn.f32"}, divisions


def test_other_architectures(built):
    assert any(i.startswith("mma.sync") and "bf16.bf16" in i
               for i in aot.mma_instructions(built["w4_small_80"]["ptx"]))  # fmt: skip
    assert aot.global_load_widths(built["gemv_80"]["ptx"]).get("cp.async 16B", 0) > 0
    assert any("tcgen05.mma" in i for i in aot.mma_instructions(built["w4_large_100"]["ptx"]))
    assert any(i.startswith("mma.sync") and "e4m3.e4m3" in i
               for i in aot.mma_instructions(built["fp8_1_89"]["ptx"]))  # fmt: skip
    assert any("tcgen05.mma" in i and "f8f6f4" in i
               for i in aot.mma_instructions(built["fp8_4096_100"]["ptx"]))  # fmt: skip
    assert built["dequant_90"]["n_regs"] > 0 and built["dequant_100"]["n_regs"] > 0


def test_compile_for_builds_the_wrappers_launch(built):
    # same config and grid as the wrapper's own plan for that shape
    for name in ("gemv", "w4_small", "w4_large"):
        r = REQUESTS[name]
        n, k, m = r["N"], r["K"], r["M"]
        w = W4A16Weight(torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k // 128).half(),
                        128, (n, k))  # fmt: skip
        config = configs.configs_for("w4a16", m)[0]
        x, out = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
        launch = w4a16_module.plan(x, w, out, config, H100_SMS)
        assert built[name]["grid"] == list(launch.grid)
        assert built[name]["config"] == config.as_dict()
        assert built[name]["kernel"] == launch.kernel.__name__


def test_compile_for_rejects_unknown_kernels_and_options():
    with pytest.raises(ValueError, match="kernel must be one of"):
        compile_for("int3", 1, 64, 64)
    with pytest.raises(ValueError, match="M must be a positive int"):
        compile_for("w4a16", 0, 64, 64)
    with pytest.raises(TypeError, match="unknown options"):
        compile_for("w4a16", 1, 64, 64, blocks=3)
