"""No import cycles among the product's modules, and every import points down a floor: between the
top-level folders (``FLOORS``) and between the stages inside ``pipeline/`` and ``memory/`` (``INNER_FLOORS``).

The graph is read from the source (ast), not from a run: every ``import`` of an ``ibex_context``
module counts, at module level, inside a function (a deferred import is still a dependency) and
under ``TYPE_CHECKING``. An edge goes to the module named, not to the packages above it: a
package's ``__init__`` importing its own modules is how a package re-exports, not a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.meta.layout import modules


def _sources() -> dict[str, Path]:
    """Module name -> file, through pyproject's package-dir table (the folders are not named ibex_context)."""
    return modules()


def _imported(name: str, path: Path, modules: set[str]) -> Iterator[str]:
    """The package's modules that ``name`` (at ``path``) imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text("utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # ``from pkg import mod`` names a module; ``from mod import func`` names the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a package's attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    return {name: set(_imported(name, path, set(sources))) for name, path in sources.items()}


def _knots(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan): each holds a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each knot as one of its cycles, and the knot's other modules."""
    out = []
    for knot in _knots(graph):
        path = _path_in(graph, knot)
        rest = sorted(knot - set(path))
        out.append(" -> ".join(path) + (f" (and {', '.join(rest)} in the same knot)" if rest else ""))
    return out


def _path_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside the component)."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")  # pragma: no cover


def test_the_graph_is_the_real_tree() -> None:
    graph = _graph()
    assert len(graph) > 100
    assert "ibex_context.client.connection" in graph["ibex_context.client.client"]
    assert "ibex_context.shared.wire.protocol" in graph["ibex_context.client.connection"]  # from pkg import mod
    assert "ibex_context.shared.security.auth" in graph["ibex_context.client.client"]  # inside a function


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert _cycles(graph) == ["a -> b -> c -> a", "e -> f -> e"]
    assert _cycles({"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}) == ["a -> b -> a (and c in the same knot)"]


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# The floors of the house (docs/architecture.md "Processes and data flow"): a folder imports only
# its own modules and the folders on floors below it.
FLOORS = {"shared": 1, "pipeline": 2, "broker": 2, "worker": 3, "memory": 3, "client": 3, "ops": 4}


def _upward(graph: dict[str, set[str]]) -> list[str]:
    def folder(module: str) -> str:
        return module.split(".")[1] if module.count(".") else ""

    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if folder(a) and folder(b) and folder(a) != folder(b)
                  and FLOORS[folder(b)] >= FLOORS[folder(a)])


def test_upward_imports_are_found() -> None:
    graph = {"ibex_context.shared.a": {"ibex_context.pipeline.b"}, "ibex_context.ops.c": {"ibex_context.shared.a"},
             "ibex_context.worker.d": {"ibex_context.memory.e"}, "ibex_context.memory.e": set(),
             "ibex_context.pipeline.b": set()}
    assert _upward(graph) == ["ibex_context.shared.a -> ibex_context.pipeline.b",
                              "ibex_context.worker.d -> ibex_context.memory.e"]


def test_every_folder_is_on_a_floor_and_imports_only_below_it() -> None:
    graph = _graph()
    folders = {name.split(".")[1] for name in graph if name.count(".")}
    assert folders == set(FLOORS), sorted(folders ^ set(FLOORS))
    upward = _upward(graph)
    assert not upward, "imports along or up a floor:\n" + "\n".join(upward)


# The floors inside a room (docs/architecture.md "Processes and data flow"): each stage of
# pipeline/ and each job of memory/ is a sub-package, or a module at the room's top, and imports
# only its own modules and the stages or jobs on floors below it, so a change to a stage touches
# nothing beneath it and the room has no cycle.
INNER_FLOORS = {
    "pipeline": {"types": 1, "format": 2, "counting": 3, "selection": 3, "decisions": 3, "budget": 4,
                 "conversation": 5, "rendering": 6, "assemble": 7},
    "memory": {"embedders": 1, "embedded_redis": 1, "search": 2, "store": 3, "service": 4},
}


def _inner(module: str, room: str) -> str | None:
    """The stage or job of ``room`` that ``module`` belongs to (None: outside the room, or its ``__init__``)."""
    prefix = f"ibex_context.{room}."
    return module.removeprefix(prefix).split(".")[0] if module.startswith(prefix) else None


def _inner_upward(graph: dict[str, set[str]], floors: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for room, table in floors.items():
        for a, targets in graph.items():
            for b in targets:
                below, above = _inner(a, room), _inner(b, room)
                if below and above and below != above and table[above] >= table[below]:
                    out.append(f"{a} -> {b}")
    return sorted(out)


def test_inner_upward_imports_are_found() -> None:
    floors = {"pipeline": {"types": 1, "counting": 2, "rendering": 3}}
    graph = {"ibex_context.pipeline.counting.count": {"ibex_context.pipeline.rendering.format",
                                                      "ibex_context.pipeline.types",
                                                      "ibex_context.pipeline.counting.tokens"},
             "ibex_context.pipeline.rendering.format": {"ibex_context.pipeline.counting.count"},
             "ibex_context.pipeline.counting.tokens": set(), "ibex_context.pipeline.types": set(),
             "ibex_context.pipeline": {"ibex_context.pipeline.rendering.format"},
             "ibex_context.worker.w": {"ibex_context.pipeline.rendering.format"}}
    assert _inner_upward(graph, floors) == [
        "ibex_context.pipeline.counting.count -> ibex_context.pipeline.rendering.format"]
    floors["pipeline"]["counting"] = 3  # along a floor is not below it
    assert _inner_upward(graph, floors) == [
        "ibex_context.pipeline.counting.count -> ibex_context.pipeline.rendering.format",
        "ibex_context.pipeline.rendering.format -> ibex_context.pipeline.counting.count"]


def test_every_stage_is_on_an_inner_floor_and_imports_only_below_it() -> None:
    graph = _graph()
    for room, table in INNER_FLOORS.items():
        inside = {stage for name in graph if (stage := _inner(name, room))}
        assert inside == set(table), f"{room}/: {sorted(inside ^ set(table))} (add it to INNER_FLOORS)"
    upward = _inner_upward(graph, INNER_FLOORS)
    assert not upward, "imports along or up an inner floor:\n" + "\n".join(upward)
