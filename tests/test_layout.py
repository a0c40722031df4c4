"""The package layout shows the architecture: the engine depends on nothing above it, and no two
parts of evalsuite import each other (read from the source, so a cycle fails here, not at import)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "evalsuite"


def _part(module: str) -> str:
    """evalsuite.<part>[...] -> part; the package itself -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path):
    """(importing module, imported evalsuite module) for every import in one source file."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    here = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
    package = here if rel.name == "__init__" else here.rpartition(".")[0]
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
                    sub = PACKAGE.parent / Path(*f"{target}.{a.name}".split("."))
                    yield here, f"{target}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else target


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for source, target in _imports(path):
            a, b = _part(source), _part(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    return edges


def test_the_engine_imports_nothing_from_evalsuite_outside_it():
    outside = sorted(t for s, t in (pair for p in (PACKAGE / "engine").rglob("*.py") for pair in _imports(p))
                     if not t.startswith("evalsuite.engine"))
    assert outside == []


def _module_graph() -> dict[str, set[str]]:
    """Module -> modules it imports, inside parts too (the part graph cannot see zoo.train <-> zoo.train_vl)."""
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for source, target in _imports(path):
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
