"""The package's shape: the public names resolve, subpackages import only downward, and no
module imports itself back through others at import time.

Layers, highest first (a module may import its own layer and any below it):
the public API and CLI (`streamengine/__init__.py`, `__main__.py`) > ray > server > engine >
models > sched, sample > structured, spec, lora > kv > config > tenancy > the base modules (errors,
sequence, checkout). `kernels/` imports nothing from the engine (test_packaging.py); the
package's `__version__` may be read from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import streamengine

PACKAGE = Path(streamengine.__file__).parent
RANKS = {"api": 10, "ray": 9, "server": 8, "engine": 7, "models": 6, "sched": 5, "sample": 5,
         "structured": 4, "spec": 4, "lora": 4, "kv": 3, "config": 2, "tenancy": 1, "base": 0, "kernels": 0, "web": 0}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if module in ("streamengine", "streamengine.__main__"):
        return "api"
    if module == "streamengine.config":
        return "config"
    if len(parts) >= 2 and parts[1] in RANKS:
        return parts[1]
    return "base"  # streamengine.errors, .sequence, .checkout


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The streamengine modules `path` imports; with `top_level_only`, only those imported when
    it is imported (not inside functions, not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    nodes = _top_level(tree.body) if top_level_only else ast.walk(tree)
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("streamengine"):
            if node.module == "streamengine" and all(a.name == "__version__" for a in node.names):
                continue
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("streamengine"))
    return found


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    out: list[ast.stmt] = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.If | ast.Try):
            out += _top_level(node.body) + _top_level(getattr(node, "orelse", []))
        out.append(node)
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if "kernels" not in p.relative_to(PACKAGE).parts[:1]}


def test_every_public_name_resolves():
    for name in streamengine.__all__:
        assert getattr(streamengine, name) is not None, name


def test_subpackages_import_only_their_own_layer_or_lower():
    upward = []
    for name, path in modules().items():
        for target in imports(path, top_level_only=False):
            if RANKS[layer(target)] > RANKS[layer(name)]:
                upward.append(f"{name} ({layer(name)}) imports {target} ({layer(target)})")
    assert upward == []


def test_no_import_circle():
    # A package's own __init__ runs before any of its modules: importing it back is no circle.
    graph = {name: {t for t in imports(path, top_level_only=True) if t in modules() and not name.startswith(t)}
             for name, path in modules().items()}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError("import circle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_both_engines_provide_the_engine_client_protocol():
    """The server is typed against EngineClient; AsyncEngine and ClusterEngine must each define
    every member (parsed, so the Ray extra need not be installed)."""
    from streamengine.engine.client import EngineClient

    wanted = {name for name in vars(EngineClient) if not name.startswith("_")}
    assert {"generate", "abort", "stats", "tokenizer"} <= wanted
    for path, cls, bases in (("engine/async_engine.py", "AsyncEngine", ("engine/pin_keeper.py", "engine/lora_admin.py")),
                             ("ray/cluster_engine.py", "ClusterEngine", ())):
        defined = _members(PACKAGE / path, cls)
        for base in bases:
            defined |= _members(PACKAGE / base, None)
        assert wanted - defined == set(), f"{cls} lacks {sorted(wanted - defined)}"


def _members(path: Path, cls: str | None) -> set[str]:
    """Names a class defines (`cls`, or every class of the module): methods, properties,
    class attributes, and attributes set on `self` in its methods."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and cls in (None, node.name):
            for item in ast.walk(node):
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self" \
                        and isinstance(item.ctx, ast.Store):
                    names.add(item.attr)
    return names


def test_kv_cache_layers_import_downward():
    """Inside kv/: the pool knows nothing of the manager or of retention, retention nothing of
    the manager (block_manager.py > retention.py > block_pool.py)."""
    order = ["streamengine.kv.block_pool", "streamengine.kv.retention", "streamengine.kv.block_manager"]
    found = modules()
    for rank, module in enumerate(order):
        above = set(order[rank + 1:])
        assert not imports(found[module], top_level_only=False) & above, module
