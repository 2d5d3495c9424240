"""No import circles inside raygraph: with dependencies going one way, any module imports on
its own, in any order, and a lower layer (protocol, config, graph, memory, model) reads
without the ones above it (engine, worker, api, ...). Found from the source with `ast`,
without importing the package; imports under TYPE_CHECKING and inside functions count: a
circle hidden from the interpreter is still a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "raygraph"


def module_name(path: Path) -> str:
    """Dotted name of a source file; a package's __init__.py is the package itself."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str, modules: set[str]) -> set[str]:
    """The raygraph modules that `name` (read from `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(sub if (sub := f"{base}.{alias.name}") in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Every raygraph module and the raygraph modules it imports."""
    paths = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: imports_of(path, name, set(paths)) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first walk: none exactly when the graph is acyclic."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt in stack:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node, [])
    return found


def test_graph_is_read() -> None:
    """An empty or misread graph would pass the cycle test without checking anything."""
    graph = import_graph()
    assert "raygraph.config" in graph and "raygraph.lora" in graph
    assert "raygraph.lora.adapter" in graph["raygraph.lora"]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    for cycle in found:
        print(" -> ".join(m.removeprefix("raygraph.") for m in cycle))
    assert not found, f"{len(found)} import cycle(s) in raygraph; see the chains printed above"


# Layers from the bottom up: a module imports only its own layer and the ones below it. The
# shared modules come first; then the model, the device-side libraries, the worker (one per
# GPU), the engine (one per replica), the coordinator (the front), and what clients run.
LAYERS: list[set[str]] = [
    {"protocol", "errors", "config", "generation", "adapter_files", "hub", "tokenizer",
     "process", "requests", "serve_options", "channel", "quantization", "grammar"},
    {"model"},
    {"memory", "graph", "lora"},
    {"worker"},
    {"engine"},
    {"coordinator"},
    {"client"},
    {"api", "llm", "cli", "__init__"},
]
# processes that carry requests, not steps: they never load the engine's or a GPU's code
FRONT = {"client", "api"}
DEVICE_SIDE = {"engine", "worker", "graph", "memory", "lora"}


def top_package(module: str) -> str:
    """raygraph.engine.core -> engine; raygraph -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    top = top_package(module)
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_package_has_a_layer() -> None:
    """A new package must be placed: it would otherwise escape the checks below."""
    for module in import_graph():
        assert any(top_package(module) in names for names in LAYERS), module


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Each import that points up a layer, or from the front into device-side code."""
    found = []
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            if layer_of(b) > layer_of(a):
                found.append(f"{a} -> {b} (a higher layer)")
            elif top_package(a) in FRONT and top_package(b) in DEVICE_SIDE:
                found.append(f"{a} -> {b} (front into device-side code)")
    return found


def test_no_upward_imports() -> None:
    found = violations(import_graph())
    assert not found, "\n".join(found)


def test_layer_check_catches_bad_imports() -> None:
    graph = {"raygraph.engine.core": {"raygraph.coordinator.router"},
             "raygraph.api.metrics": {"raygraph.engine.kv_cache"},
             "raygraph.cli": {"raygraph.engine.lockstep", "raygraph.protocol"}}
    assert violations(graph) == [
        "raygraph.api.metrics -> raygraph.engine.kv_cache (front into device-side code)",
        "raygraph.engine.core -> raygraph.coordinator.router (a higher layer)"]


def test_the_engine_and_coordinator_start_workers_without_torch() -> None:
    """The engine creates its workers from WorkerActor: torch and the model code load in the
    workers' processes, not in the engine's or the coordinator's while they start."""
    code = ("import sys, raygraph.coordinator.coordinator, raygraph.engine.engine, "
            "raygraph.worker.actor; "
            "print(sorted(m for m in ('torch', 'raygraph.worker.worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
