"""Fuzz: ``slicedkern.nn.torch.SlicedAttention`` (float64), two invariances, on each torch engine.

Each example is a layer -- kernel "relu", "hat", "hat_mixture" or a kernel object of
``_cases.kernels`` (ReLU, Abs, Hat, HatMixture, a random PiecewiseLinear); heads 1-3 of width 2 or
4; ``score`` "mlp" or "linear"; ``center`` and ``normalize`` free; with or without biases;
``batch_first`` or not; ``rope`` or not; initial bandwidths, mixture sizes -- whose parameters are
then perturbed at random (non-zero biases, mixture weights, bandwidths), and inputs of 1 to 3
sequences, unbatched sometimes. Hypothesis draws the configuration and a seed; the numbers come
from that seed (normal deviates), so that no example is ill-conditioned by construction.

* ``test_padding_never_changes_real_outputs``: padded keys (``key_padding_mask`` True) count
  nowhere. Self-attention: appending 1 to 4 padded tokens (random features) to a sequence that may
  already hold padding leaves the outputs of its tokens unchanged, with or without ``is_causal``
  and RoPE (padding is no position): appended or prepended (left padding). Cross-attention (not
  causal; with RoPE the queries placed at ``query_positions = 0..Lq-1``): inserting padded keys
  ANYWHERE among the keys changes nothing either.
* ``test_rope_queries_are_the_last_key_positions``: with ``Lq <= Lk``, attending the last ``Lq``
  tokens of a sequence over the whole sequence equals the last ``Lq`` rows of its self-attention,
  ``is_causal`` or not, RoPE or not, with padding: queries take the last ``Lq`` key positions and
  the causal rule is bottom-right aligned (``j <= i + Lk - Lq``).

Tolerance: ``|a - b| <= 1e-8 (max |b| + ||W_o||_inf max |v|)`` over the compared outputs, ``v`` the
projected values (a sequence whose keys are all padding must give exactly 0). Both sides are float64
evaluations of the same sums in another order (another sort, other shifts), so they differ by the
rounding of terms of the size of the scores times the values, relative to the normaliser: about
``L u |s| |v| / D``, ~1e-14 of the values' scale for these inputs (scores and values of order 1; a
normaliser below 1e-6 of its scale has a probability of order 1e-6 per row), whatever the size of the
output itself (a hat far from every key gives 0 up to that rounding). A padded key that leaks moves
outputs by about ``1 / L`` of the values' scale, 1e6 times the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import require_selected
from hypothesis import note
from hypothesis import strategies as st

import slicedkern
from slicedkern.engines import available as engines_available
from slicedkern.kernels import PiecewiseLinear

from ._cases import kernels

torch = pytest.importorskip("torch")
from slicedkern.nn.torch import SlicedAttention  # noqa: E402

#: Relative tolerance of the comparisons (module docstring).
RTOL = 1e-8

ENGINES = tuple(engines_available("torch"))


@pytest.fixture(params=ENGINES)
def torch_engine(request):
    """A torch engine as the default of the test's calls (the layer's ops read it)."""
    require_selected(request.config, "torch")
    with slicedkern.use_engine(request.param):
        yield request.param


@st.composite
def layer_configs(draw, *, cross: bool = False):
    """``(constructor kwargs, seed)``; ``cross``: key and value widths of their own."""
    kernel = draw(st.sampled_from(("relu", "hat", "hat_mixture", "object")))
    heads, head_dim = draw(st.integers(1, 3)), draw(st.sampled_from((2, 4)))
    kwargs = {"embed_dim": heads * head_dim, "num_heads": heads, "score": draw(st.sampled_from(("mlp", "linear"))),
              "bias": draw(st.booleans()), "batch_first": draw(st.booleans()), "dtype": torch.float64,
              "center": draw(st.sampled_from((None, True, False))),
              "normalize": draw(st.sampled_from(("auto", "abs", "relu", "count", None)))}
    if kernel == "object":
        kwargs["kernel"] = draw(kernels(1.0))
        assert isinstance(kwargs["kernel"], PiecewiseLinear)
    else:
        kwargs["kernel"] = kernel
    if kernel == "hat" and draw(st.booleans()):
        kwargs["bandwidth"] = draw(st.floats(0.2, 3.0))
    if kernel == "hat_mixture":
        kwargs["mixture_size"] = draw(st.integers(1, 3))
        if draw(st.booleans()):
            kwargs["bandwidth"] = draw(st.floats(0.2, 3.0))
    if cross:
        kwargs["kdim"], kwargs["vdim"] = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    return kwargs, draw(st.integers(0, 2 ** 32 - 1))


def make_layer(kwargs: dict, seed: int) -> SlicedAttention:
    """The layer, its parameters then perturbed by normal deviates (non-zero biases, mixture weights,
    bandwidths), all from ``seed`` and without touching torch's global generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = SlicedAttention(**kwargs)
        with torch.no_grad():
            for parameter in layer.parameters():
                parameter.add_(0.3 * torch.randn(parameter.shape, dtype=parameter.dtype))
    return layer.eval()


def layer_of(example):
    """``(layer, rng, kwargs, shape)`` of a drawn ``(kwargs, seed, shape)`` example, noted for the
    reproducer."""
    kwargs, seed, shape = example
    note(f"SlicedAttention(**{kwargs!r}) with seed {seed}; {shape!r}")
    return make_layer(kwargs, seed), np.random.default_rng(seed), kwargs, shape


def _call(layer, query, key, value, mask, is_causal: bool, *, unbatched: bool, query_positions=None):
    """``layer`` on batch-first data (N, L, E); returns batch-first (N, Lq, E); ``query_positions``
    (N, Lq) or None."""
    first = layer.batch_first
    if unbatched:
        out, weights = layer(query[0], key[0], value[0], key_padding_mask=None if mask is None else mask[0],
                             is_causal=is_causal,
                             query_positions=None if query_positions is None else query_positions[0])
        assert weights is None
        return out[None]
    if not first:
        query, key, value = (a.transpose(0, 1) for a in (query, key, value))
    out, weights = layer(query, key, value, key_padding_mask=mask, is_causal=is_causal,
                         query_positions=query_positions)
    assert weights is None
    return out if first else out.transpose(0, 1)


def value_scale(layer, value) -> float:
    """``||W_o||_inf max |v_proj(value)|``: the size of an output made of the projected values."""
    with torch.no_grad():
        projected = layer.v_proj(value)
        weight = layer.out_proj.weight.abs().sum(dim=1).max()
    return float(weight) * float(projected.abs().max())


def assert_same(got, want, what: str, values: float):
    """``|got - want| <= RTOL (max |want| + values)`` (module docstring): an output that is small by
    cancellation (a hat far from every key) is judged on the scale of the values it sums."""
    got, want = got.detach().numpy(), want.detach().numpy()
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = float(np.max(np.abs(want), initial=0.0)) + values
    err = np.abs(got - want)
    assert np.all(err <= RTOL * scale), (
        f"{what}: max |difference| {float(np.max(err, initial=0.0)):.3e} > {RTOL:.0e} x (max |output| + "
        f"||W_o|| max |v|) = {RTOL:.0e} x {scale:.3e}")


# ------------------------------------------------------------------------------------------ padding
@st.composite
def padding_examples(draw):
    cross = draw(st.booleans())
    kwargs, seed = draw(layer_configs(cross=cross))
    kwargs["rope"] = draw(st.booleans())
    n = draw(st.integers(1, 3))
    shape = {"n": n, "lq": draw(st.integers(1, 7)), "lk": draw(st.integers(1, 7)), "pad": draw(st.integers(1, 4)),
             "unbatched": n == 1 and draw(st.booleans()), "cross": cross,
             "causal": (not cross) and draw(st.booleans()), "left": draw(st.booleans()),
             "padded_already": draw(st.sampled_from((0.0, 0.3))), "all_padded_row": draw(st.booleans())}
    return kwargs, seed, shape


def check_padding(example):
    layer, rng, _, shape = layer_of(example)
    n, pad = shape["n"], shape["pad"]
    e, kdim, vdim = layer.embed_dim, layer.kdim, layer.vdim
    lk = shape["lk"] if shape["cross"] else shape["lq"]
    mask = rng.random((n, lk)) < shape["padded_already"]
    if shape["all_padded_row"]:
        mask[-1] = True                              # a sequence whose every key is padding: zeros
    mask_t = torch.as_tensor(mask)
    unbatched = shape["unbatched"]
    with torch.no_grad():
        if not shape["cross"]:
            x = torch.as_tensor(rng.normal(size=(n, lk, e)))
            before = _call(layer, x, x, x, mask_t, shape["causal"], unbatched=unbatched)
            extra = torch.as_tensor(rng.normal(size=(n, pad, e)))
            padding = torch.ones((n, pad), dtype=torch.bool)
            left = shape["left"]            # padding is no RoPE position, before the tokens or after them
            x_pad = torch.cat([extra, x] if left else [x, extra], dim=1)
            mask_pad = torch.cat([padding, mask_t] if left else [mask_t, padding], dim=1)
            after = _call(layer, x_pad, x_pad, x_pad, mask_pad, shape["causal"], unbatched=unbatched)
            after = after[:, pad:] if left else after[:, :lk]
            what = f"self-attention with {pad} padded tokens {'prepended' if left else 'appended'}"
            values = value_scale(layer, x)
        else:
            query = torch.as_tensor(rng.normal(size=(n, shape["lq"], e)))
            key = torch.as_tensor(rng.normal(size=(n, lk, kdim)))
            value = torch.as_tensor(rng.normal(size=(n, lk, vdim)))
            # the queries at their own positions: the memory's padding then moves none
            own = torch.arange(shape["lq"]).expand(n, shape["lq"]) if layer.config.rope else None
            before = _call(layer, query, key, value, mask_t, False, unbatched=unbatched, query_positions=own)
            # padded keys at random places among the real ones, in order
            real_slots = np.sort(rng.choice(lk + pad, size=lk, replace=False))
            new_key = torch.as_tensor(rng.normal(size=(n, lk + pad, kdim)))
            new_value = torch.as_tensor(rng.normal(size=(n, lk + pad, vdim)))
            new_mask = torch.ones((n, lk + pad), dtype=torch.bool)
            new_key[:, real_slots], new_value[:, real_slots], new_mask[:, real_slots] = key, value, mask_t
            after = _call(layer, query, new_key, new_value, new_mask, False, unbatched=unbatched, query_positions=own)
            padded_at = sorted(set(range(lk + pad)) - set(real_slots.tolist()))
            what = f"cross-attention with {pad} padded keys inserted at {padded_at}"
            values = value_scale(layer, value)
    if shape["all_padded_row"]:
        assert not torch.any(before[-1]), "a sequence whose keys are all padding must give zeros"
    assert_same(after, before, what, values)


def test_padding_never_changes_real_outputs(torch_engine, fuzz):
    fuzz.run(padding_examples(), check_padding, backend="torch", weight=1.0)


# --------------------------------------------------------------------------------------------- RoPE
@st.composite
def suffix_examples(draw):
    kwargs, seed = draw(layer_configs())
    kwargs["rope"] = draw(st.booleans())
    n, lk = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    shape = {"n": n, "lk": lk, "lq": draw(st.integers(1, lk)), "causal": draw(st.booleans()),
             "padded": draw(st.sampled_from((0.0, 0.3))), "unbatched": n == 1 and draw(st.booleans())}
    return kwargs, seed, shape


def check_suffix(example):
    layer, rng, kwargs, shape = layer_of(example)
    n, lk, lq = shape["n"], shape["lk"], shape["lq"]
    x = torch.as_tensor(rng.normal(size=(n, lk, layer.embed_dim)))
    mask = torch.as_tensor(rng.random((n, lk)) < shape["padded"])
    with torch.no_grad():
        full = _call(layer, x, x, x, mask, shape["causal"], unbatched=shape["unbatched"])
        last = _call(layer, x[:, lk - lq:], x, x, mask, shape["causal"], unbatched=shape["unbatched"])
    assert_same(last, full[:, lk - lq:], f"the last {lq} of {lk} tokens as queries (causal={shape['causal']}, "
                                         f"rope={kwargs['rope']})", value_scale(layer, x))


def test_rope_queries_are_the_last_key_positions(torch_engine, fuzz):
    fuzz.run(suffix_examples(), check_suffix, backend="torch", weight=1.0)


# ------------------------------------------------------------------------------------- bad flags
FLAGS = ("learn_bandwidth", "bias", "batch_first", "rope", "center")
NOT_BOOLEANS = st.one_of(st.text(max_size=3), st.integers(-2, 2), st.floats(allow_nan=False), st.just([]))


@st.composite
def bad_flag_examples(draw):
    kwargs, seed = draw(layer_configs())
    return kwargs, seed, {"flag": draw(st.sampled_from(FLAGS)), "value": draw(NOT_BOOLEANS)}


def check_bad_flag(example):
    kwargs, _, shape = example
    note(f"SlicedAttention(**{kwargs!r}) with {shape['flag']}={shape['value']!r}")
    with pytest.raises(TypeError, match=f"'{shape['flag']}' must be True or False"):
        SlicedAttention(**{**kwargs, shape["flag"]: shape["value"]})


def test_flags_that_are_not_booleans_are_named(fuzz):
    """Any non-boolean flag ("no", 1, 0.0, []) is a TypeError naming it, never a truthy switch."""
    fuzz.run(bad_flag_examples(), check_bad_flag, backend="torch", weight=0.2)
