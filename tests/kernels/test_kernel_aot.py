"""Ahead-of-time builds for real GPUs, on a machine without one (qlab.kernels.compile_for).

compile_for builds exactly the launch the wrapper would make for a shape (its plan, the
bucket's default config, the split-K an H100 gets, Triton's own argument specialization)
and runs Triton's whole GPU pipeline to PTX and a cubin. These tests read what the GPU
runs, the cubin's SASS (cuobjdump) and ptxas's own report, for every config the autotuner
may pick at the benchmark's quick shapes, and the PTX where it still says something (load
widths, the tensor-core instruction). All builds run in one module fixture (Triton and
compile_for cache them on disk, so a second run rebuilds nothing).
"""

import os
import re
import shutil
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch

from qlab.kernels import W4A16Weight, aot, bench, compile_for, configs
from qlab.kernels import w4a16 as w4a16_module

H100_SMS = configs.H100_SMS
SQUARE = dict(N=4096, K=4096)
DOWN = dict(N=8192, K=28672)  # Llama-2-70B down projection: the largest decode GEMV
REQUESTS = {
    "gemv": dict(kernel="w4a16", M=1, **SQUARE),
    "gemv_fp16": dict(kernel="w4a16", M=1, dtype="fp16", **SQUARE),
    "gemv_down": dict(kernel="w4a16", M=1, **DOWN),
    # no decode layout (K = 192 is not a multiple of 128): TinyLM's MLP up-projection at
    # chapter 13's group of 64
    "gemv_plain_g64": dict(kernel="w4a16", M=1, N=768, K=192, group_size=64),
    # the plain GEMV with split-K (K = 4032 = 126 steps of 32, split 2): two loops in its SASS
    "gemv_plain_split": dict(kernel="w4a16", M=1, N=4096, K=4032, group_size=32),
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


# every config the autotuner may pick (configs_for) at the benchmark's quick shapes and M,
# both FP8 accumulation modes: what a GPU session can launch
EVERY = {}
for _label, _n, _k in bench.SHAPES_QUICK:
    for _m in bench.M_QUICK:
        for _kernel in ("w4a16", "fp8"):
            for _i, _c in enumerate(configs.configs_for(_kernel, _m)):
                for _fast in (False, True) if _kernel == "fp8" else (False,):
                    EVERY[f"every_{_kernel}_{_n}x{_k}_M{_m}_{_i}_{_fast}"] = dict(
                        kernel=_kernel, M=_m, N=_n, K=_k, config=_c.as_dict(),
                        **({"fast_accum": True} if _fast else {}),
                    )  # fmt: skip
REQUESTS.update(EVERY)


@pytest.fixture(scope="module")
def built() -> dict:
    results = aot.compile_many(list(REQUESTS.values()))
    return dict(zip(REQUESTS, results, strict=True))


@pytest.mark.parametrize("name", ["gemv", "gemv_fp16", "gemv_down"])
def test_gemv_reads_weights_16_bytes_at_a_time_and_fills_an_h100(built, name):
    gemv = built[name]
    assert gemv["kernel"] == "_w4a16_gemv_mma_kernel"  # the decode layout, tensor cores
    loads = aot.global_load_widths(gemv["ptx"])
    # weights (decode layout) straight into registers, 16 bytes a load; never a byte
    assert loads.get("ld.global 16B", 0) >= 8 and "ld.global 1B" not in loads, loads
    programs = gemv["grid"][0] * gemv["grid"][1]
    assert programs >= 2 * H100_SMS, gemv["grid"]
    if name == "gemv":
        assert gemv["grid"] == [32, 16]  # 32 blocks of 128 rows, K split 16 ways


def _launches(built):
    for name, r in built.items():
        for launch in r["launches"]:
            yield name, launch


def test_every_listed_config_is_built(built):
    expected = sum(
        len(configs.configs_for(kernel, m)) * (2 if kernel == "fp8" else 1)
        for _, _, _ in bench.SHAPES_QUICK for m in bench.M_QUICK for kernel in ("w4a16", "fp8")
    )  # fmt: skip
    assert sum(name.startswith("every_") for name in built) == expected == len(EVERY)


def test_no_launch_spills_registers(built):
    # STACK + LOCAL from the cubin, and ptxas's own count of spill stores
    spilled = {(name, lc["kernel"]): (lc["spill_bytes"], lc["ptxas"]["spill_stores"])
               for name, lc in _launches(built)
               if lc["spill_bytes"] or lc["ptxas"]["spill_stores"]}  # fmt: skip
    assert not spilled, spilled
    for _, launch in _launches(built):
        assert launch["n_spills"] == launch["spill_bytes"]
        assert 0 < launch["n_regs"] <= 255 and launch["shared"] <= 227 * 1024  # Hopper's limits


def test_compile_for_reports_what_the_gpu_runs(built):
    gemv = built["gemv"]
    assert gemv["cubin"][:4] == b"\x7fELF"  # the binary the driver would load
    assert "Function : _w4a16_gemv_mma_kernel" in gemv["sass"]
    loop = gemv["main_loop"]
    assert loop == aot.sass_main_loop(gemv["sass"])
    assert loop["instructions"] == sum(loop["mix"].values()) > 0
    # the GEMV's weights: 16-byte loads into registers (LDG.E.128), mma.sync (HMMA.16816)
    assert loop["mix"].get("LDG.E.128", 0) > 0 and loop["mma"] == 16
    assert loop["load_bytes"] >= 16 and loop["drains"] == 0
    assert isinstance(gemv["ptxas"]["messages"], list)


def test_main_loop_of_the_plain_gemv_is_its_k_loop(built):
    # no MMA anywhere. With split-K, the K loop (cp.async weights) and, after it, the
    # split-K reduction loop: the main loop must be the K loop
    split = built["gemv_plain_split"]
    assert split["grid"][1] == 2 and split["kernel"] == "_w4a16_gemv_kernel"
    assert any(op.startswith("LDGSTS") for op in split["main_loop"]["mix"]), split["main_loop"]
    # TinyLM's 768 x 192 (no split): the K loop, 157 instructions
    plain = built["gemv_plain_g64"]
    assert plain["kernel"] == "_w4a16_gemv_kernel"
    loop = plain["main_loop"]
    assert loop["mma"] == 0 and any(op.startswith("LDGSTS") for op in loop["mix"]), loop["mix"]
    meta = plain["meta"]
    bytes_per_thread = meta["BLOCK_N"] * meta["BLOCK_K"] // 2 // (32 * meta["num_warps"])
    # docs/KERNELS.md and notebook 09: 157 per 8 bytes of packed weight, 19.6 per byte
    assert (loop["instructions"], bytes_per_thread) == (157, 8), loop["mix"]


SASS_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   LDG.E.U16 R8, desc[UR4][R2.64] ;
        /*0030*/               @P0 LDGSTS.E.BYPASS.128 [R9], desc[UR8][R12.64] ;
        /*0040*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0070*/              @!P1 BRA 0x10 ;
        /*0080*/                   LDG.E R8, desc[UR4][R2.64] ;
        /*0090*/               @P1 BRA 0x80 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0;
"""


def test_sass_main_loop_counts_one_iteration():
    loop = aot.sass_main_loop(SASS_LISTING)
    # two loops (0x10-0x70 and 0x80-0x90): the one with the MMA is the main loop
    assert (loop["start"], loop["end"]) == (0x10, 0x70)
    assert loop["instructions"] == 7 and loop["mma"] == 1
    assert loop["load_bytes"] == 16 + 2 + 16  # predicated loads count: they may run
    assert loop["drains"] == 1  # "gsb0, 0x1" leaves one wgmma group in flight: no drain
    with pytest.raises(ValueError, match="no loop"):
        aot.sass_main_loop("        /*0000*/                   EXIT ;")


SPLIT_K_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/               @P1 BRA 0x10 ;
        /*0030*/                   ISETP.NE.U32.AND P0, PT, R26, 0x1, PT ;
        /*0040*/               @P0 BRA 0x80 ;
        /*0050*/                   STG.E.U16 desc[UR12][R10.64], R15 ;
        /*0060*/                   EXIT ;
        /*0070*/                   NOP ;
        /*0080*/                   STG.E desc[UR12][R12.64], R16 ;
        /*0090*/                   ATOMG.E.ADD.STRONG.GPU PT, R9, desc[UR12][R24.64], R9 ;
        /*00a0*/               @P0 EXIT ;
        /*00b0*/                   LDG.E.STRONG.GPU R31, desc[UR12][R30.64] ;
        /*00c0*/                   EXIT ;
"""


def test_sass_split_k_path_skips_the_plain_store_and_the_reduction():
    sass = SPLIT_K_LISTING
    path = aot.sass_split_k_path(sass, aot.sass_main_loop(sass))
    # prologue: 0x0; epilogue: 0x30-0x40 (split_k > 1 jumps), then 0x80-0xa0 up to its EXIT
    assert path == {"prologue": 1, "epilogue": 2 + 3}


NOT_GEMMS = ("_w4a16_gemv_kernel", "_dequant_int4_kernel")


def test_no_gemm_serialises_its_tensor_cores(built):
    # ptxas C7514/C7515: wgmma serialised. W4A16 (any M) and fast FP8: no drain of the
    # wgmma pipeline (WARPGROUP.DEPBAR.LE gsb0, 0x0) inside the main loop, on every config.
    gemms = 0
    for name, r in built.items():
        req = REQUESTS[name]
        if req.get("arch", 90) != 90 or r["kernel"] in NOT_GEMMS:
            continue
        gemms += 1
        codes = {m.split(":")[0] for m in r["ptxas"]["messages"]}
        assert not codes & {"C7514", "C7515"}, (name, r["ptxas"]["messages"])
        assert r["main_loop"]["mma"] > 0, name  # the main loop found is the tensor-core loop
        if req["kernel"] == "w4a16" or req.get("fast_accum"):
            assert r["main_loop"]["drains"] == 0, (name, r["main_loop"]["drains"])
    assert gemms >= len(EVERY) - 9  # all but the GEMV launches (3 configs x 3 shapes)


def test_precise_fp8_drains_once_per_k_step_and_fast_never(built):
    # Known cost, not yet removed: promoting each BLOCK_K step's wgmma sum into fp32 reads
    # the wgmma's registers in the same iteration, so ptxas serialises it (C7517; in SASS a
    # WARPGROUP.DEPBAR.LE gsb0, 0x0 in the loop, though the PTX waits with wait_group 1) once
    # per K step. The fast mode chains its wgmmas without a drain.
    for name, r in built.items():
        req = REQUESTS[name]
        if req["kernel"] != "fp8" or req.get("arch", 90) != 90:
            continue
        codes = {m.split(":")[0] for m in r["ptxas"]["messages"]}
        if req.get("fast_accum"):
            assert r["main_loop"]["drains"] == 0 and "C7517" not in codes, name
        else:
            assert r["main_loop"]["drains"] == 1 and "C7517" in codes, name
        assert r["main_loop"]["mma"] == r["config"]["block_k"] // 32  # k32 wgmmas per step


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
    loop = aot.k_loop(built[name]["ptx"])
    # both operands (for W4A16: the packed weights too) arrive by 16-byte cp.async stages
    assert re.search(r"cp\.async\.cg\.shared\.global[^;]*0x10", loop), "no 16-byte cp.async"
    # ... and in the SASS the main loop holds the tensor-core work and those copies
    sass_loop = built[name]["main_loop"]
    assert sass_loop["mma"] > 0 and sass_loop["mix"].get("LDGSTS.E.BYPASS.128", 0) > 0


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
    assert aot.global_load_widths(built["gemv_80"]["ptx"]).get("ld.global 16B", 0) > 0
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
                        128, (n, k), torch.empty(n // 32, 4 * k, dtype=torch.int32))  # fmt: skip
        config = configs.configs_for("w4a16", m)[0]
        x, out = torch.empty(m, k, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)
        launch = w4a16_module.plan(x, w, out, config, H100_SMS)
        assert built[name]["grid"] == list(launch.grid)
        assert built[name]["config"] == config.as_dict()
        assert built[name]["kernel"] == launch.kernel.__name__


def _idle_servers() -> list:
    return [s for idle in aot._Server._IDLE.values() for s in idle]


@pytest.fixture
def counted_servers(monkeypatch):
    """No kept build process before or after; yields the list of those started meanwhile."""
    aot.close_build_processes()
    started, init = [], aot._Server.__init__

    def counting_init(self, *args):
        init(self, *args)
        started.append(self)

    monkeypatch.setattr(aot._Server, "__init__", counting_init)
    monkeypatch.setenv("QLAB_AOT_IDLE_S", "600")  # no idle exit on a slow machine
    yield started
    aot.close_build_processes()


def test_build_processes_are_kept_reused_and_ended(counted_servers, monkeypatch, tmp_path):
    """compile_many keeps its build process for the next call with the same key (a build
    error and pytest's PYTEST_CURRENT_TEST do not matter; a fork of this process takes
    none); another environment gets another; what a process prints is not taken for its
    reply; the idle time, a timeout, Ctrl-C and keep=False end one; a kept process that
    ended cleanly without replying is passed over, a killed one is not retried."""
    started = counted_servers
    small = dict(kernel="dequant", M=1, N=256, K=256)
    kernel = "_dequant_int4_kernel"

    def build(request: dict, **kw) -> str:
        return aot.compile_many([request], workers=1, **kw)[0]["kernel"]

    assert build(small) == kernel
    (a,) = started
    os.kill(a.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
    assert build(small) == kernel  # the caller decides what ends: a was not stopped
    assert started == [a] and a.proc.poll() is None and _idle_servers() == [a]
    with pytest.raises(RuntimeError, match="(?s)build failed:\n.*unexpected keyword"):
        build(dict(small, config={"nonsense": 1}))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    assert build(small) == kernel
    with warnings.catch_warnings():  # forking a threaded process: the child only exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: nothing kept, its copy of a's input pointed at /dev/null
        null = os.stat(os.devnull)
        os._exit(0 if aot._Server._IDLE == {} and os.path.samestat(
            os.fstat(a.proc.stdin.fileno()), null) else 1)  # fmt: skip
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the forked child did not exit")
    assert status == 0
    assert build(small) == kernel
    assert started == [a] and _idle_servers() == [a]
    with monkeypatch.context() as m:  # a process that prints as it starts, idle after 5 s
        (tmp_path / "sitecustomize.py").write_text('print("hello from sitecustomize")\n')
        m.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path),
                                                             os.environ.get("PYTHONPATH")])))
        m.setenv("QLAB_AOT_IDLE_S", "5")
        assert build(small) == kernel
    b = started[-1]
    assert started == [a, b] and b.proc.wait(timeout=60) == 0 and b in _idle_servers()
    b.err.seek(0)
    assert b"hello from sitecustomize" in b.err.read()
    handed, real_take = [], aot._Server.take

    def take_b_once(key):  # takes b from the pool as if it were alive, once
        if handed:
            return real_take(key)
        aot._Server._IDLE[b.key].remove(b)
        handed.append(b)
        b.reused = True
        return b

    with monkeypatch.context() as m:
        m.setattr(aot._Server, "take", staticmethod(take_b_once))
        assert build(small) == kernel  # b ended cleanly, no reply: the next kept one, a
    assert handed == [b] and started == [a, b] and _idle_servers() == [a]
    with pytest.raises(RuntimeError, match="timed out after 0.001 s"):  # 8 builds: > 1 ms
        aot.compile_many([dict(small, N=256 * i) for i in range(1, 9)], timeout=0.001,
                         workers=1)  # fmt: skip
    assert started == [a, b] and a.proc.returncode == -9 and _idle_servers() == []
    assert build(small) == kernel
    c = started[-1]
    real_build = aot._Server.build

    def interrupted(self, *args):  # Ctrl-C while c builds
        raise KeyboardInterrupt

    with monkeypatch.context() as m, pytest.raises(KeyboardInterrupt):
        m.setattr(aot._Server, "build", interrupted)
        build(small)
    assert aot._Server.build is real_build
    assert started == [a, b, c] and c.proc.returncode == -9 and _idle_servers() == []
    assert build(small) == kernel
    d = started[-1]
    assert build(small, keep=False) == kernel  # d, reused and ended
    assert started == [a, b, c, d] and d.proc.returncode == 0 and _idle_servers() == []


def test_the_build_process_key_is_environment_folder_and_kernel_sources(monkeypatch, tmp_path):
    for name in ("aot.py", "w4a16.py"):
        shutil.copy(Path(aot.__file__).with_name(name), tmp_path / name)
    monkeypatch.setattr(aot, "__file__", str(tmp_path / "aot.py"))
    env = {"TRITON_INTERPRET": "0"}
    key = aot._server_key(env)
    assert aot._server_key(dict(env, PYTEST_CURRENT_TEST="x")) == key
    assert aot._server_key(dict(env, TRITON_INTERPRET="1")) != key
    os.utime(tmp_path / "w4a16.py", ns=(10**9, 10**9))  # an edited kernel
    assert aot._server_key(env) != key
    key = aot._server_key(env)
    monkeypatch.chdir(tmp_path)
    assert aot._server_key(env) != key
    for bad in ("0", "inf", "nan", "two minutes"):
        monkeypatch.setenv("QLAB_AOT_IDLE_S", bad)
        with pytest.raises(ValueError, match="QLAB_AOT_IDLE_S must be seconds"):
            aot.compile_many([dict(kernel="dequant", M=1, N=256, K=256)])


def test_compile_for_rejects_unknown_kernels_and_options():
    with pytest.raises(ValueError, match="kernel must be one of"):
        compile_for("int3", 1, 64, 64)
    with pytest.raises(ValueError, match="M must be a positive int"):
        compile_for("w4a16", 0, 64, 64)
    with pytest.raises(TypeError, match="unknown options"):
        compile_for("w4a16", 1, 64, 64, blocks=3)
