"""tilepilot: a reproducible benchmark suite and release gate for TileLang kernels.

The data flows matrix -> cases -> build -> correctness -> measure -> record -> history (asv)
-> publish -> gate; each step is one module of this package.
"""

__version__ = "0.1.0"
