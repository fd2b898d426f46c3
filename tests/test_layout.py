"""The import graph of the package code has no loops and no import from a lower layer to a higher one.

Read from the source with `ast` (nothing is imported): every `import` and `from ... import` of every .py
file under search_r1/, retriever_server/ and verl_ext/, at module level or inside a function, relative
forms resolved. An edge goes to the project module named: `from a.b import c` to `a.b.c` when that is a
module, else to `a.b`. Parent packages that Python runs on the way (`a/__init__.py` for `a.b`) are not
edges, or every package importing its own submodules would be a loop. Names imported by string
(`importlib.import_module`, lazy `__getattr__` exports, verl's registries) are not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("search_r1", "retriever_server", "verl_ext")

# Layers, lowest first; a module belongs to the layer of the longest prefix that names it (so `search_r1`
# holds every top-level module of search_r1 not named further up). A module may import its own layer and
# the ones below, never one above; within a layer only loops are forbidden.
LAYERS = (
    # A separate service: imports nothing of search_r1 (ARCHITECTURE.md). search_r1 starts it for a run
    # (launcher), builds the default index (indexes) and reads index manifests, so it sits below.
    ("retriever_server",),
    # The shared core: protocol, prompts, rewards, scoring, algos, models, dtypes, paths, logs, net, ...
    ("search_r1",),
    # What one rollout needs: the search engines, the multi-turn loop and its generators, the datasets.
    ("search_r1.search", "search_r1.rollout", "search_r1.data"),
    # The embedded trainer (fit loop, workers, checkpoints, warm-start).
    ("search_r1.trainer",),
    # Users of the trainer's output: the evaluation loads its checkpoints; the single-process GRPO API.
    ("search_r1.evaluation", "search_r1.grpo"),
    # Inference agents over everything above (chat models from grpo, batches scored like the evaluation).
    ("search_r1.agents",),
    # verl's plugin: the only code that touches verl internals, on top of search_r1.
    ("verl_ext",),
)


def module_files(root: Path = REPO, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` (a package is its __init__.py)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _longest_module(name: str, files) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in files:
            return ".".join(parts[:i])
    return None


def imports_of(module: str, path: Path, files: dict[str, Path]) -> set[str]:
    """The project modules `path` (the file of `module`) imports, anywhere in it."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_longest_module(alias.name, files) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package holding `module` (itself, for a package)
                base = module.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            for alias in node.names:  # `from a.b import c`: the module a.b.c when there is one, else a.b
                child = f"{prefix}.{alias.name}"
                targets.add(child if child in files else _longest_module(prefix, files))
    targets.discard(None)
    targets.discard(module)
    return targets


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    return {module: imports_of(module, path, files) for module, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str, layers=LAYERS) -> int:
    best, best_len = None, -1
    for i, prefixes in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best is None:
        raise LookupError(f"{module} is in no layer of LAYERS (tests/test_layout.py); add its package")
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    return [f"{m} (layer {layer_of(m, layers)}) imports {t} (layer {layer_of(t, layers)})"
            for m in sorted(graph) for t in sorted(graph[m]) if layer_of(t, layers) > layer_of(m, layers)]


def _files_of(modules: list[str], files: dict[str, Path]) -> list[str]:
    return [str(files[m].relative_to(REPO)) for m in modules]


@pytest.fixture(scope="module")
def project():
    files = module_files()
    return files, import_graph(files)


def test_the_package_code_has_no_import_loop(project):
    files, graph = project
    loops = [" <-> ".join(_files_of(c, files)) for c in cycles(graph)]
    assert not loops, "import loops (move what both sides need into a module below both):\n" + "\n".join(loops)


def test_no_module_imports_a_higher_layer(project):
    _, graph = project
    up = upward_imports(graph)
    assert not up, "imports from a lower layer to a higher one (LAYERS in tests/test_layout.py):\n" + "\n".join(up)


def test_the_graph_sees_the_imports_the_layers_rest_on(project):
    """Guards the scan itself: a few edges the code is known to have, each import form once."""
    _, graph = project
    assert "search_r1.rewards" in graph["search_r1.scoring"]                   # from x import name
    assert "retriever_server.conventions" in graph["retriever_server.encoder"]  # from .x import name
    assert "verl_ext.cpu" in graph["verl_ext"]                                   # import a.b
    assert "search_r1.agents.cli" in graph["search_r1.agents.toolcall"]         # inside a function
    assert "search_r1.agents.prompts" in graph["search_r1.agents.weaver"]       # from pkg import module
    assert "search_r1.agents" not in graph["search_r1.agents.weaver"]


def test_the_checker_catches_a_loop_and_an_upward_import(tmp_path):
    """A synthetic project: low.a <-> low.b loop (one import relative, one inside a function) and
    low.a importing high.c."""
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "low" / "a.py").write_text("from . import b\n\ndef f():\n    from high.c import g\n")
    (tmp_path / "low" / "b.py").write_text("def h():\n    import low.a\n")
    (tmp_path / "high" / "c.py").write_text("from low.b import h\n\ndef g():\n    pass\n")
    files = module_files(tmp_path, ("low", "high"))
    graph = import_graph(files)
    assert graph["low.a"] == {"low.b", "high.c"} and graph["low.b"] == {"low.a"} and graph["high.c"] == {"low.b"}
    assert cycles(graph) == [["high.c", "low.a", "low.b"]]
    assert upward_imports(graph, (("low",), ("high",))) == ["low.a (layer 0) imports high.c (layer 1)"]
    assert upward_imports(graph, (("low", "high"),)) == []


def test_every_benchmark_compiles():
    """bench/ and bench/studies/ are scripts no test imports; they must at least still parse."""
    scripts = sorted((REPO / "bench").rglob("*.py"))
    assert any(p.parent.name == "studies" for p in scripts)
    for path in scripts:
        compile(path.read_text(), str(path), "exec")


def test_the_benchmarks_page_lists_every_bench_script():
    """docs/benchmarks.md names every script under bench/ (studies included), so none is orphaned."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    scripts = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "bench").rglob("*.py"))
    assert scripts and not [s for s in scripts if f"`{s}`" not in page], \
        [s for s in scripts if f"`{s}`" not in page]
