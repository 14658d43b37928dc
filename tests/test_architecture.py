"""The package's imports against the layers of docs/architecture.md: nothing imports upwards, no
module is left out of a layer, and no modules import each other in a circle."""

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tpurl"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def documented_layers(text: str) -> dict[str, int]:
    """`module prefix -> layer` from the table under '## Layers' (its 'modules' column)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            for name in re.findall(r"`([\w.]+)`", cells[2]):
                layers[name] = int(cells[0])
    return layers


LAYERS = documented_layers((REPO / "docs" / "architecture.md").read_text())


def layer_of(module: str) -> int | None:
    """The layer of the longest documented prefix of `module`."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def imported_modules(module: str, path: pathlib.Path) -> dict[str, int]:
    """tpurl modules `module` imports (anywhere in the file) -> the first line that does."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                keep = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(keep + ([node.module] if node.module else []))
            # `from pkg import sub` imports the module pkg.sub when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name == "tpurl" or name.startswith("tpurl."):
                while name not in MODULES:
                    name = name.rsplit(".", 1)[0]
                if name != module:
                    found.setdefault(name, node.lineno)
    return found


GRAPH = {m: imported_modules(m, p) for m, p in MODULES.items()}


def test_the_table_parses():
    assert LAYERS["tpurl.commands"] > LAYERS["tpurl.rl"] > LAYERS["tpurl.train"] > LAYERS["tpurl.models"]
    assert LAYERS["tpurl.models"] > LAYERS["tpurl.sharding"] > LAYERS["tpurl"]


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None] == []


def upward_imports(graph) -> list[str]:
    return [f"{MODULES[m].relative_to(REPO)}:{line} imports {target} (layer {layer_of(target)} > {layer_of(m)})"
            for m, targets in graph.items() for target, line in targets.items() if layer_of(target) > layer_of(m)]


def test_no_import_runs_up_a_layer():
    assert upward_imports(GRAPH) == []


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while not comp or comp[-1] != node:
                        comp.append(stack.pop())
                        on_stack.discard(comp[-1])
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt), on_stack.add(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return found


def test_no_import_cycle():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("edge", [("tpurl.sharding.layout", "tpurl.commands.main"),
                                  ("tpurl.plan.hardware", "tpurl.plan.calibrate")])
def test_the_checks_catch_a_violation(edge):
    """An upward import and a circle (the planner's old hardware -> calibrate lookup) are found."""
    source, target = edge
    graph = {m: dict(t) for m, t in GRAPH.items()}
    graph[source][target] = 1
    assert upward_imports(graph) or cycles(graph)
    if source == "tpurl.plan.hardware":
        assert any(source in c and target in c for c in cycles(graph))
