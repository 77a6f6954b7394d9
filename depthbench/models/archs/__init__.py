"""One module per architecture; importing this package registers all of them."""

from depthbench.models.archs import deepnorm, keel, lns, peri_ln, post_ln, pre_ln  # noqa: F401
