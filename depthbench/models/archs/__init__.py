"""One module per architecture; importing this package registers all of them."""

from depthbench.models.archs import (  # noqa: F401
    attnres_block,
    attnres_full,
    deepnorm,
    hc,
    keel,
    lns,
    mhc,
    moda,
    peri_ln,
    post_ln,
    pre_ln,
)
