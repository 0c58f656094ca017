"""Imports flow one way (runtime/__init__.py): front ends -> engine -> drafters -> llama side ->
format/errors, with the torch models and the converters beside the format. Walks every import of
the package's source with ast (function-local ones included) and fails on an upward import, a
cycle between modules, or an import of tests/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"runtime": "blockspec.runtime", "models": "blockspec.models", "converters": "blockspec.converters"}

# Layers, lowest first: a module may import its own layer and those below (never above).
# The tools that drive llama.cpp or register commands (training data engine and its prompt writer,
# parity reference, the answer-store builder that replays serving drafts, the train/convert CLIs) stand with
# the front ends.
TOP = ("blockspec.models.cli", "blockspec.models.data_engine", "blockspec.models.self_prompts", "blockspec.models.parity",
       "blockspec.models.blockpilot_data", "blockspec.models.blockpilot_train", "blockspec.models.store",
       "blockspec.converters.cli")
LAYERS = [
    ("format/errors", ("blockspec.runtime.errors", "blockspec.runtime.format")),
    ("models/converters", ("blockspec.models", "blockspec.converters")),
    ("llama", ("blockspec.runtime.llama",)),
    ("drafters", ("blockspec.runtime.drafters",)),
    ("engine", ("blockspec.runtime.engine",)),
    ("front ends", ("blockspec.runtime.frontends", "blockspec.runtime.bench") + TOP),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[:2] == ("runtime", "_package"):
        return "blockspec" + "".join(f".{p}" for p in rel.with_suffix("").parts[2:] if p != "__init__")
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    return ".".join(p for p in parts if p != "__init__")


def sources() -> dict[str, Path]:
    return {module_name(p): p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The blockspec modules `path` imports (a `from pkg import mod` counts as pkg.mod)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in found if m in known}


def layer(module: str) -> int:
    best = (-1, 0)  # (length of the longest matching prefix, layer)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[0]:
                best = (len(p), i)
    return best[1] if best[0] >= 0 else len(LAYERS) - 1  # blockspec, blockspec.runtime: the top


def graph() -> dict[str, set[str]]:
    src = sources()
    known = set(src) | {"blockspec.runtime", "blockspec.models", "blockspec.converters"}
    return {name: imports(path, name, known) - {name} for name, path in src.items()}


def test_imports_flow_down():
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
              for m, deps in sorted(graph().items()) for d in sorted(deps) if layer(d) > layer(m)]
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_nothing_imports_tests():
    test_modules = {p.stem for p in (ROOT / "tests").glob("*.py")}
    bad = []
    for path in [*sources().values(), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        text = path.read_text()
        if "sys.path" in text:
            bad.append(f"{path.relative_to(ROOT)}: edits sys.path")
        for node in ast.walk(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                    if n.split(".")[0] in test_modules or n.startswith("tests")]
    assert not bad, "\n".join(bad)
