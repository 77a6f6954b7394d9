"""The README's small figure: a resampled, palette copy of a figure that keeps its colours."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from depthbench.analysis.thumbnail import main, thumbnail  # noqa: E402

COLOURS = [(31, 119, 180), (214, 39, 40), (227, 119, 194), (127, 127, 127), (188, 189, 34)]


def _figure(path):
    fig, ax = plt.subplots(figsize=(7.6, 9.2))
    for i, c in enumerate(COLOURS):  # wide flat bands, one per colour, and text over them
        ax.axhspan(i, i + 1, color=np.array(c) / 255)
        ax.text(0.5, i + 0.5, f"band {i}: the quick brown fox", ha="center")
    ax.set_ylim(0, len(COLOURS))
    ax.set_xlim(0, 1)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def test_thumbnail_is_smaller_keeps_the_aspect_and_the_colours(tmp_path):
    src, dst = tmp_path / "figure.png", tmp_path / "small.png"
    _figure(src)
    thumbnail(src, dst, width=400)
    with Image.open(src) as a, Image.open(dst) as b:
        big, small = np.asarray(a.convert("RGB")), b
        assert small.mode == "P" and small.width == 400
        assert abs(small.height - a.height * 400 / a.width) <= 1
        rgb = np.asarray(small.convert("RGB"))
    assert dst.stat().st_size < src.stat().st_size
    # the middle of each band's left margin (no text there): the source's colour in both; the
    # axes span 0.12 to 0.89 of the height from the top (matplotlib's default subplot margins)
    for i, c in enumerate(COLOURS):
        y = 0.12 + 0.77 * (len(COLOURS) - i - 0.5) / len(COLOURS)
        for img, tol in ((big, 0), (rgb, 2)):
            pixel = img[int(img.shape[0] * y), int(img.shape[1] * 0.2)].astype(int)
            assert np.abs(pixel - c).max() <= tol, (i, pixel, c)


def test_a_missing_figure_is_refused_naming_it_and_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "headline.png"), str(tmp_path / "out.png")])
    assert "headline.png: no such figure" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()
