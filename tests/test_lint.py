"""The code base stays ruff-clean (one command runs tests and linters)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is a test dependency: pip install -e '.[test]'"
    out = subprocess.run([ruff, "check", "batchrun", "tests", "scripts", "tools"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# The layers, ground floor first: a module imports from its own layer or the ones below.
LAYERS = ["io", "cache", "engine", "job", "api"]
SIDE = {"paths", "models", "blas"}  # utilities any layer may use


def test_no_import_runs_back_up_the_layers():
    import ast

    upward = []
    for layer, name in enumerate(LAYERS[:-1]):
        for path in (ROOT / "batchrun" / name).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                targets = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                for target in targets:
                    parts = target.split(".")
                    if parts[0] != "batchrun" or len(parts) < 2 or parts[1] in SIDE:
                        continue
                    level = LAYERS.index(parts[1]) if parts[1] in LAYERS else len(LAYERS)
                    if level > layer:
                        upward.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not upward, upward
