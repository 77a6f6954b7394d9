"""One module per architecture; importing this package registers all of them, in the order of
depthbench.models.registry.PACKAGE_ARCHITECTURES (the registration order, which fixes each
architecture's colour and marker in every figure: depthbench.analysis.style)."""

import importlib

from depthbench.models.registry import PACKAGE_ARCHITECTURES

for _module in PACKAGE_ARCHITECTURES:
    importlib.import_module(f"{__name__}.{_module}")
