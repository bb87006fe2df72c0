"""slicedkern.nn.flax: equal to the torch layer after a weight copy (float64), jit / grad, state.

The torch layer is itself checked against the dense reference in ``test_nn_torch.py``; here the
Flax module must reproduce it, outputs and input gradients, for every kernel, masks, both
layouts, RoPE and (when the ops have it) causal attention.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

from slicedkern.kernels import Hat, ReLU  # noqa: E402
from slicedkern.nn import flax as sk_flax  # noqa: E402
from slicedkern.nn import torch as sk_torch  # noqa: E402

KERNELS = {"relu": {"kernel": "relu"},
           "hat": {"kernel": "hat", "bandwidth": 0.7},
           "hat_mixture": {"kernel": "hat_mixture", "bandwidth": 0.5, "mixture_size": 2},
           "custom": {"kernel": Hat(0.8) + 0.25 * ReLU()}}


@pytest.fixture(autouse=True)
def x64():
    """float64 in JAX for the duration of each test (float64 comparisons mean float64)."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def torch_layer(options, seed=0, embed_dim=12, num_heads=3):
    """A float64 torch layer with randomised bandwidths, mixture weights and biases."""
    torch.manual_seed(seed)
    layer = sk_torch.SlicedAttention(embed_dim, num_heads, dtype=torch.float64, **options)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias") or name == "mixture_weight":
                p.copy_(0.3 * torch.randn_like(p))
            elif name == "log_bandwidth":
                p.add_(0.3 * torch.randn_like(p))
    return layer


def flax_twin(layer, options, embed_dim=12, num_heads=3):
    twin = sk_flax.SlicedAttention(embed_dim, num_heads, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **options)
    twin.load_torch_state_dict({k: v.numpy() for k, v in layer.state_dict().items()})
    return twin


def data(n=2, q_len=5, k_len=7, embed=12, kdim=None, vdim=None, batch_first=True, seed=1):
    rng = np.random.default_rng(seed)

    def draw(length, dim):
        return rng.standard_normal((n, length, dim) if batch_first else (length, n, dim))

    mask = np.zeros((n, k_len), dtype=bool)
    mask[0, -2:] = True
    mask[-1, 1] = True
    return draw(q_len, embed), draw(k_len, kdim or embed), draw(k_len, vdim or embed), mask


def torch_run(layer, query, key, value, mask, cotangent, **kwargs):
    tensors = [torch.tensor(a, requires_grad=True) for a in (query, key, value)]
    out, _ = layer(*tensors, key_padding_mask=None if mask is None else torch.tensor(mask), **kwargs)
    (out * torch.tensor(cotangent)).sum().backward()
    return out.detach().numpy(), [t.grad.numpy() for t in tensors]


def flax_run(module, query, key, value, mask, cotangent, **kwargs):
    mask = None if mask is None else jnp.asarray(mask)

    def loss(q, k, v):
        out, _ = module(q, k, v, key_padding_mask=mask, **kwargs)
        return jnp.sum(out * cotangent), out

    # Under jit: eager JAX compiles each small op of the sort-scan once per shape, which is slower.
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        *(jnp.asarray(a) for a in (query, key, value)))
    return np.asarray(out), [np.asarray(g) for g in grads]


def assert_twins(layer, module, query, key, value, mask, **kwargs):
    cotangent = np.random.default_rng(9).standard_normal(
        (query.shape[0], query.shape[1], layer.embed_dim))
    t_out, t_grads = torch_run(layer, query, key, value, mask, cotangent, **kwargs)
    f_out, f_grads = flax_run(module, query, key, value, mask, cotangent, **kwargs)
    assert f_out.dtype == np.float64
    np.testing.assert_allclose(f_out, t_out, rtol=1e-10, atol=1e-12)
    # The two frameworks may run different engines (torch's CPU sweep, JAX's scan): the key
    # gradient goes through the normaliser's derivative and keeps about eight digits.
    for name, f, t in zip(("query", "key", "value"), f_grads, t_grads):
        np.testing.assert_allclose(f, t, rtol=1e-7, atol=1e-9 * np.abs(t).max(), err_msg=name)


@pytest.mark.parametrize("name, batch_first", [("relu", False), ("hat", True), ("hat_mixture", False),
                                               ("custom", True)])
def test_weight_copy_gives_torch_outputs_and_gradients(name, batch_first):
    """Cross-attention (Lq != Lk, kdim, vdim), a padding mask, every kernel, both layouts.

    Each case compiles the sort-scan under jax.jit (seconds): the layouts alternate over the
    kernels rather than multiply them.
    """
    options = {**KERNELS[name], "batch_first": batch_first, "kdim": 5, "vdim": 4}
    layer = torch_layer(options)
    module = flax_twin(layer, options)
    query, key, value, mask = data(kdim=5, vdim=4, batch_first=batch_first)
    assert_twins(layer, module, query, key, value, mask)


@pytest.mark.parametrize("options, masked", [
    ({"kernel": "hat", "center": True, "score": "linear", "rope": True}, True),
    ({"kernel": "hat_mixture", "center": True, "mixture_size": 3}, True),
    ({"kernel": "relu", "rope": True, "normalize": "relu", "bias": False}, True),
    ({"kernel": "relu"}, False),
    ({"kernel": "hat_mixture", "rope": True, "slices": 3}, True),
], ids=["hat-centred-linear-rope", "mixture-centred", "relu-rope-nobias", "relu-unmasked", "mixture-rope-slices"])
def test_weight_copy_with_options(options, masked):
    """Self-attention with centring, RoPE, other normalisers; a row of padded keys gives zeros."""
    options = {**options, "batch_first": True}
    layer = torch_layer(options, num_heads=2)
    module = flax_twin(layer, options, num_heads=2)
    query, _, _, mask = data(q_len=7)
    if not masked:
        assert_twins(layer, module, query, query, query, None)
        return
    mask[0] = True                         # a row whose keys are all padded: zeros in both
    assert_twins(layer, module, query, query, query, mask)
    out = jax.jit(lambda x, m: module(x, x, x, key_padding_mask=m)[0])(jnp.asarray(query), mask)
    assert np.all(np.asarray(out[0]) == 0)


@pytest.mark.parametrize("name, slices", [*((name, 1) for name in KERNELS), ("relu", 2)])
def test_weight_copy_causal(name, slices):
    options = {**KERNELS[name], "batch_first": True, "center": True, "slices": slices}
    layer = torch_layer(options)
    module = flax_twin(layer, options)
    query, _, _, mask = data(q_len=7)
    assert_twins(layer, module, query, query, query, mask, is_causal=True)


def test_unbatched_input_is_a_batch_of_one():
    module = sk_flax.SlicedAttention(8, 2, kernel="hat", rngs=nnx.Rngs(0), param_dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(0), (6, 1, 8))
    mask = jnp.array([[False] * 4 + [True] * 2])
    batched = jax.jit(lambda x, m: module(x, x, x, key_padding_mask=m)[0])(x, mask)
    single = jax.jit(lambda x, m: module(x, x, x, key_padding_mask=m)[0])(x[:, 0], mask[0])
    np.testing.assert_array_equal(np.asarray(single), np.asarray(batched[:, 0]))


@pytest.mark.parametrize("slices", [1, 3])
def test_padded_tokens_never_change_real_outputs(slices):
    module = sk_flax.SlicedAttention(32, 8, kernel="hat_mixture", center=True, rope=True, batch_first=True,
                                     slices=slices, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    real = jax.random.normal(jax.random.key(1), (2, 10, 32))
    padded = jnp.concatenate((real, 5.0 * jax.random.normal(jax.random.key(2), (2, 6, 32))), axis=1)
    mask = jnp.zeros((2, 16), dtype=bool).at[:, 10:].set(True)
    padded_out = jax.jit(lambda x, m: module(x, x, x, key_padding_mask=m)[0])(padded, mask)
    real_out = jax.jit(lambda x: module(x, x, x)[0])(real)
    np.testing.assert_allclose(np.asarray(padded_out[:, :10]), np.asarray(real_out), rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- transformations
@pytest.mark.parametrize("name", ["hat_mixture"])
def test_jax_jit_and_grad(name):
    """jax.jit of the split module matches eager; jax.grad reaches every parameter."""
    module = sk_flax.SlicedAttention(12, 3, batch_first=True, param_dtype=jnp.float64, rngs=nnx.Rngs(0),
                                     **KERNELS[name])
    query, key, value, mask = (jnp.asarray(a) for a in data(kdim=12, vdim=12))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, q):
        out, _ = nnx.merge(graphdef, params, rest)(q, key, value, key_padding_mask=mask)
        return jnp.sum(jnp.sin(out))

    eager = loss(params, query)
    value_jit = jax.jit(loss)(params, query)
    np.testing.assert_allclose(float(value_jit), float(eager), rtol=1e-12)
    grads = jax.jit(jax.grad(loss))(params, query)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    assert len(leaves) == len(jax.tree_util.tree_leaves(params))
    for path, leaf in leaves:
        where = jax.tree_util.keystr(path)
        assert np.all(np.isfinite(leaf)), where
        # Centred ReLU attention subtracts the mean value: the value bias cancels exactly.
        if not (name == "relu" and "v_proj" in where and "bias" in where):
            assert np.abs(leaf).max() > 1e-8, where


def test_nnx_grad_skips_fixed_bandwidth():
    module = sk_flax.SlicedAttention(8, 2, kernel="hat", learn_bandwidth=False, batch_first=True,
                                     rngs=nnx.Rngs(0))
    assert isinstance(module.log_bandwidth, sk_flax.FixedBandwidth)
    x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, x, x)[0] ** 2)))(module)
    assert "log_bandwidth" not in grads and "q_proj" in grads


def test_dropout_follows_train_and_eval():
    module = sk_flax.SlicedAttention(8, 2, dropout=0.5, batch_first=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    call = nnx.jit(lambda m, x: m(x, x, x)[0])
    first, second = call(module, x), call(module, x)
    assert not np.allclose(first, second)                  # a fresh dropout mask per call
    module.eval()
    evaluated = call(module, x)
    np.testing.assert_array_equal(evaluated, call(module, x))
    module.train()
    deterministic = nnx.jit(lambda m, x: m(x, x, x, deterministic=True)[0])(module, x)
    np.testing.assert_array_equal(deterministic, evaluated)


# ------------------------------------------------------------------------------------- state
def test_torch_state_dict_round_trip():
    options = {"kernel": "hat_mixture", "batch_first": True}
    module = sk_flax.SlicedAttention(12, 3, param_dtype=jnp.float64, rngs=nnx.Rngs(3), **options)
    layer = sk_torch.SlicedAttention(12, 3, dtype=torch.float64, **options)
    layer.load_state_dict({k: torch.tensor(v) for k, v in module.torch_state_dict().items()})
    query, key, value, mask = data()
    assert_twins(layer, module, query, key, value, mask)


def test_load_rejects_mismatched_state():
    module = sk_flax.SlicedAttention(12, 3, kernel="hat", rngs=nnx.Rngs(0))
    state = {k: v.numpy() for k, v in sk_torch.SlicedAttention(12, 3, kernel="relu").state_dict().items()}
    with pytest.raises(KeyError, match="missing \\['log_bandwidth'\\]"):
        module.load_torch_state_dict(state)
    state = {k: v.numpy() for k, v in sk_torch.SlicedAttention(12, 4, kernel="hat").state_dict().items()}
    with pytest.raises(ValueError, match="'score_out.weight' has shape"):
        module.load_torch_state_dict(state)


def test_float32_by_default():
    jax.config.update("jax_enable_x64", False)
    module = sk_flax.SlicedAttention(8, 2, kernel="hat", batch_first=True, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 5, 8), dtype=jnp.float32)
    out = jax.jit(lambda x: module(x, x, x)[0])(x)
    assert out.dtype == jnp.float32 and module.log_bandwidth[...].dtype == jnp.float32


# ------------------------------------------------------------------------------------ errors
def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="'num_heads'"):
        sk_flax.SlicedAttention(10, 3, rngs=nnx.Rngs(0))
    module = sk_flax.SlicedAttention(8, 2, batch_first=True, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 5, 8))
    with pytest.raises(ValueError, match="'query' must have embed_dim = 8"):
        module(jnp.ones((2, 5, 7)), x, x)
    with pytest.raises(TypeError, match="'key_padding_mask' must be a boolean mask"):
        module(x, x, x, key_padding_mask=jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match="'key_padding_mask' must have shape"):
        module(x, x, x, key_padding_mask=jnp.zeros((5, 2), dtype=bool))
    with pytest.raises(ValueError, match="need_weights=True"):
        module(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match="attn_mask"):
        module(x, x, x, attn_mask=jnp.zeros((5, 5), dtype=bool))


def test_signatures_are_the_constructors():
    """help() and the API pages show the constructors' parameters (NNX's metaclass hid them)."""
    import inspect

    layer = inspect.signature(sk_flax.SlicedAttention)
    assert list(layer.parameters)[:2] == ["embed_dim", "num_heads"]
    assert list(layer.parameters) == list(inspect.signature(sk_torch.SlicedAttention).parameters)[
        :len(layer.parameters) - 2] + ["param_dtype", "rngs"]
    assert "value" in inspect.signature(sk_flax.FixedBandwidth).parameters


# ------------------------------------------------------------------- issue 49: RoPE, flags
def test_rope_padding_is_no_position_in_cross_attention():
    """Issue 49 item 1, Flax: padded memory keys before the real ones, or after them with the queries
    placed by ``query_positions``, change no output."""
    layer = sk_flax.SlicedAttention(8, 2, kernel="hat", rope=True, batch_first=True, rngs=nnx.Rngs(0))
    query = jax.random.normal(jax.random.key(1), (2, 4, 8))
    memory = jax.random.normal(jax.random.key(2), (2, 6, 8))
    extra = jax.random.normal(jax.random.key(3), (2, 2, 8))
    pad = jnp.zeros((2, 8), dtype=bool).at[:, :2].set(True)
    base, _ = layer(query, memory, memory)
    before = jnp.concatenate([extra, memory], axis=1)
    assert float(jnp.max(jnp.abs(layer(query, before, before, key_padding_mask=pad)[0] - base))) < 1e-5
    own = jnp.broadcast_to(jnp.arange(4), (2, 4))
    base, _ = layer(query, memory, memory, query_positions=own)
    after = jnp.concatenate([memory, extra], axis=1)
    got, _ = layer(query, after, after, key_padding_mask=pad[:, ::-1], query_positions=own)
    assert float(jnp.max(jnp.abs(got - base))) < 1e-5
    with pytest.raises(TypeError, match="'query_positions' must hold integers"):
        layer(query, memory, memory, query_positions=own.astype(jnp.float32))


@pytest.mark.parametrize("flag", ["learn_bandwidth", "bias", "batch_first", "rope", "center"])
def test_flags_must_be_booleans(flag):
    """Issue 49 item 6, Flax: the constructor's and the call's flags are booleans (TypeError naming them)."""
    with pytest.raises(TypeError, match=f"'{flag}' must be True or False"):
        sk_flax.SlicedAttention(8, 2, kernel="hat", rngs=nnx.Rngs(0), **{flag: "no"})


@pytest.mark.parametrize("name", ["is_causal", "need_weights", "decode", "deterministic"])
def test_call_flags_must_be_booleans(name):
    layer = sk_flax.SlicedAttention(8, 2, batch_first=True, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 3, 8))
    with pytest.raises(TypeError, match=f"'{name}' must be True or False"):
        layer(x, x, x, **{name: "no"})
