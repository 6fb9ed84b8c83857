"""The test suite's layout: every test file in one layer (tests/conftest.py's LAYER), every
marker declared, the fast subset (-m "not slow") still covering every layer and feature; and
tools/ outside the shipped package."""

import ast
import tomllib
from pathlib import Path

from conftest import LAYER, SLOW

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BUILTIN_MARKERS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
# What a user meets: a file and a word in the names of its tests of it; each feature keeps a
# test in the fast subset.
FEATURES = {"crash then resume": ("test_crash.py", "resume"),
            "labeling": ("test_constrained.py", "label"),
            "stdin and stdout": ("test_cli_contract.py", "stdin"),
            "Parquet": ("test_parquet_output.py", "")}


def declared_markers() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0].strip() for m in pyproject["tool"]["pytest"]["ini_options"]["markers"]}


def functions_in(name: str) -> set[str]:
    tree = ast.parse((TESTS / name).read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_test_file_is_in_one_declared_layer():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert sorted(files - LAYER.keys()) == [], "add them to LAYER in tests/conftest.py"
    assert sorted(LAYER.keys() - files) == [], "LAYER names files that are gone"
    assert set(LAYER.values()) == declared_markers() - {"slow"}


def test_every_marker_used_is_declared():
    used = set()
    for path in TESTS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "mark":
                used.add(node.attr)
    assert sorted(used - BUILTIN_MARKERS - declared_markers()) == []


def test_slow_names_tests_that_exist():
    gone = [entry for entry in SLOW
            if entry.split("::")[1] not in functions_in(entry.split("::")[0])]
    assert gone == [], "SLOW in tests/conftest.py names tests that are gone"


def test_the_fast_subset_keeps_a_test_of_every_layer_and_feature():
    def fast(name: str) -> set[str]:
        return {t for t in functions_in(name) if f"{name}::{t}" not in SLOW}

    for layer in set(LAYER.values()):
        assert any(fast(name) for name, of in LAYER.items() if of == layer), layer
    for feature, (name, word) in FEATURES.items():
        assert any(word in t for t in fast(name)), feature


def test_the_shipped_package_imports_nothing_from_tools():
    importers = []
    for path in (ROOT / "batchrun").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level \
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "tools" or n.startswith("tools.") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [p for p in pyproject["tool"]["setuptools"]["packages"] if p.startswith("tools")]
