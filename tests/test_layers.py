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
        if not any(module == a or module.startswith(a + ".") for a in ADAPTERS):
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


# Inside the torch adapter, bottom to top: a module imports only modules of lower rows
# (lazy imports too), so its concepts stay layered as docs/ARCHITECTURE.md lists them.
TORCH_ADAPTER = [
    ["flexattn.torch.devices", "flexattn.torch.graph_walk", "flexattn.torch.tensor_eval",
     "flexattn.torch.dynamo_marks"],
    ["flexattn.torch.launches"],
    ["flexattn.torch.ops"],
    ["flexattn.torch.nested"],
    ["flexattn.torch.compiled"],
    ["flexattn.torch.attention"],
    ["flexattn.torch.decoding"],
    ["flexattn.torch"],
    ["flexattn.torch.context_parallel"],
]


def _adapter_row(module: str):
    """The row of ``module`` (or of the adapter module a name is imported from) in
    ``TORCH_ADAPTER``; None outside the torch adapter."""
    best = None
    for i, row in enumerate(TORCH_ADAPTER):
        for name in row:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return best


def test_the_torch_adapter_is_layered():
    placed = {name for row in TORCH_ADAPTER for name in row}
    bad = []
    for module, path, is_package in _modules():
        if not (module == "flexattn.torch" or module.startswith("flexattn.torch.")):
            continue
        if module not in placed:
            bad.append(f"{module}: in no row of TORCH_ADAPTER")
            continue
        row = _adapter_row(module)[0]
        for line, target in _imports(module, path, is_package):
            found = _adapter_row(target)
            if found is not None and found[1] != module and found[0] >= row:
                bad.append(f"{os.path.relpath(path, PACKAGE)}:{line} imports {target} (row {found[0]} >= {row})")
    assert not bad, "the torch adapter's modules against their order:\n" + "\n".join(bad)
