"""Launch configurations (kernels/configs.py): buckets, split-K, the autotuner's choice."""

import pytest
import torch

import qlab.kernels as qk
from qlab.kernels import configs


def test_buckets_give_decode_and_prefill_different_configs():
    assert [configs.m_bucket(m) for m in (1, 2, 16, 17, 128, 129, 4096)] == [
        "decode", "small", "small", "medium", "medium", "large", "large"
    ]
    for kernel in ("w4a16", "fp8"):
        decode, prefill = configs.configs_for(kernel, 1), configs.configs_for(kernel, 4096)
        assert not set(decode) & set(prefill)
        assert all(1 <= len(configs.configs_for(kernel, m)) <= 3 for m in (1, 8, 64, 512))
    with pytest.raises(KeyError, match="known: fp8, w4a16"):
        configs.configs_for("int3", 1)


def test_every_config_is_a_legal_tile():
    for (kernel, bucket), cands in configs.CONFIGS.items():
        for c in cands:
            assert c.block_k >= 16 and c.block_k & (c.block_k - 1) == 0, c
            # the W4A16 decode GEMV loads straight into registers: no pipeline stages
            stages = 1 if (kernel, bucket) == ("w4a16", "decode") else 2
            assert c.num_warps in (2, 4, 8) and c.num_stages >= stages, c
            if bucket != "decode" or kernel == "fp8":  # wgmma: 64 rows per warpgroup
                assert c.block_n % (16 * c.num_warps) == 0, c


def test_split_k_aims_for_two_programs_per_sm():
    assert configs.split_k_for(128, 32, sms=132) == 4  # 4096x4096 GEMV: 512 programs
    assert configs.split_k_for(64, 32, sms=132) == 8  # FP8 swap-AB at N = 4096
    assert configs.split_k_for(896, 64, sms=132) == 1  # enough tiles already
    assert configs.split_k_for(2, 2, sms=132) == 2  # limited by the K steps there are
    assert configs.split_k_for(1, 96, sms=132) == configs.MAX_SPLIT_K == 16
    assert configs.split_k_for(1, 24, sms=132) == 8  # must divide the 24 K steps


def test_choose_times_the_bucket_once_and_remembers(monkeypatch):
    monkeypatch.setattr(configs, "_CHOSEN", {})
    monkeypatch.setattr(configs, "autotune_enabled", lambda: True)
    cands = configs.configs_for("w4a16", 16)
    fake_ms = {cands[0]: 2.0, cands[1]: 1.0}
    timed = []

    def fake_bench(fn, **kw):
        fn()
        return fake_ms[timed[-1]]

    monkeypatch.setattr(configs.triton.testing, "do_bench", fake_bench)
    pick = configs.choose("w4a16", 16, (4096, 4096), timed.append)
    assert pick == cands[1] and timed == list(cands)  # every candidate ran once, fastest won
    assert configs.choose("w4a16", 9, (4096, 4096), timed.append) == cands[1]  # 9 -> 16
    assert len(timed) == 2  # remembered: not timed again
    assert configs.chosen() == {("w4a16", "small", 16, 4096, 4096): cands[1]}


def test_choose_without_autotuning_takes_the_first_config(monkeypatch):
    monkeypatch.setattr(configs, "_CHOSEN", {})
    monkeypatch.setattr(configs, "autotune_enabled", lambda: False)
    ran = []
    assert configs.choose("fp8", 4096, ("k",), ran.append) == configs.configs_for("fp8", 4096)[0]
    assert ran == []  # nothing timed


@pytest.mark.parametrize("cuda, interpret, env, on", [
    (False, True, "1", False),  # the CPU interpreter: timings would measure numpy
    (True, False, "1", True),
    (True, False, "0", False),  # QLAB_AUTOTUNE=0: the defaults, as the GPU session's tests
    (True, True, "1", False),
])  # fmt: skip
def test_autotuning_only_natively_on_a_gpu(monkeypatch, cuda, interpret, env, on):
    monkeypatch.setattr(configs._backend, "HAS_CUDA", cuda)
    monkeypatch.setattr(configs._backend, "INTERPRET", interpret)
    monkeypatch.setenv("QLAB_AUTOTUNE", env)
    assert configs.autotune_enabled() is on


def test_recording_sees_what_ran(monkeypatch):
    monkeypatch.setenv("QLAB_AUTOTUNE", "0")  # the default config, on a GPU too
    monkeypatch.setattr(configs, "_CHOSEN", {})
    x = torch.randn(1, 256).half().to(qk.DEVICE)
    w = qk.pack_w4a16(torch.randn(64, 256).to(qk.DEVICE), 128)
    with configs.recording() as log:
        qk.w4a16_linear(x, w)
    assert [launch.describe() for launch in log] == [{
        "kernel": "_w4a16_gemv_mma_kernel", "grid": [1, 2],  # 1 row block, K split in 2
        "config": {"block_m": 1, "block_n": 128, "block_k": 128, "num_warps": 4,
                   "num_stages": 1, "group_m": 8}}]  # fmt: skip
    assert configs.Config(16, 64, 128).as_dict()["num_stages"] == 3
