"""The notebooks execute (on a small slice) and are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from _util import require

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stripped(path):
    nbformat = require("nbformat")
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_a_small_slice(path, monkeypatch, tmp_path):
    nbformat = require("nbformat")
    nbclient = require("nbclient")
    monkeypatch.setenv("KVROUTE_NB_LIMIT", "120")
    monkeypatch.setenv("KVROUTE_NB_WEIGHTS", "0,0.7,1")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # non-interactive: the figures must still be saved
    monkeypatch.setenv("KVROUTE_NB_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "cache_weight 0.70" in text and "infinite-cache bound" in text
    assert "chosen cache_weight" in text and "TTFT p90" in text and "hit rate" in text
    assert list(tmp_path.glob("*.png")), "the notebook saves its figures"
