"""Causal attention in the fuzz suite's terms: the causal oracle and its error bound, per query.

Causal query ``i`` sees the valid keys ``j <= i + Lk - Lq`` (bottom-right aligned). That is the
NON-causal op applied to query ``i`` alone with the key mask ``valid & (j <= i + Lk - Lq)``: the
*per-query case* (:func:`per_query_case`) puts every query in a batch row of its own -- ``q (..., Lq,
1)``, ``k (..., 1, Lk)``, ``v (..., 1, Lk, Dv)``, per-head parameters given a unit axis, the mask
``(..., Lq, Lk)`` -- so that every quantity of ``_oracle``'s a-priori bound (the count, the
normaliser, the centring mean, ``max |k_j|``, the rule "no key seen: exactly 0") is that of the keys
the query sees. Its output ``(..., Lq, 1, Dv)`` is the causal output with a unit axis.

:func:`causal_oracle` returns the expected causal output, its allowed error and which elements
can be judged (``_oracle.forward_bound`` of the per-query case); :func:`causal_loss_noise` the
rounding bound of ``sum(g * out)`` used by gradient checks. The documented oracle,
``slicedkern.reference.*(..., causal=True)``, is what finite differences differentiate; the tests
check that it agrees with the per-query evaluation (:func:`assert_reference_agrees`).
"""

from __future__ import annotations

import numpy as np

from ._cases import POSITIONAL, Arr, Case
from ._oracle import assert_within, evaluate, expected_output, forward_bound, loss_noise

__all__ = ["visible", "with_causal", "per_query_case", "causal_oracle", "causal_loss_noise",
           "assert_reference_agrees", "has_causal_mode"]


def has_causal_mode(backend, engine) -> bool:
    """Whether ``engine`` computes causal attention on ``backend``'s arrays; the one engine that does
    not (the sweep on JAX arrays) says so with a ``ValueError`` naming ``engine`` (tests/test_causal.py)."""
    import slicedkern

    try:
        engine.call(slicedkern.relu_attention, backend.asarray(np.zeros((1, 1))), backend.asarray(np.zeros((1, 1))),
                    backend.asarray(np.zeros((1, 1, 1))), causal=True)
    except ValueError as exc:
        if not str(exc).startswith("argument 'engine'") or "causal" not in str(exc):
            raise
        return False
    return True


def visible(lq: int, lk: int) -> np.ndarray:
    """(Lq, Lk) True where causal query ``i`` may see key ``j``: ``j <= i + Lk - Lq``."""
    return np.arange(lk)[None, :] <= np.arange(lq)[:, None] + (lk - lq)


def with_causal(case: Case) -> Case:
    """The same call with ``causal=True`` (the reproducer prints it; the oracle takes it too)."""
    return Case(case.op, case.args, {**case.kwargs, "causal": True})


#: the options a per-query case replaces by its key mask
VISIBILITY_OPTIONS = ("causal", "segment_ids", "window")


def per_query_case(case: Case, seen: np.ndarray | None = None) -> Case:
    """The non-causal call whose output ``(..., Lq, 1, Dv)`` is ``case``'s causal output (module
    docstring); with ``seen`` (Lq, Lk) bool, the output of ``case`` under that visibility instead
    (segments and windows: ``test_fuzz_segments``)."""
    assert case.is_attention, "causal attention only"
    q, k, v = case.args[:3]
    kwargs = {name: value for name, value in case.kwargs.items() if name not in VISIBILITY_OPTIONS}
    seen = visible(q.shape[-1], k.shape[-1]) if seen is None else seen
    if "key_mask" in kwargs:
        seen = kwargs["key_mask"].values[..., None, :] & seen
    kwargs["key_mask"] = Arr(np.ascontiguousarray(seen), "bool")
    args = [Arr(q.values[..., None], q.dtype), Arr(k.values[..., None, :], k.dtype),
            Arr(v.values[..., None, :, :], v.dtype)]
    for name, param in zip(POSITIONAL[case.op][3:], case.args[3:]):
        if isinstance(param, Arr):
            # a per-head bandwidth (...) or mixture parameter (..., K): the query axis is a batch axis
            values = param.values[..., None] if name == "bandwidth" else param.values[..., None, :]
            param = Arr(values, param.dtype)
        args.append(param)
    return Case(case.op, tuple(args), kwargs)


def causal_oracle(case: Case, seen: np.ndarray | None = None, outer: np.ndarray | None = None):
    """``(expected, bound, judged)`` of the causal call ``case`` (shape ``(..., Lq, Dv)``): every
    query judged by the per-query bound of the keys it sees (no engine's rounding may depend on keys
    a query does not see: ``test_fuzz_causal.test_causal_row_does_not_depend_on_unseen_keys``);
    ``seen``: as :func:`per_query_case`'s; ``outer`` (Lq, Lk) bool, the keys of the sums whose
    difference a window's band is (``_oracle.forward_bound``'s ``outer``)."""
    per_query = per_query_case(case, seen)
    expected = expected_output(per_query)
    bound, judged = forward_bound(per_query, expected,
                                  outer=None if outer is None else per_query_case(case, outer))
    return expected[..., 0, :], bound[..., 0, :], judged[..., 0, :]


def causal_loss_noise(case: Case, cotangent: np.ndarray, position: int | None = None) -> float:
    """A bound of the float64 rounding error of one evaluation of ``sum(g * causal oracle)``; with
    ``position``, of the same loss with that (linear) argument set to ones (the rounding of its own
    gradient, a kernel sum of the cotangent; see ``test_fuzz_gradients._gradient_noise``)."""
    per_query = per_query_case(case)
    if position is not None:
        per_query = per_query.replaced(position, np.ones(per_query.args[position].shape))
    return loss_noise(per_query, cotangent[..., None, :], expected_output(per_query))


def assert_reference_agrees(case: Case, expected: np.ndarray, bound: np.ndarray, judged: np.ndarray):
    """``slicedkern.reference``'s causal op (``evaluate`` with ``causal=True``) equals the per-query
    evaluation within twice the bound (both are float64 evaluations of the same sums), on the
    queries that see a key (one that sees none is 0 by the documented rule, which the reference
    leaves to its normaliser: ``0 / max(0, eps)``, NaN for ``eps = 0``)."""
    reference = evaluate(case, *case.numpy())
    q, k = case.args[:2]
    seen = np.broadcast_to(visible(q.shape[-1], k.shape[-1]), expected.shape[:-2] + (q.shape[-1], k.shape[-1]))
    if "key_mask" in case.kwargs:
        seen = seen & case.kwargs["key_mask"].values[..., None, :]
    sees_a_key = np.broadcast_to(np.any(seen, axis=-1)[..., None], expected.shape)
    assert_within(reference, expected, 2.0 * bound, "float64", judged=judged & sees_a_key,
                  what=f"reference.{case.op}(causal=True) against the per-query evaluation")

