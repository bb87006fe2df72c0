"""Values scaled by a power of two where their products with the scores could leave float32's range.

The kernels sum float32 (or narrower) values in float32 over a tile span, and causal attention keeps
its running sums on the positions in float32 (:func:`._causal.running_dtype`): a sum of ``f(q_i -
k_j) v_j`` overflows there once ``|score| |value|`` nears 3.4e38, though the output, divided by a
normaliser or a count, is finite, and its terms vanish below 1e-38. Attention
is linear in the values, the centring and the divisor included (every normaliser sums the scores
alone, ``eps`` too), so the values of a batch row are scaled by ``2 ** -t`` before the kernels and
the output by ``2 ** t``, both exact. A row whose bound (:func:`value_scale`) lies between ``2 **
-LOW`` and ``2 ** LIMIT`` has ``t = 0`` and is computed as before, bit for bit; a scaled row is
rounded as the unscaled one would be in a float32 of wider exponent range, but for values pushed
below float32's smallest normal number (``2 ** -126``, far below the row's largest).

The scores are not scaled: a hat's bandwidth and a normaliser's ``eps`` would have to scale with
them. The sums of the scores alone (the ReLU count, a normaliser's sum in causal attention's
float32 running sums) then bound the range: ``|score| Lk`` below about 1e38.

The bound is taken on the device, as arrays: no number of it is read on the host.
"""

from __future__ import annotations

from ...kernels import is_fixed

__all__ = ["value_scale", "scaled_up", "scaled_grads"]

#: a row is scaled down when its bound reaches ``2 ** LIMIT``, four times below float32's largest
#: number, and up when it is below ``2 ** -LOW``
LIMIT = 126
LOW = 60


def _finite_abs_max(xp, a):
    """The largest finite ``|a|`` over the last axis, float64 (0 where none): for the scores, whose
    non-finite entries the NaN policy screens one by one."""
    bottom, top = a.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).aminmax(dim=-1)      # one array of a's size
    return xp.astype(xp.maximum(top, -bottom), xp.float64)


def _abs_max(xp, v):
    """The largest ``|v|`` over the last two axes of ``v``, float64, from the largest and the
    smallest entry of each row, taken in one read of ``v`` and no array of its size (the values are
    the ``n D`` numbers). Not finite where an entry is not."""
    bottom, top = v.aminmax(dim=-1)
    top = xp.astype(xp.max(top, axis=-1), xp.float64)
    return xp.maximum(top, -xp.astype(xp.min(bottom, axis=-1), xp.float64))


def _size(xp, p):
    """``|p|`` of a profile parameter: a float for a number, else a float64 array of its batch shape,
    0 where not finite (a fixed profile costs no array here: on a GPU at small L the host's operators
    are the time)."""
    if is_fixed(p):
        p = abs(float(p))
        return p if p < float("inf") else 0.0
    p = xp.abs(xp.astype(p, xp.float64))
    return xp.where(xp.isfinite(p), p, xp.zeros((), dtype=xp.float64, device=p.device))


def _larger(xp, a, b):
    return max(a, b) if isinstance(a, float) and isinstance(b, float) else xp.maximum(
        *(xp.asarray(x, dtype=xp.float64) if isinstance(x, float) else x for x in (a, b)))


def _term_bound(xp, profile, scores):
    """A bound on ``|f(r)|`` and on the profile's pair terms ``|r - t|`` for every difference ``r`` of
    the scores (of size at most ``scores``): ``(1 + |slope| + sum |c|) (2 scores + max |t|) +
    |intercept|`` (the knots' coefficients are applied in float64; the terms they multiply, and
    the profile's value in causal attention's leaves, are rounded to float32)."""
    reach, gain = 0.0, 1.0 + _size(xp, profile.slope)
    for t, c in zip(profile.knots, profile.coeffs):
        reach = _larger(xp, reach, _size(xp, t))
        gain = gain + _size(xp, c)
    return gain * (2.0 * scores + reach) + _size(xp, profile.intercept)


def _power_of_two(xp, e, dtype):
    """``2 ** e`` exactly, for int32 ``e`` within the normal exponents of ``dtype`` (float32 or
    float64): the number's bits, not ``pow`` (not exact on every backend)."""
    if dtype == xp.float64:
        return ((xp.astype(e, xp.int64) + 1023) << 52).view(xp.float64)
    return ((e + 127) << 23).view(xp.float32)


def value_scale(xp, q, k, v, profile):
    """``(v scaled, up)``: the values ``v`` (..., Lk, Dv), narrower than float64, times ``2 ** -t``
    per batch row, and ``up = 2 ** t`` (..., ) float64 that the output is multiplied by (``t = 0``
    where the row is in range; see the module's docstring), or ``(v, None)`` for float64 values
    and empty calls. ``q`` (..., Lq) and ``k`` (..., Lk) the scores, ``profile`` the value kernel.
    One array of ``v``'s size is made: the scaled values (several reductions, of the batch's size)."""
    lk = k.shape[-1]
    if v.dtype == xp.float64 or lk == 0 or q.shape[-1] == 0 or v.shape[-1] == 0:
        return v, None
    dev = v.device
    scores = xp.maximum(_finite_abs_max(xp, q), _finite_abs_max(xp, k))
    # a value that is not finite gives no bound, and its row is not scaled: the NaN policy makes
    # the row NaN if its key takes part (a masked key's value is not read, but it still stops the
    # scaling: its row is then computed as without it)
    values = _abs_max(xp, v)
    bound = _term_bound(xp, profile, scores) * values * float(lk)
    bound = xp.where(xp.isfinite(bound), bound, xp.zeros((), dtype=xp.float64, device=dev))
    _, e = bound.frexp()                                    # bound < 2 ** e (e = 0 for a bound of 0)
    _, ev = xp.where(xp.isfinite(values), values, xp.zeros((), dtype=xp.float64, device=dev)).frexp()
    # down where the bound reaches 2 ** LIMIT; up to a bound of about 1 where it is below 2 ** -LOW
    # (products below float32's normal range: 1e-30 by 1e-20 gave 0), the values staying below 2 ** 120
    t = xp.where(e > LIMIT, xp.clip(e - LIMIT, max=LIMIT), xp.where(e < -LOW, xp.maximum(e, ev - 120), 0))
    t = xp.clip(t, min=-LIMIT, max=LIMIT)
    down = _power_of_two(xp, -t, xp.float32)[..., None, None]
    # float16's exponents stop at 2 ** -24: its values are scaled through float32
    scaled = xp.astype(xp.astype(v, xp.float32) * down, v.dtype) if v.dtype == xp.float16 else \
        v * xp.astype(down, v.dtype)
    return scaled, _power_of_two(xp, t, xp.float64)


def scaled_up(xp, out, up, *, in_place: bool = False):
    """``out`` (..., Lq, Dv) times ``up`` (..., ) (:func:`value_scale`), in ``out``'s dtype (float16
    through float32, where ``up`` may not be a number); ``in_place``: into ``out`` (an output the
    engine has just written), which is returned."""
    if up is None:
        return out
    factor = xp.astype(up, xp.float32)[..., None, None]
    if out.dtype == xp.float16:
        scaled = xp.astype(xp.astype(out, xp.float32) * factor, out.dtype)
        return out.copy_(scaled) if in_place else scaled
    factor = xp.astype(factor, out.dtype)
    return out.mul_(factor) if in_place else out * factor


def scaled_grads(xp, grads, up):
    """Attention's ``(dq, dk, dv, (dknots, dcoeffs))`` over values scaled by ``1 / up``
    (:func:`value_scale`) made those of the values: every gradient but ``dv`` times ``up``."""
    if up is None:
        return grads
    dq, dk, dv, (dknots, dcoeffs) = grads

    def times(a, core):
        return None if a is None else a * xp.astype(xp.reshape(up, tuple(up.shape) + (1,) * core), a.dtype)

    return (times(dq, 1), times(dk, 1), dv, (tuple(times(d, 0) for d in dknots), tuple(times(d, 0) for d in dcoeffs)))
