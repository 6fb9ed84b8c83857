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
