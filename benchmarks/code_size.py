"""What a reader meets: the size of each recipe, the lines a newcomer reads before changing the model or the loss,
how much of common/ is refusals, and how many tests launch processes or pin an error's wording.

    python benchmarks/code_size.py            # a table; --json for the numbers

How each is counted (a stated method, so that two runs compare):
- lines read by a newcomer: the recipe, plus the definition (the whole function or class) of each name of common/
  the recipe uses, once each; what those definitions call in turn is not counted.
- refusal lines: in common/, the lines of each `raise RecipeError/DataError(...)`, `return RecipeError(...)` (a
  refusal returned as data, common/preflight.py's) and `parser.error(...)` / `p.error(...)` statement with the `if`
  line that guards it, and each `raise ArgumentTypeError(...)` of an option's type; at the edge (before anything
  loads): those of the modules that check the options and the launch (EDGE), and every `parser.error(...)` (the
  parse-time checks of common.text, vision and samples).
- tests that launch processes: those marked slow; wording pinned: lines of tests/golden_errors.json.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common.args import ArgumentParser  # noqa: E402

REFUSALS = {"RecipeError", "DataError", "ArgumentTypeError", "error"}
EDGE = ("args.py", "preflight.py", "mesh.py")  # the options and their relations; the launch and its environment


def definitions() -> dict[str, tuple[Path, int]]:
    """Each top-level function and class of common/: its file and its number of lines."""
    found = {}
    for path in sorted((REPO / "common").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                found[node.name] = (path, node.end_lineno - node.lineno + 1)
    return found


def names_used(recipe: Path) -> set[str]:
    """The names of common/ a recipe uses: `common.X` and what it imports from common or its modules."""
    used = set()
    for node in ast.walk(ast.parse(recipe.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("common", "vision")
        ):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "common":
            used.update(alias.name for alias in node.names)
    return used


def refusal_lines(path: Path) -> tuple[int, int, int]:
    """(refusal lines, those at the edge, code lines) of a module of common/."""
    tree, lines, edge = ast.parse(path.read_text()), set(), set()
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            call = child.exc if isinstance(child, ast.Raise) else getattr(child, "value", None)
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in REFUSALS and isinstance(child, ast.Raise | ast.Expr | ast.Return):
                found = set(range(child.lineno, child.end_lineno + 1))
                if isinstance(node, ast.If) and child in node.body:
                    found.update(range(node.lineno, node.test.end_lineno + 1))
                lines |= found
                edge |= found if path.name in EDGE or name == "error" else set()
    source = path.read_text().splitlines()
    code = sum(1 for line in source if line.strip() and not line.strip().startswith("#"))
    return len(lines), len(edge), code


def slow_tests() -> tuple[int, int]:
    """(tests marked slow, all tests), as pytest collects them."""
    counts = []
    for marker in ("slow", "slow or not slow"):
        collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0"]
        out = subprocess.run([*collect, "-m", marker], cwd=REPO, capture_output=True, text=True, check=True).stdout
        counts.append(sum("::" in line for line in out.splitlines()))
    return counts[0], counts[1]


def measure(with_tests: bool = True) -> dict:
    defs, result = definitions(), {"recipes": {}}
    for recipe in sorted((REPO / "recipes").glob("*.py")):
        used = sorted(name for name in names_used(recipe) if name in defs)
        own = len(recipe.read_text().splitlines())
        result["recipes"][recipe.stem] = {
            "lines": own,
            "common_names": len(used),
            "newcomer_lines": own + sum(defs[name][1] for name in used),
        }
    refusals = {path.name: refusal_lines(path) for path in sorted((REPO / "common").glob("*.py"))}
    result["common_code_lines"] = sum(code for _, _, code in refusals.values())
    result["common_refusal_lines"] = sum(lines for lines, _, _ in refusals.values())
    result["edge_refusal_lines"] = sum(edge for _, edge, _ in refusals.values())
    golden = REPO / "tests" / "golden_errors.json"
    result["wording_pinned"] = len(json.loads(golden.read_text())) if golden.exists() else None
    if with_tests:
        result["slow_tests"], result["tests"] = slow_tests()
    return result


def build_parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.add_argument("--no_tests", action="store_true", help="skip collecting the tests (a few seconds)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    result = measure(not args.no_tests)
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print("| recipe | lines | names of common/ | lines a newcomer reads |\n|---|---|---|---|")
    for name, r in result["recipes"].items():
        print(f"| {name} | {r['lines']} | {r['common_names']} | {r['newcomer_lines']} |")
    share = result["common_refusal_lines"] / result["common_code_lines"]
    print(f"\ncommon/: {result['common_code_lines']} code lines, {result['common_refusal_lines']} of them refusals "
          f"({share:.0%}); {result['edge_refusal_lines']} of those at the edge, before anything loads "
          f"({result['edge_refusal_lines'] / result['common_refusal_lines']:.0%})")  # fmt: skip
    if result["wording_pinned"] is not None:
        print(f"error lines pinned word for word: {result['wording_pinned']} (tests/golden_errors.json)")
    if "tests" in result:
        print(f"tests: {result['tests']}, {result['slow_tests']} of them launch processes (marked slow)")


if __name__ == "__main__":
    main()
