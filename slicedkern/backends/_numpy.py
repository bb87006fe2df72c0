"""The NumPy row of the backend registry (CPU)."""

from __future__ import annotations

import array_api_compat as compat
import numpy as np

from ._generic import ArrayBackend
from ._merge1d import energy_distance_rows
from ._pairs import available, energy_pair_sums


class NumpyBackend(ArrayBackend):
    library = "numpy"

    def owns_namespace(self, xp) -> bool:
        return compat.is_numpy_namespace(xp)

    def owns_array(self, a) -> bool:
        return compat.is_numpy_array(a)

    def host_readable(self, a) -> bool:
        return True

    def to_host(self, a) -> np.ndarray:
        return np.asarray(a)

    def searchsorted_right(self, xp, sorted_keys, values):
        """``np.searchsorted`` is 1-D only: one C call per batch row."""
        lead = values.shape[:-1]
        keys2 = np.reshape(sorted_keys, (-1, sorted_keys.shape[-1]))
        vals2 = np.reshape(values, (-1, values.shape[-1]))
        out = np.empty(vals2.shape, dtype=np.intp)
        for row in range(vals2.shape[0]):
            out[row] = np.searchsorted(keys2[row], vals2[row], side="right")
        return np.reshape(out, lead + (values.shape[-1],))

    def quiet(self):
        return np.errstate(invalid="ignore", over="ignore", divide="ignore")

    def accurate_sum(self, xp, v):
        return np.sum(v, axis=-1)                           # pairwise summation

    def energy_distance_rows(self, xp, x, y, a, b, batch):
        if any(v is not None and v.dtype != np.float64 for v in (x, y, a, b)):
            return None
        return energy_distance_rows(x, y, a, b, tuple(batch))

    def compiled_energy_pairs(self, arrays) -> bool:
        return available()

    def energy_distance_pairs(self, xp, x, y, a, b, batch):
        if any(v.dtype != np.float64 for v in (x, y, a, b)):
            return None
        with self.compiled_threads():
            return energy_pair_sums(x, y, a, b, tuple(batch))
