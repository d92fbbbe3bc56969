"""The package's layers, checked on its import graph (docs/ARCHITECTURE.md draws them).

Every ``import`` in every module, lazy ones inside functions included, may reach only its
own component or a layer below it. Adapters reach the kernels only through the core.
"""

from __future__ import annotations

import ast
import os

import flexattn

PACKAGE = os.path.dirname(flexattn.__file__)

# Bottom to top. A module may import its own component and anything in a lower layer;
# components sharing a layer (the two backends, the adapters) never import each other.
LAYERS = [
    ["flexattn.arrays", "flexattn.bounded"],   # helpers (import nothing of ours)
    ["flexattn.mods"],
    ["flexattn.blockmask"],
    ["flexattn.problem"],
    ["flexattn.reference", "flexattn.kernels"],
    ["flexattn.core"],
    ["flexattn.torch", "flexattn.jax", "flexattn.cupy", "flexattn.dlpack", "flexattn.plotting", "flexattn"],
    ["flexattn.__main__"],   # the demo: python -m flexattn
]
ADAPTERS = ("flexattn.torch", "flexattn.jax", "flexattn.cupy", "flexattn.dlpack")


def _modules():
    for folder, dirs, names in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), os.path.dirname(PACKAGE))
                module = rel[:-3].replace(os.sep, ".")
                is_package = name == "__init__.py"
                yield (module[: -len(".__init__")] if is_package else module), os.path.join(folder, name), is_package


def _imports(module: str, path: str, is_package: bool):
    """(line, absolute module name) of every import of ours in the file."""
    tree = ast.parse(open(path).read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flexattn":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flexattn":
                continue
            for alias in node.names:  # `from pkg import submodule` names the submodule
                yield node.lineno, f"{target}.{alias.name}"


def _component(module: str):
    """(layer index, component) of a module of ours."""
    best = None
    for i, layer in enumerate(LAYERS):
        for comp in layer:
            if (module == comp or module.startswith(comp + ".")) and comp != "flexattn":
                if best is None or len(comp) > len(best[1]):
                    best = (i, comp)
    if best is None:   # the package's own __init__ (and modules placed nowhere)
        best = next((i, "flexattn") for i, layer in enumerate(LAYERS) if "flexattn" in layer)
    return best


def test_every_module_has_a_layer():
    names = {m for m, _, _ in _modules()}
    assert "flexattn.kernels.fwd.sm90" in names and "flexattn.blockmask.layout" in names
    unplaced = [m for m in names if _component(m)[1] == "flexattn" and m != "flexattn"]
    assert not unplaced, f"modules in no layer (add them to LAYERS and ARCHITECTURE.md): {unplaced}"


def test_no_import_reaches_up_or_sideways():
    bad = []
    for module, path, is_package in _modules():
        layer, comp = _component(module)
        for line, target in _imports(module, path, is_package):
            t_layer, t_comp = _component(target)
            if t_comp == comp or t_layer < layer:
                continue
            if comp == "flexattn" and t_layer <= layer:   # the package's __init__ re-exports
                continue
            bad.append(f"{os.path.relpath(path, PACKAGE)}:{line} ({comp}) imports {target} ({t_comp})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_adapters_reach_kernels_only_through_the_core():
    bad = []
    for module, path, is_package in _modules():
        if module not in ADAPTERS:
            continue
        for line, target in _imports(module, path, is_package):
            if target.startswith("flexattn.kernels"):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "adapters must call the core, not the kernels:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path):
    """The checker itself can fail: a planted upward import is reported."""
    path = tmp_path / "x.py"
    path.write_text("from ..core import kernel_path\n\ndef f():\n    from flexattn.torch import flex_attention\n")
    found = list(_imports("flexattn.mods.x", str(path), False))
    assert found == [(1, "flexattn.core.kernel_path"), (4, "flexattn.torch.flex_attention")]
    assert all(_component(t)[0] > _component("flexattn.mods.x")[0] for _, t in found)
