"""The import graph and file sizes of the shipped code (docs/architecture.md, "Layering rules").

Every ``.py`` file under sidecar/, clients/, bench/, examples/ and workloads/ is parsed with ``ast``
(never imported), and every import statement in it counts, wherever it sits: module level, inside a
function, under ``if TYPE_CHECKING:``. Relative imports are resolved against the file's package;
``from a.b import c`` is an edge to the module ``a.b.c`` when that is a module of the tree, else
to ``a.b``; ``import a.b.c`` is an edge to ``a.b.c`` only (the parent packages it also runs are
not edges). A package's ``__init__`` is a node of its own, named after the package.

Rules, one test each:

* no import cycles (the message names each cycle as a path of modules and import lines);
* layering: what each layer may not import (``LAYERS``);
* transitive layering: what each layer may not reach through any chain of imports within the
  tree (``REACH``; the message names the chain, each import with its line);
* no source file over ``MAX_LINES`` lines unless its module docstring says "over 600 lines"
  and why (generated protobuf / gRPC stubs are exempt).

tests/ is held to one rule of its own: only the benchmarks' tests (tests/bench/) import ``bench``;
tests may import ``workloads`` and anything else.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sidecar", "clients", "bench", "examples", "workloads")
MAX_LINES = 600
LONG_FILE_PHRASE = "over 600 lines"

#: packages that hold the domain: no transport, no wire, no edge
DOMAIN = ("registry", "tiers", "rotation", "directives", "claims", "manifests", "shm", "dataplane", "limits",
          "routing")
TRANSPORT = ("grpc", "grpc_*")  # grpc, and its companions (grpc_health, grpc_reflection, ...)
STUBS = ("sidecar.v1",)  # the generated stubs (protoc's path for the proto package sidecar.v1)
#: the product (bench/ and tests/ are raw-gRPC users of the wire and the metrics endpoint)
PRODUCT = ("sidecar", "clients", "examples")
#: what the domain never imports, directly or through any chain of imports
DOMAIN_NEVER = (*TRANSPORT, "prometheus_client", "sidecar.api", "sidecar.server", "sidecar.sdk", "sidecar.app",
                "sidecar.cli", "sidecar.v1")


@dataclass(frozen=True)
class Layer:
    """Modules matching ``who`` (and not ``exempt``) import nothing matching ``never``.

    A pattern ``a.b`` matches ``a.b`` and everything below it; ``a_*`` matches any top-level
    name starting with ``a_`` and everything below it."""

    rule: str
    who: tuple[str, ...]
    never: tuple[str, ...]
    exempt: tuple[str, ...] = ()


LAYERS = (
    Layer("domain_is_transport_free", tuple(f"sidecar.{d}" for d in DOMAIN), DOMAIN_NEVER),
    # auth builds the transport's credentials (grpc), and is still below the edge
    Layer("auth_below_the_edge", ("sidecar.auth",),
          ("prometheus_client", "sidecar.api", "sidecar.server", "sidecar.sdk", "sidecar.app", "sidecar.cli")),
    Layer("api_below_server_and_sdk", ("sidecar.api",),
          ("sidecar.server", "sidecar.sdk", "sidecar.app", "sidecar.cli")),
    Layer("server_not_on_sdk_or_cli", ("sidecar.server",), ("sidecar.sdk", "sidecar.cli")),
    Layer("sdk_not_on_server", ("sidecar.sdk",),
          ("sidecar.server", "sidecar.app", "sidecar.cli", "sidecar.dataplane")),
    Layer("stubs_only_through_api", PRODUCT, STUBS, exempt=("sidecar.api", "sidecar.v1")),
    Layer("prometheus_only_in_server", PRODUCT, ("prometheus_client",), exempt=("sidecar.server",)),
    Layer("sidecar_not_on_clients_or_bench", ("sidecar",), ("clients", "bench", "examples")),
    # the engine code does not depend on the benchmarks' traffic generators and their data
    Layer("product_not_on_workloads", ("sidecar", "clients"), ("workloads",)),
    # shared by the benchmarks and the tests, so it depends on neither
    Layer("workloads_not_on_bench_or_tests", ("workloads",), ("bench", "tests")),
)

#: Rules that hold for every chain of imports: importing a module of ``who`` runs nothing that
#: imports ``never`` (a domain module that imports a shared module that imports grpc does reach it).
REACH = (
    Layer("domain_reaches_no_transport", tuple(f"sidecar.{d}" for d in DOMAIN), DOMAIN_NEVER),
)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str  # a module of the tree, or an outside module as written
    path: str  # the importing file, relative to the repository root
    line: int  # 0: no import line; ``dst`` is a package of ``src``, whose ``__init__`` runs first

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst} ({self.path}:{self.line})" if self.line else \
            f"{self.src} -> {self.dst} (its package, run first)"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def source_files() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under ``PACKAGES`` (no caches, no hidden folders)."""
    out = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).parts
            if any(p.startswith(".") or p == "__pycache__" for p in rel):
                continue
            out[_module_name(path)] = path
    return out


def _imports(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Edge]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = str(path.relative_to(ROOT))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, rel, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                if node.level - 1 > len(base_parts):
                    raise AssertionError(f"{rel}:{node.lineno}: relative import beyond the top-level package")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                yield Edge(module, sub if sub in modules else base, rel, node.lineno)


@cache
def edges() -> tuple[Edge, ...]:
    modules = source_files()
    return tuple(e for m, p in modules.items() for e in _imports(m, p, modules))


def _matches(name: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return name == pattern or name.startswith(pattern + ".")


def _first_cycle(scc: set[str], graph: dict[str, dict[str, Edge]]) -> list[Edge]:
    """One cycle inside a strongly connected component, as the edges that close it."""
    start = min(scc)
    # Breadth-first from ``start`` inside the component back to ``start``: the shortest cycle
    # through it, which is the easiest one to read.
    prev: dict[str, Edge] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for node in frontier:
            for dst, edge in sorted(graph[node].items()):
                if dst not in scc:
                    continue
                if dst == start:
                    path = [edge]
                    while path[0].src != start:
                        path.insert(0, prev[path[0].src])
                    return path
                if dst not in seen:
                    seen.add(dst)
                    prev[dst] = edge
                    nxt.append(dst)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in its component {sorted(scc)}")


def cycles() -> list[list[Edge]]:
    """One cycle per strongly connected component of the module graph (Tarjan, iterative)."""
    modules = source_files()
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for e in edges():
        if e.dst in modules:
            graph[e.src].setdefault(e.dst, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[Edge]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            child = next(it, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.add(m)
                    if m == node:
                        break
                if len(scc) > 1 or node in graph[node]:
                    found.append(_first_cycle(scc, graph))
    return found


def test_no_import_cycles() -> None:
    found = cycles()
    if found:
        pytest.fail(f"{len(found)} import cycle(s):\n" + "\n".join(
            "  " + " -> ".join([c[0].src] + [e.dst for e in c]) + "\n" + "".join(f"      {e}\n" for e in c)
            for c in found
        ), pytrace=False)


@pytest.mark.parametrize("layer", LAYERS, ids=[layer.rule for layer in LAYERS])
def test_layering(layer: Layer) -> None:
    bad = [
        e for e in edges()
        if any(_matches(e.src, w) for w in layer.who)
        and not any(_matches(e.src, x) for x in layer.exempt)
        and any(_matches(e.dst, n) for n in layer.never)
    ]
    scope = ", ".join(layer.who) + (f" (except {', '.join(layer.exempt)})" if layer.exempt else "")
    if bad:
        pytest.fail(f"{scope} must not import {', '.join(layer.never)}:\n" + "".join(f"  {e}\n" for e in bad),
                    pytrace=False)


def _parents(module: str, modules: dict[str, Path]) -> list[str]:
    """The packages of the tree whose ``__init__`` importing ``module`` runs first."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules]


def reach_violations(layer: Layer) -> dict[str, list[Edge]]:
    """Each module of ``layer.who`` that reaches ``layer.never`` -> the shortest chain of imports
    that does (breadth-first over the tree's modules; an import also runs the ``__init__`` of the
    packages above the imported module, so those are followed too, at the same import line)."""
    modules = source_files()
    graph: dict[str, list[Edge]] = {m: [] for m in modules}
    for e in edges():
        graph[e.src].append(e)
        if e.dst in modules:
            graph[e.src].extend(Edge(e.src, p, e.path, e.line) for p in _parents(e.dst, modules))
    found: dict[str, list[Edge]] = {}
    for start in sorted(m for m in modules if any(_matches(m, w) for w in layer.who)
                        and not any(_matches(m, x) for x in layer.exempt)):
        prev = {p: Edge(start, p, str(modules[start].relative_to(ROOT)), 0) for p in _parents(start, modules)}
        seen = {start, *prev}
        frontier = [start, *prev]
        hit = None
        while frontier and hit is None:
            nxt = []
            for node in frontier:
                for e in graph[node]:
                    if any(_matches(e.dst, n) for n in layer.never):
                        hit = e
                        break
                    if e.dst in modules and e.dst not in seen:
                        seen.add(e.dst)
                        prev[e.dst] = e
                        nxt.append(e.dst)
                if hit is not None:
                    break
            frontier = nxt
        if hit is not None:
            chain = [hit]
            while chain[0].src in prev:
                chain.insert(0, prev[chain[0].src])
            found[start] = chain
    return found


@pytest.mark.parametrize("layer", REACH, ids=[layer.rule for layer in REACH])
def test_layering_transitive(layer: Layer) -> None:
    found = reach_violations(layer)
    if found:
        pytest.fail(f"{', '.join(layer.who)} must not reach {', '.join(layer.never)} through any chain of imports; "
                    f"{len(found)} module(s) do:\n" + "".join(
                        "  " + " -> ".join([chain[0].src] + [e.dst for e in chain]) + "\n"
                        + "".join(f"      {e}\n" for e in chain)
                        for chain in found.values()), pytrace=False)


def _generated(path: Path, text: str) -> bool:
    head = text[:500]
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or "DO NOT EDIT" in head


def test_file_length() -> None:
    long = []
    for path in source_files().values():
        text = path.read_text(encoding="utf-8")
        n = len(text.splitlines())
        if n <= MAX_LINES or _generated(path, text):
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if LONG_FILE_PHRASE not in " ".join(doc.split()):
            long.append(f"  {path.relative_to(ROOT)}: {n} lines")
    if long:
        pytest.fail(f"files over {MAX_LINES} lines whose module docstring does not say why ('{LONG_FILE_PHRASE}: "
                    "<reason>'); split them or give the reason:\n" + "\n".join(long), pytrace=False)


# ------------------------------------------------------------------ tests and benchmarks


def test_tests_never_import_bench():
    """What a test and a benchmark share lives in the product (``sidecar.process``,
    ``clients.vllm.run``, ``clients.vllm.layouts``, ``sidecar.rotation.drift``) or in
    ``workloads/`` (the agent-traffic generators and chat templates); only the benchmarks' own
    tests (tests/bench/) import ``bench``."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/bench/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            offenders += [f"  {rel}:{node.lineno}: {name}\n" for name in names if _matches(name, "bench")]
    if offenders:
        pytest.fail("tests outside tests/bench/ must not import bench (share through the product or workloads/):\n"
                    + "".join(offenders), pytrace=False)
