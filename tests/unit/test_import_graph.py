"""The package's import graph: subpackages in layers, imports pointing down, no circles between
files, and every name imported from the module that defines it (no re-export shims).

The graph is read from the source with `ast` (no module is imported), so a function-local import
counts like a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "depthbench"

# Lowest first: a module may import from its own subpackage and from the ones before it.
LAYERS = [
    "util",
    "models",
    "kernels",
    "data",
    "spec",
    "train",
    "evals",
    "probes",
    "pretrained",
    "hf",
    "analysis",
    "launch",
    "grid",
    "commands",
]
RANK = {name: i for i, name in enumerate(LAYERS)}

# The architecture registry imports its modules to register them, and they import the registry's
# decorator and the backbone they extend: a circle by design, and the only one.
REGISTRY_CIRCLE = {"depthbench.models.registry", "depthbench.models.archs"}

# Modules imported for their side effects or by name only, never for a name they define.
REMOTE_CODE = (
    "depthbench.hf.remote_code"  # shipped inside exported models; imports itself relatively
)


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = module_files()


def imports(name: str) -> list[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every depthbench import in `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
    return [f for f in found if f[0] == "depthbench" or f[0].startswith("depthbench.")]


def targets(module: str, names: list[str]) -> list[str]:
    """The depthbench modules an import statement reads: `from pkg import submodule` reads the
    submodule; `from module import name` reads the module."""
    out = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
    if len(out) < len(names) or not names:
        out.append(module)
    return [t for t in out if t in MODULES]


def edges() -> dict[str, set[str]]:
    graph = {name: set() for name in MODULES}
    for name in MODULES:
        for module, names, _ in imports(name):
            graph[name].update(t for t in targets(module, names) if t != name)
    return graph


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def defined_names(module: str) -> set[str]:
    """Names bound at module level by def, class or assignment (under if/try too)."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(
                    n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)
                )
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(MODULES[module].read_text(encoding="utf-8")).body)
    return names


def test_top_level_holds_only_subpackages():
    loose = sorted(
        p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert loose == [], f"modules outside a subpackage: {loose}"
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(LAYERS), (
        "every subpackage has a layer in LAYERS, and only those exist"
    )


def test_imports_point_down_the_layers():
    upward = []
    for name, deps in edges().items():
        if name in ("depthbench", "depthbench.__main__"):
            continue
        for dep in deps:
            if dep != "depthbench" and RANK[subpackage(dep)] > RANK[subpackage(name)]:
                upward.append(f"{name} -> {dep}")
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


def test_no_circle_between_files_but_the_registry():
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    allowed = [
        c
        for c in circles
        if REGISTRY_CIRCLE <= set(c)
        and all(m in REGISTRY_CIRCLE or m.startswith("depthbench.models.archs.") for m in c)
    ]
    assert [c for c in circles if c not in allowed] == []


def test_names_come_from_the_module_that_defines_them():
    shims = []
    for name in MODULES:
        if name.startswith(REMOTE_CODE):
            continue
        for module, names, line in imports(name):
            if module not in MODULES:
                continue
            defined = defined_names(module)
            for n in names:
                if f"{module}.{n}" not in MODULES and n not in defined:
                    shims.append(
                        f"{MODULES[name].relative_to(PACKAGE.parent)}:{line}: {n} from {module}"
                    )
    assert shims == [], "names imported from a module that only imports them:\n" + "\n".join(shims)


def test_the_checks_see_a_violation():
    """The graph reader itself: a known downward import is an edge, and the layer order ranks it."""
    graph = edges()
    assert "depthbench.models.registry" in graph["depthbench.train.checkpoint"] or any(
        d.startswith("depthbench.models") for d in graph["depthbench.train.checkpoint"]
    )
    assert RANK["models"] < RANK["train"] < RANK["commands"]
