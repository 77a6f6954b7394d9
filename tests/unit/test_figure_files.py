"""A figure's two files: the PDF has the PNG's layout (constrained layout runs once, for the
PNG, and is then frozen: laying it out again for the PDF took about a sixth of every figure
job), both written atomically."""

from __future__ import annotations

import pytest

from depthbench.analysis import registry
from depthbench.analysis import style as S
from tests.analysis_tables import synthetic_tables

CTX = registry.context(
    {"name": "syn", "budget": {"params": 8e5}, "shapes": [{"n_layer": 2}], "seeds": [0]}
)


@pytest.mark.parametrize("name", ["headline", "loss_curves"])
def test_the_pdf_has_the_layout_of_the_png(name, tmp_path, monkeypatch):
    tables = synthetic_tables(archs=("pre_ln", "hc"), depths=(2, 4, 8), lrs=(2e-3,))
    fig = registry.FIGURES[name].draw(tables, CTX)
    layouts = []
    savefig = type(fig).savefig

    def recording_savefig(self, *args, **kwargs):
        savefig(self, *args, **kwargs)
        layouts.append([ax.get_position().bounds for ax in self.axes])

    monkeypatch.setattr(type(fig), "savefig", recording_savefig)
    S.save(fig, tmp_path / "f.png", tmp_path / "f.pdf", CTX.dpi)
    png, pdf = layouts
    assert len(png) > 1 and pdf == png
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "f.pdf").read_bytes()[:5] == b"%PDF-"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.pdf", "f.png"]  # no temporaries left
