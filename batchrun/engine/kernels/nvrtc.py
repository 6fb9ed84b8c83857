"""CUDA source to PTX through NVRTC, the runtime compiler MLX's CUDA backend already loads.

MLX's `mx.fast.cuda_kernel` compiles a kernel in every process (its source includes MLX's own
device headers: ~1.3-1.6 s a kernel measured on the H200, paid inside a job's first decode
step) and keeps no copy of custom kernels on disk. A self-contained source (no includes)
compiles to PTX here in a fraction of that, once per process, and runs through
`mx.fast.precompiled_cuda_kernel`; the driver caches the PTX's machine code across processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable
from functools import cache
from pathlib import Path

# Sonames of NVRTC by CUDA major version; MLX's CUDA wheels link one of them, so it is in the
# process already when MLX's CUDA backend is.
LIBRARIES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
# PTX for the oldest virtual architecture this NVRTC knows, from Volta (7.0) on: it loads on
# every newer GPU (the driver compiles it for the GPU at hand); the kernels use nothing newer.
OLDEST_ARCH = 70


class NvrtcError(RuntimeError):
    pass


_ahead: list[threading.Thread] = []  # compilations started ahead of their first use


def compile_ahead(*calls: Callable[[], object]) -> None:
    """Run cached compile calls on a thread now (NVRTC releases the GIL, so they overlap the
    job's start: ~0.15 s a kernel on a 2-core CPU); `wait_ahead` before a first use. A call
    that fails is left for its first use, which compiles again and reports it."""
    def run() -> None:
        for call in calls:
            with contextlib.suppress(Exception):  # the first use compiles again and reports
                call()

    if calls:
        thread = threading.Thread(target=run, name="batchrun-nvrtc", daemon=True)
        thread.start()
        _ahead.append(thread)


def wait_ahead() -> None:
    """Wait for the compilations `compile_ahead` started (their results are cached)."""
    while _ahead:
        _ahead.pop().join()


@cache
def _library() -> ctypes.CDLL:
    """The NVRTC MLX loaded (by soname), else one from NVIDIA's PyPI packages."""
    errors = []
    for name in (*LIBRARIES, *_packaged()):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
    raise NvrtcError("NVRTC (CUDA's runtime compiler) was not found: " + "; ".join(errors))


def _packaged() -> list[str]:
    """NVRTC libraries in the `nvidia` namespace package (nvidia-cuda-nvrtc's wheels)."""
    try:
        import nvidia
    except ImportError:
        return []
    return sorted(str(path) for folder in nvidia.__path__
                  for path in Path(folder).glob("*/lib/libnvrtc.so*")
                  if "builtins" not in path.name)


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(result).decode()}")


@cache
def _arch(oldest: int = OLDEST_ARCH) -> int:
    """The oldest virtual architecture this NVRTC knows from `oldest` on."""
    lib = _library()
    count = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return min((a for a in archs if a >= oldest), default=max(archs))


def compile_ptx(source: str, name: str = "kernel.cu", oldest_arch: int = OLDEST_ARCH) -> bytes:
    """PTX for `source` (NUL-terminated, as the driver reads it) for the oldest architecture
    from `oldest_arch` on (a kernel using tensor-core instructions asks for the first that has
    them); NvrtcError with the compiler's log if it does not compile."""
    lib = _library()
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(),
                                       0, None, None), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture=compute_{_arch(oldest_arch)}".encode()]
        result = lib.nvrtcCompileProgram(program, len(options),
                                         (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(program, log)
            raise NvrtcError(f"compiling {name} failed: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
        return ptx.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
