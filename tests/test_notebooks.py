"""Every notebook runs top to bottom on the CPU (reference path), is stored without
outputs, is small, and uses only the public API (so it runs unchanged on a GPU)."""

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_BYTES = 100_000
# modules a notebook may import: the public API
PUBLIC_MODULES = {"flexattn", "flexattn.torch", "flexattn.mods", "flexattn.mods.ops", "flexattn.mods.positions", "flexattn.plotting"}


def execute(nb, cwd):
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def outputs(nb, kind=None):
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if kind in (None, o.get("output_type"))]


def text_of(nb):
    return "".join(o.get("text", "") for o in outputs(nb, "stream"))


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"tour.ipynb", "mask_gallery.ipynb", "score_mods.ipynb", "benchmarks.ipynb"} <= names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = execute(nbformat.read(path, as_version=4), path.parent)
    errors = outputs(nb, "error")
    assert not errors, "\n".join(f"{e['ename']}: {e['evalue']}" for e in errors)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_clean_and_small(path):
    assert path.stat().st_size < MAX_BYTES, f"{path.name} is {path.stat().st_size} bytes; clear its outputs"
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {i} has stored outputs; clear them before saving"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count; clear outputs"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_only_the_public_api(path):
    nb = nbformat.read(path, as_version=4)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    imported = set(re.findall(r"^\s*(?:from|import)\s+(flexattn[\w.]*)", source, re.M))
    assert imported <= PUBLIC_MODULES, f"{path.name} imports {sorted(imported - PUBLIC_MODULES)}"
    private = re.findall(r"\b(?:flexattn|fa|mods|plotting)\._\w+", source)
    assert not private, f"{path.name} reaches into private names: {private}"


RESULTS_MD = """\
# Benchmarks

## H100, bf16, forward

| variant | impl | S | ms | TFLOP/s |
|---|---|---|---|---|
| causal | flexattn | 4096 | 0.51 | 540.2 |
| causal | fa4 | 4096 | 0.48 | 575.0 |
| causal | flexattn | 8192 | 1.90 | 580.0 |
| sliding_window(1024) | flexattn | 4096 | 0.20 | **410** |
| sliding_window(1024) | torch flex | 4096 | - | - |
"""


@pytest.mark.skipif(not (NOTEBOOK_DIR / "benchmarks.ipynb").exists(), reason="no benchmarks notebook")
@pytest.mark.parametrize("content", [None, "# Results\n\nnothing measured yet\n", RESULTS_MD], ids=["missing", "no-table", "table"])
def test_benchmarks_notebook_reads_results(tmp_path, content):
    """The notebook finds benchmarks/RESULTS.md above its folder; run it on a stand-in tree."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "benchmarks").mkdir()
    if content is not None:
        (tmp_path / "benchmarks" / "RESULTS.md").write_text(content)
    nb = execute(nbformat.read(NOTEBOOK_DIR / "benchmarks.ipynb", as_version=4), tmp_path / "notebooks")
    assert not outputs(nb, "error")
    text = text_of(nb)
    images = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    if content is None:
        assert "No benchmark results yet" in text and not images
    elif content != RESULTS_MD:
        assert "none with an implementation column and a TFLOP/s column" in text and not images
    else:
        assert "4 measurements from RESULTS.md" in text
        assert re.search(r"causal \(S=4096\)\s+540\.2\s+575\.0", text)
        assert re.search(r"sliding_window\(1024\) \(S=4096\)\s+410\.0", text) and "torch flex" not in text.split("measurements")[1]
        assert len(images) == 1
