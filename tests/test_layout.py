"""The package layout shows the architecture: the engine depends on nothing above it, and no two
parts of evalsuite import each other (read from the source, so a cycle fails here, not at import)."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "evalsuite"
# Where each package's files are when it is not the folder of its name (pyproject's package-dir).
PACKAGE_DIR = {"evalsuite.tasks": REPO / "tasks"}


def _folder(package: str) -> Path:
    """The folder of a package's files: package-dir's, else the one its name gives."""
    for mapped, folder in PACKAGE_DIR.items():
        if package == mapped or package.startswith(mapped + "."):
            return folder.joinpath(*package[len(mapped):].split(".")[1:])
    return REPO.joinpath(*package.split("."))


def _sources(package: str = "evalsuite"):
    """Every source file of a package and of the packages under it, tasks/ included."""
    roots = [(package, _folder(package))] + [(m, f) for m, f in PACKAGE_DIR.items() if m.startswith(package + ".")]
    for name, root in roots:
        for path in root.rglob("*.py"):
            yield path, ".".join([name, *path.relative_to(root).with_suffix("").parts])


def _part(module: str) -> str:
    """evalsuite.<part>[...] -> part; the package itself -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str):
    """(importing module, imported evalsuite module) for every import in one source file of that module."""
    is_init = module.endswith(".__init__")
    here = module.removesuffix(".__init__")
    package = here if is_init else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((here, a.name) for a in node.names if a.name.startswith("evalsuite"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("evalsuite"):
                continue
            if node.module:
                yield here, target
            else:  # `from . import x`: x is a submodule, or a name of the package itself
                for a in node.names:
                    sub = _folder(f"{target}.{a.name}")
                    yield here, f"{target}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else target


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path, module in _sources():
        for source, target in _imports(path, module):
            a, b = _part(source), _part(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def test_the_engine_imports_nothing_from_evalsuite_outside_it():
    outside = sorted(t for s, t in (pair for p, m in _sources("evalsuite.engine") for pair in _imports(p, m))
                     if not t.startswith("evalsuite.engine"))
    assert outside == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> modules it imports, inside parts too (the part graph cannot see zoo.train <-> zoo.train_vl)."""
    edges: dict[str, set[str]] = {}
    for path, module in _sources():
        for source, target in _imports(path, module):
            if source != target:
                edges.setdefault(source, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    def cycle_from(start, node, seen):
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return [node, nxt]
            if nxt not in seen:
                seen.add(nxt)
                found = cycle_from(start, nxt, seen)
                if found:
                    return [node, *found]
        return None

    return [c for node in sorted(edges) if (c := cycle_from(node, node, {node}))]


def test_no_two_parts_of_evalsuite_import_each_other():
    assert _cycles(_graph()) == []


def test_no_two_modules_of_the_training_task_and_lm_eval_packages_import_each_other():
    # lazy imports inside functions count: they hide a cycle, they do not remove it
    inside = ("evalsuite.zoo", "evalsuite.taskgen", "evalsuite.lm")
    edges = {m: {t for t in targets if t.startswith(inside)} for m, targets in _module_graph().items()
             if m.startswith(inside)}
    assert _cycles(edges) == []


def test_the_trainers_share_the_loop_without_importing_each_other():
    edges = _module_graph()
    assert "evalsuite.zoo.loop" in edges["evalsuite.zoo.train"] & edges["evalsuite.zoo.train_vl"]
    assert "evalsuite.zoo.train" not in edges["evalsuite.zoo.train_vl"]


def test_scoring_reads_the_generated_tasks_from_taskgen_not_from_the_trainers():
    edges = _module_graph()
    assert "evalsuite.taskgen.corpus" in edges["evalsuite.scoring.heldout"]
    taskgen = [m for m in edges if m.startswith("evalsuite.taskgen")]
    assert taskgen and not any(t.startswith("evalsuite.zoo") for m in taskgen for t in edges[m])


def test_the_graph_sees_imports():  # the checks above would pass vacuously on a parser that finds nothing
    edges = _graph()
    assert "engine" in edges.get("predict", set()) and "engine" in edges.get("lm", set())


def test_the_graph_sees_the_task_hooks_in_the_top_level_tasks_folder():
    assert "scoring" in _graph().get("tasks", set())


def test_the_task_files_are_the_top_level_tasks_folder_shipped_as_evalsuite_tasks():
    # one copy of each task file, in tasks/ (lm_eval --include_path tasks), which pyproject's package-dir maps onto
    # evalsuite.tasks (setup.py adds it to the packages that find lists); a __pycache__ left where they were is harmless
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {k: REPO / v for k, v in setuptools["package-dir"].items()} == PACKAGE_DIR
    assert [p.name for p in (PACKAGE / "tasks").glob("*") if p.name != "__pycache__"] == []
    assert (REPO / "tasks" / "hooks.py").is_file() and len(list((REPO / "tasks").glob("*.yaml"))) > 10
