"""The package layering: who may import whom, read from the source (every import, lazy ones too).

memspec is the product; the lab (lab/memspec_lab: benchmarks, simulator, testbed, relay) imports
it, and memspec never imports the lab but in memspec/cli/lab.py, which runs the lab's commands."""

from __future__ import annotations

import ast
from pathlib import Path

import memspec

ROOT = Path(memspec.__file__).parent
LAB = ROOT.parent / "lab" / "memspec_lab"
# The one module of memspec that imports the lab: the `memspec` commands that are the lab's.
LAB_DOOR = ROOT / "cli" / "lab.py"


def _part(module: str) -> str | None:
    """The package (or top-level module) of memspec a dotted name belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "memspec" and len(parts) > 1 else None


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from memspec import drafts` names the package in the alias, not the module.
            if node.module == "memspec":
                names.update(f"memspec.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    """part → the other parts it imports."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        src = _part("memspec." + ".".join(path.relative_to(ROOT).with_suffix("").parts))
        if src is None:
            continue
        targets = {_part(name) for name in _imports(path)} - {None, src}
        graph.setdefault(src, set()).update(t for t in targets if t)
    return graph


def test_engine_imports_only_backends_and_leaves():
    assert _graph()["engine"] <= {"backends", "compat", "errors", "paths", "units"}


def test_compat_is_a_leaf():
    """memspec.compat (the Python 3.10 backports) may be imported from anywhere: it imports
    nothing of memspec."""
    assert not {n for n in _imports(ROOT / "compat.py") if n.split(".")[0] == "memspec"}


def test_drafts_and_backends_do_not_import_the_scheduler_or_server():
    graph = _graph()
    for part in ("drafts", "backends"):
        assert not graph[part] & {"scheduler", "server"}, part


def _reach(graph: dict[str, set[str]], part: str) -> set[str]:
    """Every part `part` imports, directly or through others."""
    seen: set[str] = set()
    todo = [part]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


# What the daemon serves from: none of it may reach the draft build recipes.
SERVING = (
    "drafts",
    "scheduler",
    "engine",
    "runtime",
    "request_check",
    "draft_admin",
    "embeddings",
    "backends",
    "predictor",
    "memory",
)


def test_serving_parts_do_not_import_the_recipes():
    """memspec.recipes builds drafts; the drafts, the engine, the scheduler and the runtime serve
    them and never import their builders, not even through another part."""
    graph = _graph()
    assert "recipes" in graph
    for part in SERVING:
        assert "recipes" not in _reach(graph, part), part


def test_recipes_import_only_what_they_build_for():
    """Recipes may import the runtime drafts, the engine and the backends (and the leaves),
    nothing above them."""
    leaves = {"compat", "errors", "files", "paths", "units"}
    allowed = {"backends", "config", "drafts", "engine"} | leaves
    assert _graph()["recipes"] <= allowed


def _lab_imports(path: Path) -> set[str]:
    """The lab modules `path` imports: import statements, and importlib.import_module or
    __import__ of a literal name."""
    names = {n for n in _imports(path) if n.split(".")[0] == "memspec_lab"}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0].value
            if called in ("import_module", "__import__") and isinstance(arg, str):
                if arg.split(".")[0] == "memspec_lab":
                    names.add(arg)
    return names


def test_memspec_never_imports_the_lab():
    """No module of memspec imports memspec_lab, lazily or not, but the CLI's door to the lab's
    commands (memspec/cli/lab.py): the daemon, memspec-ctl and every product command run
    without the lab installed."""
    importers = {
        str(path.relative_to(ROOT)): names
        for path in ROOT.rglob("*.py")
        if path != LAB_DOOR and (names := _lab_imports(path))
    }
    assert not importers, importers
    assert _lab_imports(LAB_DOOR) == {"memspec_lab.cli"}  # the door is where this test says


def test_the_lab_imports_memspec_and_lives_apart():
    """The lab imports memspec (never the reverse), and none of it is left inside memspec."""
    assert LAB.is_dir(), LAB
    lab_modules = list(LAB.rglob("*.py"))
    assert any(n.split(".")[0] == "memspec" for path in lab_modules for n in _imports(path)), (
        "the lab imports memspec"
    )
    assert not {"bench", "sim", "testbed"} & {p.stem for p in ROOT.iterdir()}


def test_predictor_does_not_import_sim():
    """The predictor is the runtime part (model + features); training on traces lives in the
    lab's sim (memspec_lab.sim), which the predictor never imports."""
    base = ROOT / "predictor"
    assert not set().union(*(_lab_imports(p) for p in base.rglob("*.py")))


def test_no_import_cycle_between_packages():
    graph = _graph()
    # Depth-first search with colours: reaching a grey node again closes a cycle.
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "grey"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                stack = path + [node]
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "black"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


# The data path, top to bottom: a request enters the server, is routed to its model's runtime
# (targets: the resident models under one budget), which checks it (request_check, naming the
# drafts draft_admin knows) and whose scheduler picks drafts that the engine runs on the
# backends. The runtime is the composition root that builds and wires the parts below it
# (embeddings: the embedding context). Each layer imports only layers below it: no arrow up.
DATA_PATH = (
    "server",
    "targets",
    "runtime",
    "request_check",
    "draft_admin",
    "embeddings",
    "scheduler",
    "engine",
    "backends",
)


def test_the_data_path_has_no_arrow_up():
    graph = _graph()
    for i, part in enumerate(DATA_PATH):
        above = set(DATA_PATH[:i])
        assert not _reach(graph, part) & above, (part, _reach(graph, part) & above)


def test_the_model_catalog_loads_nothing():
    """memspec.catalog names the servable models from their files: it never reaches a
    runtime, the scheduler or the server."""
    assert not _reach(_graph(), "catalog") & {"runtime", "targets", "scheduler", "server"}


def test_the_model_scheduler_decides_and_loads_nothing_itself():
    """memspec.scheduler.models owns model residency (which model is resident, when to
    switch, expiry, prefetch) in the scheduler layer: it is handed the pool of resident models
    (memspec.targets) and the loader as callables, and imports neither them, the runtime nor
    the server; the worker asks it and never imports the residency policies itself."""
    mine = {n for n in _imports(ROOT / "scheduler" / "models.py") if n.startswith("memspec.")}
    assert not {_part(n) for n in mine} & {"targets", "runtime", "server", "backends"}, mine
    worker = _imports(ROOT / "server" / "worker.py")
    assert "memspec.scheduler.models" in worker
    assert "memspec.scheduler.residency" not in worker


# Below the HTTP body (the routes' pydantic schemas), a generation takes three shapes on its
# way down, each built in one layer: the client's ask (ClientRequest, by the routes), the one
# this model can run as it is (GenerationRequest: tokens, every check, RequestCheck.check), and
# the engine's running sequence (Sequence, by the runtime; speculative_generate makes its own
# for callers of the engine alone). Beside them the policies read a view of it (Request: text,
# turns, length), which the simulator builds from a trace, without a target's tokens.
# (The lab's benchmarks and simulator build them too, from outside: memspec_lab.)
REQUEST_SHAPES = {
    "ClientRequest": {"server"},
    "GenerationRequest": {"runtime", "request_check"},
    "Sequence": {"runtime", "engine"},
    "Request": {"scheduler"},
}


def _constructed(name: str) -> set[str]:
    """The parts of memspec whose code calls `name(...)`."""
    parts = set()
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == name
            ):
                parts.add(path.relative_to(ROOT).parts[0].removesuffix(".py"))
    return parts


def test_a_request_takes_three_shapes_each_built_in_one_layer():
    for shape, layers in REQUEST_SHAPES.items():
        assert _constructed(shape) <= layers, (shape, _constructed(shape) - layers)
    # No other shape: nothing else below the routes carries a prompt and its sampling.
    carriers = set()
    for part in DATA_PATH[1:]:
        base = ROOT / part
        for path in base.rglob("*.py") if base.is_dir() else [base.with_suffix(".py")]:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    fields = {
                        s.target.id
                        for s in node.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    }
                    if {"prompt", "max_tokens"} <= fields or {"prompt", "params"} <= fields:
                        carriers.add(node.name)
    assert carriers <= set(REQUEST_SHAPES), carriers - set(REQUEST_SHAPES)
