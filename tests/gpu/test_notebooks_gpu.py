"""GPU: every notebook runs top to bottom on a CUDA machine, unchanged (they pick the
kernels when torch sees a GPU). Executed through a Jupyter kernel when nbclient is
installed; otherwise their code cells run in order in a fresh Python process (the
notebooks use no magics, which test_notebooks.py keeps true on the CPU)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _code_cells(path):
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_the_gpu(path):
    try:
        import nbclient
        import nbformat
    except ImportError:
        nbclient = None
    if nbclient is not None:
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
        return
    # One process, cells in order, sharing one namespace (as a kernel would).
    script = "\n\n".join(_code_cells(path)) + "\nimport torch\nassert torch.cuda.is_available()\n"
    env = dict(os.environ, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-c", script], cwd=path.parent, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{path.name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
