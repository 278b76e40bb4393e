"""llama.cpp's own quantizer (ggml-quants.c), compiled here, as the oracle for qlab's K-quant
and importance-matrix encoders (gguf's Python package has numpy encoders for Q8_0, Q4_0,
Q4_1, Q5_0 and Q5_1 only).

`library()` builds it once and caches it in .cache/llamacpp/ (git-ignored): the
llama-cpp-python source distribution from PyPI (llama.cpp vendored; the only download,
checked against its sha256), of which only ggml/src/ggml-quants.c and the headers it
includes are unpacked, compiled as a release build (-O2 -DNDEBUG) with -ffp-contract=off
(strict IEEE float: no fused multiply-add, the arithmetic qlab reproduces) plus a
four-function stub written here.
It needs gcc and about 5 s of CPU. test_gguf_llamacpp.py runs it on fuzzed rows; the
committed data/llamacpp_reference.npz (fixed rows, for machines without a compiler) is
regenerated with

    python tests/gguf/make_llamacpp_reference.py [--sdist llama_cpp_python-X.tar.gz]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "data" / "llamacpp_reference.npz"
VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors llama.cpp (ggml-quants.c)
SDIST = f"llama-cpp-python=={VERSION}"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"  # PyPI's
PYPI_SIMPLE = "https://pypi.org/simple"
CACHE = Path(__file__).resolve().parents[2] / ".cache" / "llamacpp"  # git-ignored
CFLAGS = ["-O2", "-DNDEBUG", "-ffp-contract=off", "-fPIC", "-shared"]
# the only files of the 76 MB sdist the build reads: ggml-quants.c and its headers
NEEDED = ("ggml/src/ggml-quants.c", "ggml/src/ggml-quants.h", "ggml/src/ggml-common.h",
          "ggml/src/ggml-impl.h", "ggml/src/ggml-cpu/ggml-cpu-impl.h", "ggml/include/")
# name: (ggml type id, block, bytes per block)
TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
         "Q8_0": (8, 32, 34), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
         "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}  # fmt: skip
STUB = r"""
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
/* the only ggml symbols ggml-quants.c needs from the rest of ggml, for the types above */
void ggml_abort(const char *file, int line, const char *fmt, ...) { abort(); }
const char *ggml_type_name(int t) { return "?"; }
static size_t ts(int t) { switch (t) { case 2: return 18; case 3: return 20; case 6: return 22;
  case 7: return 24; case 8: return 34; case 11: return 110; case 12: return 144;
  case 13: return 176; case 14: return 210; } abort(); }
static int64_t bs(int t) { return t >= 10 ? 256 : 32; }
size_t ggml_type_size(int t) { return ts(t); }
size_t ggml_row_size(int t, int64_t ne) { return ts(t) * ne / bs(t); }
"""


def inputs(seed: int = 20260515) -> tuple[np.ndarray, np.ndarray]:
    """12 rows of 512: typical weights and the edge cases each format has a rule for."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((12, 512)) * 0.02).astype(np.float32)
    x[1] = rng.standard_normal(512)  # unit scale
    x[2] = rng.standard_normal(512) * np.exp(rng.standard_normal(512))  # heavy tails
    x[3, :256] = 0.0  # an all-zero super-block (and 8 all-zero blocks of 32)
    x[4, :256], x[4, 256:] = 0.3, -0.7  # constant blocks, both signs
    x[5] *= 0.5
    x[5, 7], x[5, 300] = 3.0, -5.0  # one outlier per block
    x[6] = rng.random(512)  # one-sided (post-ReLU-like)
    x[7] = rng.integers(-16, 17, 512) * 0.0625  # exact ties on many grids
    x[8] *= 1e-4  # tiny: subnormal fp16 scales
    x[9] = rng.standard_normal(512) * 3e6  # fp16 overflow of Q8_0's scale (amax / 127)
    x[10] = np.where(rng.random(512) < 0.05, rng.standard_normal(512), 0.0)  # sparse
    x[11, 32:64] = 0.0  # one all-zero sub-block inside a super-block
    imatrix = (rng.random(512) ** 3 * 10).astype(np.float32)  # a few columns matter a lot
    return x.astype(np.float32), imatrix


def build(sdist: Path, work: Path) -> Path:
    """Unpack ggml-quants.c and its headers from the sdist into work, compile -> the .so."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile()
                   and any(f"/vendor/llama.cpp/{n}" in m.name for n in NEEDED)]  # fmt: skip
        tar.extractall(work, members=members, filter="data")
    ggml = next(work.glob("*/vendor/llama.cpp/ggml"))
    (work / "stub.c").write_text(STUB)
    lib = work / "libggml_quants.so"
    subprocess.run(
        ["gcc", *CFLAGS, str(ggml / "src/ggml-quants.c"), str(work / "stub.c"),
         f"-I{ggml / 'include'}", f"-I{ggml / 'src'}", f"-I{ggml / 'src/ggml-cpu'}", "-lm",
         "-o", str(lib)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return lib


def download_sdist(dest: Path) -> Path:
    """The llama-cpp-python sdist (kept in dest for the next run): the file PyPI's simple
    index lists, checked against SDIST_SHA256; where that fails (another index, no direct
    access), through `pip download`, which also builds the sdist's metadata in an isolated
    environment (a minute of CPU: why it is not the first choice)."""
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    path = dest / name
    if path.is_file():
        return path
    dest.mkdir(parents=True, exist_ok=True)
    try:
        accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
        index = urllib.request.Request(f"{PYPI_SIMPLE}/llama-cpp-python/", headers=accept)
        with urllib.request.urlopen(index, timeout=60) as r:
            url = next(f["url"] for f in json.load(r)["files"] if f["filename"] == name)
        with urllib.request.urlopen(url, timeout=600) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != SDIST_SHA256:
            raise OSError(f"{url}: sha256 differs from SDIST_SHA256")
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(data)
        os.replace(partial, path)
    except (OSError, ValueError, KeyError, StopIteration):
        subprocess.run([sys.executable, "-m", "pip", "download", SDIST, "--no-deps",
                        "--no-binary", ":all:", "-d", str(dest)],
                       check=True, capture_output=True, text=True)  # fmt: skip
    return path


def library(cache: Path = CACHE) -> ctypes.CDLL:
    """llama.cpp's quantizers as a ctypes library, built once into cache (keyed by the
    version, the flags and the stub, so a change rebuilds). Raises CalledProcessError (with
    gcc's or pip's output) or OSError when it cannot be built."""
    key = hashlib.sha256(" ".join([VERSION, *CFLAGS, STUB]).encode()).hexdigest()[:12]
    so = cache / f"libggml_quants-{VERSION}-{key}.so"
    if not so.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                built = build(download_sdist(cache), Path(tmp))
            except subprocess.CalledProcessError as e:
                cmd = " ".join(map(str, e.cmd[:3]))
                raise RuntimeError(f"{cmd} ... failed:\n{e.stdout}{e.stderr}") from e
            partial = so.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(built, partial)
            os.replace(partial, so)  # atomic: a parallel run sees the whole file or none
    return ctypes.CDLL(str(so))


def llama_cpp_or_skip():
    """The llama_cpp module (llama-cpp-python) for the tests that run llama.cpp itself.

    `make test` (and so CI) and `make test-llamacpp` build it (`make llamacpp`: a cold
    build took 2 min 25 s on two idle AMD EPYC cores, 268 s of CPU, native, before the
    Makefile's AVX2 rule; 3 min 44 s on two idle 2.0 GHz Xeon cores, 406 s, with it) and
    run these tests with QLAB_LLAMACPP=require, where a missing module FAILS.
    Elsewhere (a plain `pytest`) they skip without it."""
    import pytest  # only the tests call this

    try:
        import llama_cpp
    except ImportError as e:
        reason = f"llama-cpp-python is not installed ({e}): run `make test-llamacpp`"
        if os.environ.get("QLAB_LLAMACPP") == "require":
            pytest.fail(f"{reason}; QLAB_LLAMACPP=require: these tests must run")
        pytest.skip(reason)
    return llama_cpp


def run(lib: ctypes.CDLL, x: np.ndarray, name: str, imatrix: np.ndarray | None) -> np.ndarray:
    _, block, size = TYPES[name]
    rows, k = x.shape
    out = np.zeros((rows, k // block * size), dtype=np.uint8)
    fn = getattr(lib, "quantize_q" + name[1:])
    fn.restype = ctypes.c_size_t
    im = None if imatrix is None else imatrix.ctypes.data_as(ctypes.c_void_p)
    fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int64(rows), ctypes.c_int64(k), im)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help="a llama_cpp_python-*.tar.gz already downloaded")
    args = ap.parse_args()
    if args.sdist is None:
        lib, source = library(), f"llama_cpp_python-{VERSION}.tar.gz"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            so = Path(tmp) / "lib.so"
            shutil.copyfile(build(args.sdist, Path(tmp)), so)
            lib, source = ctypes.CDLL(str(so)), args.sdist.name
    x, imatrix = inputs()
    arrays = {"x": x, "imatrix": imatrix, "source": np.array(source)}
    for name in TYPES:
        arrays[name] = run(lib, x, name, None)
        arrays[name + "_imatrix"] = run(lib, x, name, imatrix)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) from {arrays['source']}")


if __name__ == "__main__":
    main()
