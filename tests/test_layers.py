"""The package's layers import downwards only: every import, at module level or inside a function."""

import ast
import pathlib

import shrinkwrap

SRC = pathlib.Path(shrinkwrap.__file__).parent

# Lowest first. A module may import its own layer's modules and any layer below, never above.
LAYERS = [
    {"_tree", "_wrapper", "models", "_version", "_compat"},
    {"select"},
    {"_rewrite"},
    {"step"},
    {"transforms"},
    {"plan"},
    {"measuring", "parallel"},  # parallel: shard or replicate a model to measure, start the ranks
    {"report"},
    {"processes"},  # fresh processes: a row's, a plan compiled ahead, a fit probe
    {"fit"},
    {"compare"},
    {"autoplan"},
    {"cli", "cli_models", "__main__"},
]


def modules() -> dict[str, pathlib.Path]:
    """Dotted names below the package (``transforms.checkpoint``; a package by its own name)."""
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the package's own __init__ is its face: it imports everything and nothing imports it
            out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "shrinkwrap":
                base = []
                node = ast.ImportFrom(node.module.removeprefix("shrinkwrap").lstrip("."), node.names, 1)
            else:
                continue
            target = ".".join(base + (node.module.split(".") if node.module else []))
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                found.add(full if full in known else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("shrinkwrap"):
                    found.add(alias.name.removeprefix("shrinkwrap").lstrip("."))
    return found - {name}


def layer(name: str) -> int:
    top = name.split(".")[0]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_module_has_a_layer_and_nothing_imports_the_package_face():
    for name, targets in graph().items():
        layer(name)  # raises StopIteration for a module missing from LAYERS
        assert "" not in targets, f"{name} imports the package itself (shrinkwrap/__init__)"


def test_imports_go_downwards_only():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer(b) > layer(a)]
    assert not upward, upward


def test_no_import_cycle():
    g = graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(g.get(node, ())):
            assert state.get(nxt) != "open", " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_imports_inside_functions():
    g = graph()
    assert "models" in g["cli"]          # imported inside a function in cli.py
    assert "step" in g["transforms.checkpoint.step"]


# Modules whose names start with an underscore are the package's own plumbing, imported by name.
PLUMBING = {"_tree", "_wrapper", "_version", "_compat", "_rewrite"}
MAX_LINES = 600


def test_no_module_imports_a_private_name_from_another_package():
    """A name used across packages (``processes`` from ``compare``) is part of the library's
    internal interface and says so by having no underscore; a private name stays in its package."""
    crossing = []
    for name, path in modules().items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            target = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            for alias in node.names:
                private = alias.name.startswith("_") and alias.name not in PLUMBING and not alias.name.startswith("__")
                if private and target[:1] != name.split(".")[:1]:
                    crossing.append(f"{name} imports {'.'.join(target)}.{alias.name}")
    assert not crossing, crossing


def test_no_source_file_is_over_600_lines():
    repo = pathlib.Path(__file__).resolve().parents[1]
    roots = [repo / "src", repo / "benchmarks", repo / "tests"]
    long = {str(p.relative_to(repo)): n for root in roots for p in root.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
