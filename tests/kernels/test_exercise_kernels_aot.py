"""What the exercise kernels (solutions/09 and 10) compile to on Hopper, as their notebooks
say: chapter 09 (exercise 09's GEMM: `mma.sync` at its 16 x 32 tiles, every `wgmma` waited
for at 64 x 64) and exercises 10's introduction (the FP8 GEMM converts E4M3 to fp16 and
uses the fp16 `mma.sync`). The solution kernels are built for sm_90 without a GPU, in a
child Python with TRITON_INTERPRET=0, through kernels/aot.py's own build (Triton caches).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qlab.kernels import aot

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {  # solutions notebook -> the kernel whose cell the test compiles
    "09_w4a16_kernel": "def gemm_kernel(",
    "10_fp8_kernel": "def fp8_gemm_kernel(",
}

CHILD = """
import json, re, sys
import torch
from qlab.kernels import aot
from qlab.kernels.configs import Launch
sys.path.insert(0, sys.argv[1])
import exercise_kernels as ex
F, f8, M, N, K = aot._Fake, torch.float8_e4m3fn, 4096, 4096, 4096
out = {}
for bm, bn in ((16, 32), (64, 64)):  # exercise 09's wrapper tile, a wgmma-sized one
    args = (F(torch.float16, (M, K)), F(torch.uint8, (N, K // 2)),
            F(torch.float16, (N, K // 128)), F(torch.float32, (M, N)), M, N, K)
    out[f"09_{bm}x{bn}"] = aot._build(Launch(ex.gemm_kernel, (1, 1), args, dict(
        GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64)), 90)
args = (F(f8, (M, K)), F(f8, (N, K)), F(torch.float32, (M,)), F(torch.float32, (N,)),
        F(torch.float32, (M, N)), M, N, K)
out["10_16x32"] = aot._build(Launch(ex.fp8_gemm_kernel, (1, 1), args, dict(
    BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)), 90)  # exercise 10's wrapper tile
print(json.dumps({k: {"ptx": b["ptx"], "main_loop": b["main_loop"],
                      "ptxas": b["ptxas"]["messages"]} for k, b in out.items()}))
"""


def _kernel_source(notebook: str, header: str) -> str:
    """The @triton.jit function of the solution cell that defines `header` (not its wrapper)."""
    cells = json.loads((ROOT / "solutions" / f"{notebook}.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if header in "".join(c["source"]))
    start = source.index("@triton.jit")
    return source[start:].split("\n\n\ndef ", 1)[0] + "\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("exercise_kernels")
    body = "".join(_kernel_source(nb, h) + "\n\n" for nb, h in KERNELS.items())
    header = "import triton\nimport triton.language as tl\n\n\n"
    (folder / "exercise_kernels.py").write_text(header + body)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    env.setdefault("CUDA_VISIBLE_DEVICES", "")
    child = subprocess.run([sys.executable, "-c", CHILD, str(folder)], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_exercise_09_gemm_uses_mma_sync_at_its_tiles_and_drains_every_wgmma_at_64(built):
    small = built["09_16x32"]
    assert "wgmma" not in small["ptx"]
    assert all(m.startswith("mma.sync") for m in aot.mma_instructions(small["ptx"]))
    assert aot.mma_instructions(small["ptx"])  # tensor cores, Ampere-style
    big = built["09_64x64"]
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned \d+", aot.k_loop(big["ptx"])))
    assert waits == {"wgmma.wait_group.sync.aligned 0"}  # the PTX waits for every wgmma
    assert big["main_loop"]["mma"] > 0 and big["main_loop"]["drains"] == 1  # once per K step


def test_exercise_10_fp8_gemm_converts_to_fp16_and_uses_the_fp16_mma(built):
    gemm = built["10_16x32"]
    assert "cvt.rn.f16x2.e4m3x2" in gemm["ptx"]  # E4M3 -> fp16, exact
    fp16_mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    assert aot.mma_instructions(gemm["ptx"]) == [fp16_mma]
