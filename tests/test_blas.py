"""MLX's CPU matmuls must reach OpenBLAS, not the reference BLAS bundled with mlx-cpu."""

import subprocess
import sys

import pytest

from batchrun import blas

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU fix")


@linux_only
def test_mlx_matmuls_reach_openblas():
    info = blas.verify()
    assert info.source == "scipy-openblas32", info.describe()
    assert info.name.startswith("OpenBLAS")
    assert info.verified is True


@linux_only
def test_reference_blas_can_be_kept_for_comparisons():
    code = "import batchrun.blas as b; i = b.verify(); print(i.source, i.verified)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"BATCHRUN_BLAS": "reference", "PATH": ""}, check=True)
    assert out.stdout.split() == ["bundled", "None"]


@linux_only
@pytest.mark.parametrize("given,kept", [(None, blas.THREAD_TIMEOUT), ("20", "20")])
def test_idle_openblas_threads_sleep_unless_the_user_says_otherwise(given, kept):
    """MLX's and NumPy's OpenBLAS pools read the timeout when they load: batchrun sets it
    before either does (spinning threads of one pool starved the other), a user's value
    stands."""
    code = ("import os, batchrun, numpy, mlx.core; "
            "print(os.environ['OPENBLAS_THREAD_TIMEOUT'], batchrun.blas.verify().verified)")
    env = {"PATH": ""} | ({"OPENBLAS_THREAD_TIMEOUT": given} if given else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == [kept, "True"]


@pytest.mark.parametrize("given,kept", [(None, "0"), ("1", "1")])
def test_mlx_attention_on_cuda_skips_cudnn_unless_the_user_says_otherwise(given, kept):
    """MLX reads MLX_CUDA_USE_CUDNN_SDPA at its first attention call: batchrun's default (its
    own fused attention, faster on the H200) is set on import, and a user's value stands."""
    code = "import os, batchrun, mlx.core; print(os.environ['MLX_CUDA_USE_CUDNN_SDPA'])"
    env = {"PATH": ""} | ({"MLX_CUDA_USE_CUDNN_SDPA": given} if given else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == [kept]


@pytest.mark.parametrize("given,kept", [(None, "0"), ("1", "1")])
def test_float32_matmuls_stay_float32_unless_the_user_says_otherwise(given, kept):
    """MLX would run float32 matmuls as TF32 on CUDA and M5 GPUs (rounding by shape, so a
    float32 model's tokens could depend on the batch): batchrun turns that off on import, and a
    user's value stands."""
    code = "import os, batchrun, mlx.core; print(os.environ['MLX_ENABLE_TF32'])"
    env = {"PATH": ""} | ({"MLX_ENABLE_TF32": given} if given else {})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    assert out.stdout.split() == [kept]
