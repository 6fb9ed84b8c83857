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


# The engine's own floors, ground first: a module under batchrun/engine imports from its own
# floor or the ones below (a subpackage is one floor; a top-level module is named alone).
ENGINE_LAYERS = [
    ("base", {"types", "config", "stats", "memory"}),
    ("kernels", {"kernels"}),
    ("decoding", {"decoding"}),
    ("state", {"sequence", "postprocess", "prefix_plan", "scheduler", "serving"}),
    ("backends", {"backends"}),
    ("core", {"engine", "generate", "cache_control", "load", "vision_engine", "__init__"}),
]


def _engine_layer(parts: list[str]) -> int | None:
    """The floor of batchrun.engine.<parts...> (None for the package itself)."""
    if not parts:
        return None
    for level, (_, members) in enumerate(ENGINE_LAYERS):
        if parts[0] in members:
            return level
    raise AssertionError(f"batchrun.engine.{'.'.join(parts)} is on no floor: add it to "
                         "ENGINE_LAYERS in tests/test_lint.py")


def _imported(node, package: list[str]) -> list[list[str]]:
    """The dotted modules an import statement names (for `from X import a, b`, X.a and X.b, as
    a, b may be modules), relative imports resolved against `package`."""
    import ast

    if isinstance(node, ast.Import):
        return [a.name.split(".") for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = (package[:len(package) - node.level + 1] if node.level else []) + \
        (node.module.split(".") if node.module else [])
    return [base + [a.name] for a in node.names]


def engine_upward_imports() -> list[str]:
    """Every import in batchrun/engine, module level or inside a function, that climbs from a
    module's floor to a higher one."""
    import ast

    engine = ROOT / "batchrun" / "engine"
    upward = []
    for path in sorted(engine.rglob("*.py")):
        rel = list(path.relative_to(engine).with_suffix("").parts)
        package = ["batchrun", "engine"] + rel[:-1]
        own = _engine_layer(rel)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, package):
                if target[:2] != ["batchrun", "engine"]:
                    continue
                # `from batchrun.engine.kernels import nvrtc` names kernels/nvrtc: the floor is
                # its first part under the engine either way.
                level = _engine_layer(target[2:])
                if level is not None and level > own:
                    upward.append(
                        f"batchrun/engine/{'/'.join(rel)}.py (floor {ENGINE_LAYERS[own][0]}) "
                        f"imports {'.'.join(target)} (floor {ENGINE_LAYERS[level][0]}), line "
                        f"{node.lineno}")
    return upward


def test_no_import_runs_back_up_the_engine_floors():
    upward = engine_upward_imports()
    assert not upward, ("an engine module imports from a floor above its own (order: "
                        + " < ".join(name for name, _ in ENGINE_LAYERS) + "):\n  "
                        + "\n  ".join(upward))


def test_every_package_of_batchrun_is_listed_for_installation():
    """pyproject.toml lists the packages by hand: a new subpackage left out installs from a
    checkout (editable) but not from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "batchrun").rglob("__init__.py")}
    assert found == listed, f"add to pyproject.toml: {sorted(found - listed)}; " \
                            f"remove: {sorted(listed - found)}"
