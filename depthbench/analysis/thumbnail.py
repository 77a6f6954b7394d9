"""A small copy of a figure for a document: the README's headline picture.

The figures are drawn at the config's `figures.dpi` for reading on a screen; a picture committed
to the repository should stay small. `thumbnail` resamples the PNG to `width` pixels (Lanczos,
the aspect kept) and stores it with a palette of at most `colors` colours, without dithering:
a figure's flat colours and anti-aliased text fit a 256-colour palette with no visible change,
at a fraction of the size of RGB. The README's copy is made by

    .venv/bin/python -m depthbench.analysis.thumbnail results/figures/headline.png docs/headline.png

after README command 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from depthbench.util.io import atomic_write


def thumbnail(src: str | Path, dst: str | Path, width: int = 800, colors: int = 256) -> None:
    """Write `src` (a PNG) to `dst` at `width` pixels wide with a palette of `colors` colours."""
    with Image.open(src) as im:
        rgb = im.convert("RGB")
    if width < rgb.width:
        rgb = rgb.resize((width, round(rgb.height * width / rgb.width)), Image.Resampling.LANCZOS)
    small = rgb.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    atomic_write(dst, lambda tmp: small.save(tmp, format="png", optimize=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a figure's PNG, e.g. results/figures/headline.png")
    parser.add_argument("dst", type=Path, help="where the small copy goes, e.g. docs/headline.png")
    parser.add_argument("--width", type=int, default=800, help="pixels (default 800)")
    args = parser.parse_args(argv)
    if not args.src.is_file():
        parser.error(f"{args.src}: no such figure; README command 1 draws results/figures/")
    thumbnail(args.src, args.dst, args.width)


if __name__ == "__main__":
    main()
