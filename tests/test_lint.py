"""Static checks. pyflakes over everything Python: an undefined name in a rarely-run branch (a
DeepSpeed-only path, an error message) fails here, not in a user's job hours in. And the loading
rules: no pickle-executing loads, no remote code the user did not ask for. And common/'s public
surface: what the recipes import from it, no more."""

import ast
import re
import subprocess
import sys

from conftest import REPO


def test_ruff_finds_nothing_and_the_tree_is_formatted():
    """ruff's lint and format checks, with the settings in pyproject.toml (line length 119)."""
    for check in (["check"], ["format", "--check"]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *check, "."], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_pyflakes_finds_nothing():
    proc = subprocess.run(
        [sys.executable, "-m", "pyflakes", "recipes", "common", "tests", "scripts", "benchmarks"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_weights_are_loaded_safely_and_remote_code_only_on_request():
    """Everything the repository loads goes through safetensors or torch.load(weights_only=True),
    and trust_remote_code is only ever the user's flag."""
    sources = [p for folder in ("recipes", "common", "benchmarks", "scripts") for p in (REPO / folder).rglob("*.py")]
    assert sources
    for path in sources:
        text = path.read_text()
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, f"{path}: {call}"
        assert not re.search(r"trust_remote_code\s*=\s*True", text), path
        assert "pickle.load" not in text, path


def test_commons_public_surface_is_what_the_recipes_import_sorted():
    """`common/__init__.py` exports the names the recipes use (`common.X`, `from common import X`), sorted;
    anything else is imported from its submodule."""
    import common

    used = set()
    for path in (REPO / "recipes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "common":
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and node.module == "common":
                used |= {alias.name for alias in node.names}
    submodules = {name for name in used if (REPO / "common" / f"{name}.py").is_file()}
    assert used - submodules == set(common.__all__)
    assert common.__all__ == sorted(common.__all__)


def test_common_has_no_import_cycle():
    """Each module of common/ imports others (at the top or inside a function) without one importing it back, however
    far round: a cycle forces imports into functions and makes the import order matter."""
    imports = {}
    for path in sorted((REPO / "common").glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found |= {node.module} if node.module else {alias.name for alias in node.names}
        imports[path.stem] = found - {path.stem}

    def cycle(module, seen):
        for other in sorted(imports.get(module, ())):
            if other in seen:
                return [*seen, other]
            if found := cycle(other, [*seen, other]):
                return found
        return None

    cycles = [c for m in imports if (c := cycle(m, [m]))]
    assert not cycles, " -> ".join(cycles[0])
