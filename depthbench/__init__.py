"""DepthBench: does added depth become computation, or near-identity layers?

The package holds all logic of the workflow; `Snakefile` and `scripts/` are thin wrappers.
"""

__version__ = "0.1.0"
