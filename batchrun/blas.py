"""Route MLX's CPU matmuls to OpenBLAS on Linux.

The Linux `mlx-cpu` wheel links the netlib *reference* BLAS (~5 GFLOP/s for fp32 matmul on a
modern core, against ~200 with OpenBLAS), which makes batched decoding no faster than one prompt
at a time. MLX resolves `cblas_sgemm` through the dynamic linker's global scope before its own
bundled library, so loading a library that defines it with RTLD_GLOBAL *before* `mlx.core` is
imported routes every MLX matmul there. No environment variable and no edit of site-packages.

Two sources, in order:

1. PyPI's `scipy-openblas32` (a dependency on Linux). Its symbols carry a `scipy_` prefix, so
   batchrun's C shim (`batchrun/_blasshim.c`) defines `cblas_sgemm` and friends and forwards to
   it; the shim counts calls, which is how `verify()` proves MLX really uses it.
2. A system OpenBLAS (e.g. Debian's `libopenblas0-pthread`), whose symbols are unprefixed.

Invariant: `activate()` runs before the first `import mlx.core` (batchrun's `__init__` calls it);
set `BATCHRUN_BLAS=reference` to keep the bundled BLAS (for comparisons).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import sys
from dataclasses import dataclass

_SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


@dataclass(slots=True)
class BlasInfo:
    name: str  # "OpenBLAS 0.3.30 ...", "Accelerate", "reference BLAS"
    source: str  # "scipy-openblas32", "system", "bundled", "platform"
    threads: int | None = None
    verified: bool | None = None  # None: not checked yet
    note: str = ""

    def describe(self) -> str:
        parts = [self.name]
        if self.threads:
            parts.append(f"{self.threads} threads")
        if self.source not in ("platform",):
            parts.append(f"via {self.source}")
        if self.verified is False:
            parts.append("NOT used by MLX")
        text = ", ".join(parts)
        return f"{text} ({self.note})" if self.note else text


# OpenBLAS's idle threads sleep after 2^THREAD_TIMEOUT cycles (4 is its least; its default 28).
THREAD_TIMEOUT = "4"
_info: BlasInfo | None = None
_shim: ctypes.CDLL | None = None
_system_path = ""


def activate() -> BlasInfo:
    """Load OpenBLAS ahead of MLX; idempotent. Never raises."""
    global _info
    if _info is not None:
        return _info
    if sys.platform == "darwin":
        _info = BlasInfo("Accelerate", "platform")
    elif not sys.platform.startswith("linux"):
        _info = BlasInfo("unknown", "platform")
    elif os.environ.get("BATCHRUN_BLAS", "").lower() == "reference":
        _info = BlasInfo("reference BLAS", "bundled", note="BATCHRUN_BLAS=reference")
    elif "mlx.core" in sys.modules:
        _info = BlasInfo("reference BLAS", "bundled",
                         note="mlx was imported before batchrun; import batchrun first")
    else:
        # Idle OpenBLAS threads spin for 2^28 cycles (~0.1 s) by default. batchrun has two
        # OpenBLAS pools (MLX's and NumPy's, for the shared prefix's attention on the CPU),
        # and on a machine of a few cores one pool's spinning threads starved the other: the
        # labeling benchmark ran ~1.8x slower. Both pools read this when they load.
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
        _info = _load_scipy_openblas() or _load_system_openblas() or BlasInfo(
            "reference BLAS",
            "bundled",
            note="no OpenBLAS found: `pip install scipy-openblas32` for ~5x faster batches",
        )
    return _info


def _load_scipy_openblas() -> BlasInfo | None:
    global _shim
    spec = importlib.util.find_spec("batchrun._blasshim")
    if spec is None or spec.origin is None:
        return None
    try:
        import scipy_openblas32
    except ImportError:
        return None
    lib_path = os.path.join(scipy_openblas32.get_lib_dir(), "libscipy_openblas.so")
    try:
        openblas = ctypes.CDLL(lib_path)
        shim = ctypes.CDLL(spec.origin, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    for kind in ("s", "d", "c"):
        target = ctypes.cast(getattr(openblas, f"scipy_cblas_{kind}gemm"), ctypes.c_void_p)
        ctypes.c_void_p.in_dll(shim, f"batchrun_{kind}gemm_target").value = target.value
    _shim = shim
    openblas.scipy_openblas_get_config.restype = ctypes.c_char_p
    config = openblas.scipy_openblas_get_config().decode()
    threads = openblas.scipy_openblas_get_num_threads()
    return BlasInfo(_short_config(config), "scipy-openblas32", threads)


def _load_system_openblas() -> BlasInfo | None:
    global _system_path
    candidates = [os.environ.get("BATCHRUN_OPENBLAS", ""), *_SYSTEM_OPENBLAS]
    found = ctypes.util.find_library("openblas")
    if found:
        candidates.append(found)
    for path in filter(None, candidates):
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018 - raises AttributeError when absent
        except (OSError, AttributeError):
            continue
        _system_path = os.path.realpath(path)
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode()
        return BlasInfo(_short_config(config), "system", lib.openblas_get_num_threads())
    return None


def _short_config(config: str) -> str:
    # "OpenBLAS 0.3.30  USE64BITINT DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64"
    words = config.split()
    core = next((w for w in words[2:] if w.isalpha() and w[0].isupper()), "")
    return " ".join(filter(None, words[:2] + [core]))


def verify() -> BlasInfo:
    """Run one small fp32 matmul on the CPU and check that it reached OpenBLAS."""
    info = activate()
    if info.source not in ("scipy-openblas32", "system"):
        return info
    import mlx.core as mx

    before = _gemm_calls()
    a = mx.ones((64, 64), dtype=mx.float32)
    mx.eval(mx.matmul(a, a, stream=mx.cpu))
    if info.source == "scipy-openblas32":
        info.verified = _gemm_calls() > before
    else:
        owner = _symbol_owner("cblas_sgemm")
        info.verified = owner is not None and os.path.realpath(owner) == _system_path
    return info


def _gemm_calls() -> int:
    if _shim is None:
        return 0
    return ctypes.c_ulonglong.in_dll(_shim, "batchrun_gemm_calls").value


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _symbol_owner(symbol: str) -> str | None:
    """The file that the global scope resolves `symbol` to (what MLX binds to)."""
    libc = ctypes.CDLL(None)
    address = ctypes.cast(getattr(libc, symbol, None), ctypes.c_void_p).value
    if not address:
        return None
    info = _DlInfo()
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None
    return info.dli_fname.decode() if info.dli_fname else None
