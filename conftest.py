"""Repository-level pytest configuration: skip the doctests of layers whose framework is missing.

``pytest`` collects ``slicedkern/`` for its doctests (``--doctest-modules``); the layer modules
import their framework at the top (``slicedkern.nn.torch`` needs torch, ``slicedkern.nn.flax``
needs Flax), so they are left out where it is not installed.
"""

import importlib.util

collect_ignore = [path for path, module in (("slicedkern/nn/torch.py", "torch"), ("slicedkern/nn/flax.py", "flax"))
                  if importlib.util.find_spec(module) is None]
