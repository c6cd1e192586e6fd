"""Import hygiene, in fresh subprocesses: the spec pulls in no framework, each frontend pulls in only its own,
both frontends export the same op names, and no module of the project imports itself back through another.
Both frontends must be installed: a missing one fails these tests (they never skip).
"""

import ast
import functools
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

FRAMEWORKS = ("torch", "jax", "jaxlib", "tensorflow")
PACKAGES = ("commlib", "commlib_torch", "commlib_jax")


@functools.cache
def _loaded_after(statement: str) -> dict:
    """Run `statement` in a fresh interpreter; report which frameworks it loaded, the frontends' __all__ and
    the modules of the project's tools (``commlib.tools``, ``commlib_torch.tools``, ...) it loaded."""
    probe = f"""
import json, sys
{statement}
frameworks = sorted({{name.split(".")[0] for name in sys.modules}} & set({FRAMEWORKS!r}))
tools = sorted(name for name in sys.modules if name.split(".")[0] in {PACKAGES!r} and "tools" in name.split("."))
exports = {{}}
for name in ("commlib_torch", "commlib_jax"):
    if name in sys.modules:
        exports[name] = list(getattr(sys.modules[name], "__all__", []))
print(json.dumps({{"frameworks": frameworks, "exports": exports, "tools": tools}}))
"""
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


SPEC_MODULES = sorted(path.stem for path in (ROOT / "commlib").glob("*.py") if path.stem != "__init__")


@pytest.mark.parametrize(
    "statement",
    [
        "import commlib",
        "import " + ", ".join(f"commlib.{module}" for module in SPEC_MODULES),
        "import commlib.tools.cases, commlib.tools.parity, commlib.tools.bench, commlib.tools.cli",
    ],
)
def test_spec_imports_no_framework(statement):
    assert _loaded_after(statement)["frameworks"] == []


def test_torch_frontend_imports_no_jax():
    loaded = _loaded_after("import commlib_torch")["frameworks"]
    assert "torch" in loaded
    assert "jax" not in loaded and "jaxlib" not in loaded


def test_jax_frontend_imports_no_torch():
    loaded = _loaded_after("import commlib_jax")["frameworks"]
    assert "jax" in loaded
    assert "torch" not in loaded


def _op_names(frontend: str) -> set[str]:
    return set(_loaded_after(f"import {frontend}")["exports"][frontend])


def test_frontends_export_the_same_names():
    from commlib import OP_NAMES

    torch_names, jax_names = _op_names("commlib_torch"), _op_names("commlib_jax")
    assert set(OP_NAMES) <= torch_names
    assert set(OP_NAMES) <= jax_names
    assert {name for name in torch_names if not name[0].isupper()} == {
        name for name in jax_names if not name[0].isupper()
    }, "the frontends' functions differ (classes such as DeviceCommunicator / Communicator may)"


def test_attention_modules_export_the_same_names():
    probe = "import commlib_{0}.attention as m; print(sorted(m.__all__))"
    names = [
        subprocess.run(
            [sys.executable, "-c", probe.format(frontend)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
            check=True,
        ).stdout
        for frontend in ("torch", "jax")
    ]
    torch_names, jax_names = (ast.literal_eval(text) for text in names)
    assert torch_names == jax_names
    assert {"ulysses_attention", "ring_attention", "usp_attention"} <= set(torch_names)


def test_torch_frontend_exports_every_op():
    from commlib import OP_NAMES

    assert set(OP_NAMES) <= _op_names("commlib_torch")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports (at any depth of its code, lazy imports too).
    ``from package import name`` counts as importing ``package.name`` when that is a module, else the package."""
    import ast

    paths = [path for package in ("commlib", "commlib_torch", "commlib_jax") for path in (ROOT / package).rglob("*.py")]
    modules = {_module_name(path): path for path in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges.add(submodule if submodule in modules else node.module)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (a path that starts and ends at the same module), or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported, [*path, imported])):
                return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [module])):
            return found
    return None


def test_no_module_imports_itself_back():
    graph = _import_graph()
    assert len(graph) > 30 and "commlib_torch.functional" in graph["commlib_torch"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _is_tool(module: str) -> bool:
    return "tools" in module.split(".")


def _library_modules(package: str) -> list[str]:
    """Every module of `package` except its tools (the CLI, runners, benches, the worker pool)."""
    paths = (ROOT / package).rglob("*.py")
    return sorted(name for name in map(_module_name, paths) if not _is_tool(name))


def test_the_library_never_imports_its_tools():
    """No module of commlib, commlib_torch or commlib_jax outside ``*.tools`` imports one inside (at any depth of
    its code, lazy imports too): the tools drive the library, never the other way."""
    graph = _import_graph()
    library = [module for module in graph if not _is_tool(module)]
    assert len(library) > 30
    assert [(module, imported) for module in library for imported in sorted(graph[module]) if _is_tool(imported)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_the_library_loads_no_tool(package):
    loaded = _loaded_after("import " + ", ".join(_library_modules(package)))
    assert loaded["tools"] == []


#: Each frontend's walk module and the names it is for: a plan walked on that framework's arrays.
WALK_EXPORTS = {
    "commlib_torch._walk": {"rearrange", "run", "started_walk", "walk"},
    "commlib_jax._walk": {"run"},
}


def _names_taken_from(module: str) -> dict[str, set[str]]:
    """Every name another file of the project (library, tests, benchmarks, examples) takes from `module`: by
    ``from module import name``, or as an attribute of the module imported (``_walk.name``,
    ``commlib_torch._walk.name``) -> the files that take it."""
    package, leaf = module.rsplit(".", 1)
    taken: dict[str, set[str]] = {}
    folders = ("commlib", "commlib_torch", "commlib_jax", "tests", "benchmarks", "examples")
    for path in (path for folder in folders for path in (ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text())
        spellings = {module}  # how the file names the module: commlib_torch._walk, or _walk where imported so
        imports_leaf = any(
            isinstance(node, ast.ImportFrom) and node.module == package and any(a.name == leaf for a in node.names)
            for node in ast.walk(tree)
        )
        if imports_leaf:
            spellings.add(leaf)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in spellings:
                names = [node.attr]
            else:
                continue
            for name in names:
                taken.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return taken


@pytest.mark.parametrize("module", sorted(WALK_EXPORTS))
def test_walk_modules_are_their_walks(module):
    """A frontend's `_walk` holds its walks and nothing else: its ``__all__`` is its walks, each taken by some
    other file (no dead export), every name it imports is used in it (no re-export), and no file takes any
    other name from it (dtype names are in `_dtypes`, ranks in `_groups` / `_vma`, `Started` in `_c10d`)."""
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    (exports,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(target) for target in node.targets] == ["__all__"]
    ]
    assert set(exports) == WALK_EXPORTS[module]
    imported = {
        alias.asname or alias.name.split(".")[0]
        for node in tree.body
        if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.module != "__future__")
        for alias in node.names
    }
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert sorted(imported - used) == []
    taken = _names_taken_from(module)
    assert {name: files for name, files in taken.items() if name not in exports} == {}
    assert set(exports) <= set(taken)


def test_no_library_module_imports_the_references():
    """`commlib.reference`'s docstring: the float64 references import the spec, the library (spec and frontends,
    outside ``*.tools``) never imports a reference, except `commlib.attention`'s re-export of its own."""
    graph = _import_graph()
    found = [
        (module, imported)
        for module, edges in sorted(graph.items())
        if not _is_tool(module) and not module.startswith("commlib.reference")
        for imported in sorted(edges)
        if imported.startswith("commlib.reference")
        and (module, imported) != ("commlib.attention", "commlib.reference.attention")
    ]
    assert found == []
