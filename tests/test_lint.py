"""Static checks. pyflakes over everything Python: an undefined name in a rarely-run branch (a
DeepSpeed-only path, an error message) fails here, not in a user's job hours in. And the loading
rules: no pickle-executing loads, no remote code the user did not ask for. And common/'s public
surface: what the recipes import from it, no more."""

import ast
import json
import re
import subprocess
import sys
import textwrap

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


def common_imports(folder) -> dict:
    """Each module of the package in `folder` and the modules of it that it imports, at the top or inside a function,
    relatively (`from .x import`, `from . import x`) or by the package's name (`from common.x import`, `import
    common.x`, `from common import name`: `name`'s module in __init__'s _WHERE)."""
    modules = {path.stem for path in folder.glob("*.py")}
    where = {}  # the package's lazily imported names (PEP 562): the module each comes from
    init = folder / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text())) if init.is_file() else ():
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_WHERE"]:
            where = ast.literal_eval(node.value)
    imports = {}
    for path in sorted(folder.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            module = str(getattr(node, "module", None))
            if isinstance(node, ast.ImportFrom) and (
                node.level == 1 or module == "common" or module.startswith("common.")
            ):
                parts = (node.module or "").split(".")[0 if node.level else 1 :]
                names = [alias.name for alias in node.names]
                found |= {parts[0]} if parts and parts[0] else {where.get(name, name) for name in names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("common.")}
        imports[path.stem] = (found & modules) - {path.stem}
    return imports


def import_cycle(imports: dict) -> list | None:
    """A chain of modules that leads back to its first (`imports` as common_imports gives it), or None."""

    def cycle(module, seen):
        for other in sorted(imports.get(module, ())):
            if other in seen:
                return [*seen, other]
            if found := cycle(other, [*seen, other]):
                return found
        return None

    return next((c for m in sorted(imports) if (c := cycle(m, [m]))), None)


MUTATORS = {  # the methods that change a dict, list or set in place
    "append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove", "discard", "clear",
}  # fmt: skip
CONTAINERS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MADE_CONTAINERS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque"}  # made by a call


def is_container(value) -> bool:
    """Whether `value`, assigned, makes a dict, list or set (a literal, a comprehension, or dict(), set(), ...)."""
    made = isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None))
    return isinstance(value, CONTAINERS) or made in MADE_CONTAINERS


# The module-level (or class-level) state common/ may keep, and why it cannot live with the run's objects.
ALLOWED_STATE = {
    # a signal handler is called with (signum, frame) alone: what it records, and what it must know, is module state
    "preemption._received": "the stop signals received, in order",
    "preemption._in_loop": "a StopOnSignal exists: the handler leaves the stop to the loop",
    "preemption._ending": "exit_codes is ending the run: the handler records a stop and raises nothing",
    "preemption._owner": "the process the handlers are for: a forked worker inherits them",
    # fcntl locks belong to the process, not to an object: closing any descriptor of the file drops the lock, so the
    # process keeps one record of the locks it holds (a second OutputDir on the same folder reuses it)
    "outputs._RunLock.held": "this process's run locks",
}


def mutated_module_state(folder) -> set:
    """`module.name` (or `module.Class.name`) for each dict, list or set assigned at the top of a module of `folder`
    (or of a class in it) that a function mutates, and each module-level name a function rebinds (`global`)."""
    found = set()
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        scopes = [("", tree.body), *((f"{c.name}.", c.body) for c in tree.body if isinstance(c, ast.ClassDef))]
        state = {  # "name" or "Class.name" -> the class whose methods reach it as self.name and cls.name
            f"{prefix}{target.id}": prefix[:-1]
            for prefix, body in scopes
            for node in body
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and is_container(node.value)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }

        def named(expr, cls: str) -> str | None:
            if isinstance(expr, ast.Name):
                return expr.id
            if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
                owner = cls if expr.value.id in ("self", "cls") else expr.value.id
                return f"{owner}.{expr.attr}"
            return None

        classes = [("", tree), *((c.name, c) for c in tree.body if isinstance(c, ast.ClassDef))]
        for cls, scope in classes:
            for function in ast.walk(scope):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Global):
                        found |= {f"{path.stem}.{name}" for name in node.names}
                    changed = []
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr in MUTATORS
                    ):
                        changed.append(node.func.value)
                    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                        targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
                        changed += [t.value for t in targets if isinstance(t, ast.Subscript)]  # SEEN[k] = v, del
                        if isinstance(node, ast.AugAssign):  # SEEN += [v]: a list grown in place
                            changed.append(node.target)
                    found |= {f"{path.stem}.{n}" for e in changed if (n := named(e, cls)) in state}
    return found


def test_common_has_no_import_cycle(tmp_path):
    """Each module of common/ imports others (at the top or inside a function) without one importing it back, however
    far round: a cycle forces imports into functions and makes the import order matter. The check finds one."""
    imports = common_imports(REPO / "common")
    assert imports["outputs"] >= {"checkpoint", "runtime"}  # it sees imports at all
    assert (cycle := import_cycle(imports)) is None, " -> ".join(cycle)
    (tmp_path / "__init__.py").write_text('_WHERE = {"RecipeError": "runtime"}\n')
    (tmp_path / "runtime.py").write_text("def f():\n    from common.plan import x\n")
    (tmp_path / "plan.py").write_text("from common import RecipeError\n")  # back to runtime, through the package
    assert import_cycle(common_imports(tmp_path)) in (["plan", "runtime", "plan"], ["runtime", "plan", "runtime"])


def test_common_keeps_no_module_state_but_the_signal_flags(tmp_path):
    """No module of common/ keeps state at its top that its functions change (a dict, list or set they fill, a name
    they rebind), but what ALLOWED_STATE lists and says why: state of the process would outlive a run, and two runs
    in one process (the tests, tests/warm.py's forks) would see each other's. What a run learns lives with its
    objects (the parsed arguments carry their parse's: common.args.ParsedArgs). The check finds such state."""
    assert mutated_module_state(REPO / "common") == set(ALLOWED_STATE)
    (tmp_path / "args.py").write_text(
        textwrap.dedent(
            """\
            SEEN: dict = {}
            UNUSED = set()
            LIMITS = (1, 2)

            class Parser:
                last = []

                def parse(self, x):
                    SEEN[x] = 1
                    UNUSED.add(x)
                    self.last.append(x)
                    mine = {}
                    mine[x] = LIMITS
            """
        )
    )
    assert mutated_module_state(tmp_path) == {"args.SEEN", "args.UNUSED", "args.Parser.last"}


def test_code_size_counts_what_the_files_hold():
    """benchmarks/code_size.py, which measures the recipes' size for the README's claims: its counts are the files'."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import code_size

    result = code_size.measure(with_tests=False)
    for name, counted in result["recipes"].items():
        source = (REPO / "recipes" / f"{name}.py").read_text()
        assert counted["lines"] == len(source.splitlines())
        # each name of common/ the recipe uses is read in full: at least one line a name more than the recipe
        assert counted["newcomer_lines"] >= counted["lines"] + counted["common_names"] > counted["lines"]
    assert 0 < result["common_refusal_lines"] < result["common_code_lines"]
    assert 0 < result["edge_refusal_lines"] < result["common_refusal_lines"]
    refused, at_edge, _ = code_size.refusal_lines(REPO / "common" / "preflight.py")  # refusals returned as data
    assert refused == at_edge > 0
    assert result["wording_pinned"] == len(json.loads((REPO / "tests" / "golden_errors.json").read_text()))
