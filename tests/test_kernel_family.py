"""A learnable kernel family added from outside the package: the seam of
:class:`slicedkern.kernels.KernelFamily` (docs/architecture.rst, "Kernel families").

The family here, ``f(r) = c ReLU(r - t)`` with a shift ``t`` and a height ``c`` that may be learned
per batch row, is written and registered in this file alone, and so is its op: a builder of the
spec's family fields and array parameters over the public layer's checks. No module of the package
changes for it. The engines see only its profile and the adapters only its gradients, so the
forward and every gradient (scores, values, shift, height) are held to the dense float64 reference
(``torch.autograd`` through it) on every engine that serves CPU torch, causal or not, with a mask,
ties and batch-shaped parameters; and ``slicedkern.vjp`` on NumPy gives the same gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import slicedkern
from slicedkern import reference
from slicedkern._validate import check_param_batch, finite_param
from slicedkern.kernels import Profile, family_named, register_family
from slicedkern.ops.attention import _attention


class ShiftedReLU:
    """``c ReLU(r - t)``: ``fixed = (t, c)`` for the numbers given as such; array parameters
    ``"shift"`` and ``"height"`` of the batch shape."""

    name = "test-shifted-relu"

    def profile(self, fixed, params):
        # _case puts the shifts on odd eighths and the scores on quarters: no difference falls on the
        # knot, where the sort-scan's one-sided derivative and autograd's through clamp may differ
        return Profile([params.get("shift", fixed[0])], [params.get("height", fixed[1])])

    def pullback(self, xp, fixed, params, dknots, dcoeffs):
        grads = {"shift": dknots[0], "height": dcoeffs[0]}
        return {name: grads[name] for name in params}

    def rows_ok(self, xp, fixed, params):
        return None


FAMILY = register_family(ShiftedReLU())


def shifted_relu_attention(q, k, v, shift, height, *, key_mask=None, causal=False, engine=None):
    """The family's op: count-normalised, centred attention with ``c ReLU(q_i - k_j - t)``."""
    def build(xp, device, work, batch):
        fixed, params = [], {}
        for name, value in (("shift", shift), ("height", height)):
            checked = finite_param(xp, value, name, device, work, "a number or an array")
            check_param_batch(checked, name, batch)
            if isinstance(checked, float):
                fixed.append(checked)
            else:
                fixed.append(0.0)
                params[name] = checked
        return {"family": FAMILY.name, "fixed": tuple(fixed)}, params

    build.sources = {"shift": shift, "height": height}
    return _attention(q, k, v, build, key_mask=key_mask, center=True, normalize="count", eps=1e-6, causal=causal,
                      engine=engine, xp=None)


def _dense(q, k, v, shift, height, mask, causal):
    """The dense float64 oracle of :func:`shifted_relu_attention`, on torch tensors (autograd through it)."""
    def weights(r):
        t = shift if isinstance(shift, float) else shift[..., None, None]
        c = height if isinstance(height, float) else height[..., None, None]
        return c * (r - t).clamp(min=0.0)
    return reference._attention(q, k, v, weights, mask, True, "count", 1e-6, causal)


def _case(rng, batch=(2, 3), lq=9, lk=11, d=4):
    # scores on a grid of quarters (ties between keys and queries), the shifts on eighths off it
    q = rng.integers(-8, 9, size=batch + (lq,)) / 4.0
    k = rng.integers(-8, 9, size=batch + (lk,)) / 4.0
    v = rng.normal(size=batch + (lk, d))
    mask = rng.random(batch + (lk,)) > 0.25
    mask[..., -1] = True
    shift = (rng.integers(-4, 4, size=batch[-1:]) + 0.5) / 4.0
    height = rng.normal(size=batch[-1:]) + 1.5
    g = rng.normal(size=batch + (lq, d))
    return q, k, v, mask, shift, height, g


def test_the_family_is_registered_by_name():
    assert family_named("test-shifted-relu") is FAMILY
    assert family_named("hat").name == "hat"
    with pytest.raises(ValueError, match="already registered"):
        register_family(ShiftedReLU())
    with pytest.raises(ValueError, match="no kernel family named 'nope'"):
        family_named("nope")


def _torch_engines():
    """The engines that serve CPU torch here, but triton (its interpreter: tests/engines/test_triton.py)."""
    from slicedkern import engines
    return [name for name in engines.available("torch") if name != "triton"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_family_trains_on_every_torch_engine(rng, causal):
    """Forward and the gradients of q, k, v, the shift and the height against autograd through the
    dense reference, in float64, on each engine that serves CPU torch."""
    torch = pytest.importorskip("torch")
    q, k, v, mask, shift, height, g = _case(rng)
    mask_t, g_t = torch.as_tensor(mask), torch.as_tensor(g)

    def leaves():
        return [torch.tensor(a, requires_grad=True) for a in (q, k, v, shift, height)]

    dense = leaves()
    want = _dense(*dense, mask_t, causal)
    want_grads = torch.autograd.grad((want * g_t).sum(), dense)
    engines_run = _torch_engines()
    assert "scan" in engines_run
    for engine in engines_run:
        fast = leaves()
        got = shifted_relu_attention(*fast, key_mask=mask_t, causal=causal, engine=engine)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{engine}: forward")
        grads = torch.autograd.grad((got * g_t).sum(), fast)
        for name, a, b in zip(("q", "k", "v", "shift", "height"), grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"{engine}: d{name}")


def test_the_family_with_fixed_numbers_and_on_numpy(rng):
    """A number for the shift goes into the spec (a fixed knot, no gradient), an array height keeps
    its gradient; ``slicedkern.vjp`` on NumPy gives the gradients autograd gives on torch."""
    torch = pytest.importorskip("torch")
    q, k, v, mask, _, height, g = _case(rng)
    shift = 0.125
    out, pullback = slicedkern.vjp(lambda q_, k_, v_, h_: shifted_relu_attention(q_, k_, v_, shift, h_,
                                                                                 key_mask=mask), q, k, v, height)
    dense = [torch.tensor(a, requires_grad=True) for a in (q, k, v, height)]
    want = _dense(dense[0], dense[1], dense[2], shift, dense[3], torch.as_tensor(mask), False)
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-10)
    want_grads = torch.autograd.grad((want * torch.as_tensor(g)).sum(), dense)
    for name, a, b in zip(("q", "k", "v", "height"), pullback(g), want_grads):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-9, atol=1e-9, err_msg=f"d{name}")


def test_the_family_names_its_arguments_in_errors(rng):
    q, k, v, mask, shift, height, _ = _case(rng)
    with pytest.raises(ValueError, match="'height'"):
        shifted_relu_attention(q, k, v, shift, np.array([1.0, np.inf, 2.0]))
    with pytest.raises(ValueError, match="'shift'"):
        shifted_relu_attention(q, k, v, np.zeros(5), height)
