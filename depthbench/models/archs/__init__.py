"""One module per architecture; importing this package registers all of them.

The import order is the registration order (depthbench.models.registry.registration_order), which
fixes each architecture's colour and marker in every figure (depthbench.analysis.style): a new
architecture goes last, so that the others keep theirs.
"""

from depthbench.models.archs import (  # noqa: F401
    pre_ln,
    post_ln,
    peri_ln,
    lns,
    deepnorm,
    keel,
    hc,
    mhc,
    attnres_full,
    attnres_block,
    moda,
)
