"""asv benchmarks of slicedkern (see ``asv_bench/asv.conf.json``).

Every class is parametrised by backend ("numpy", "torch", "jax"), engine ("scan", "sweep") and
size; the parameters never depend on what is installed: a combination that cannot run here (library
missing, engine not available for the arrays, op not in this version) is skipped by raising
``NotImplementedError`` in ``setup``. Data is built and JIT compilation is warmed up in ``setup``;
the ``time_*`` methods only call the op (and wait for its result).
"""

import importlib.util as _util
import os as _os
import sys as _sys

# ``asv run --python=same`` benchmarks the environment as it is, and does not pass PYTHONPATH on.
# Where slicedkern is not installed there (a plain checkout), use the checkout this suite belongs
# to. In the virtualenvs asv builds, the commit under test is always installed: this does nothing.
if _util.find_spec("slicedkern") is None:
    _sys.path.insert(0, _os.path.abspath(_os.path.join(_os.path.dirname(__file__), "..", "..")))
