"""Run by tests/test_distributed_jax.py in a fresh interpreter whose XLA_FLAGS ask for 4 host devices
(the flag is read when JAX starts, so it cannot be set inside the test process).

Compares the sequence-parallel ops under ``jax.shard_map`` over a 4-device mesh axis with the
one-device ops on the whole sequence: forward and ``jax.grad`` of every array input. Prints "ok".
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import slicedkern
import slicedkern.distributed as skd

jax.config.update("jax_enable_x64", True)

DEVICES = 4
AXIS = "seq"

#: (name, op, fixed keyword arguments, array parameters {name: trailing shape}, key mask?): few, as each
#: compiles its own programs (the torch tests cover more combinations)
CASES = [
    ("relu-default", "relu_attention", {}, {}, True),
    ("mixture-arrays-relu", "hat_mixture_attention", {"normalize": "relu"}, {"bandwidths": (2,), "weights": (2,)},
     False),
    ("relu-default-causal", "relu_attention", {"causal": True}, {}, True),
    ("mixture-arrays-count-causal", "hat_mixture_attention", {"normalize": "count", "causal": True},
     {"bandwidths": (2,), "weights": (2,)}, False),
]


def run_case(seed, op, fixed, array_params, mask):
    rng = np.random.default_rng(seed)
    b, n, dv = 2, 4 * DEVICES, 3
    q, k = rng.normal(size=(b, n)), rng.normal(size=(b, n))
    q[:, :2] = k[:, -2:]                              # ties across shards
    v, w = rng.normal(size=(b, n, dv)), rng.normal(size=(b, n, dv))
    m = rng.random(size=(b, n)) > 0.3
    m[0, :3] = False
    params = {name: (rng.uniform(0.5, 2.0, size=(b,) + s) if name.startswith("bandwidth")
                     else rng.normal(size=(b,) + s)) for name, s in array_params.items()}
    names = list(params)
    key_mask = jnp.asarray(m) if mask else None

    def full(q, k, v, *ps):
        out = getattr(slicedkern, op)(q, k, v, key_mask=key_mask, **dict(zip(names, ps)), **fixed)
        return jnp.sum(out * w), out

    mesh = Mesh(np.array(jax.devices()[:DEVICES]), (AXIS,))

    def local(q, k, v, mk, *ps):
        return getattr(skd, op)(q, k, v, key_mask=mk if mask else None, axis_name=AXIS,
                                **dict(zip(names, ps)), **fixed)

    seq = P(None, AXIS)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, P(None, AXIS, None), seq) + (P(),) * len(names),
                            out_specs=P(None, AXIS, None))

    def parallel(q, k, v, *ps):
        out = sharded(q, k, v, jnp.asarray(m), *ps)
        return jnp.sum(out * w), out

    args = [jnp.asarray(a) for a in (q, k, v, *params.values())]
    argnums = tuple(range(len(args)))
    (_, ref), gref = jax.jit(jax.value_and_grad(full, argnums=argnums, has_aux=True))(*args)
    (_, got), ggot = jax.jit(jax.value_and_grad(parallel, argnums=argnums, has_aux=True))(*args)
    # the shards' partial sums are added in another order than the one-device prefix sums; a "relu"
    # normaliser near zero (few keys below a query) amplifies that rounding, hence rtol 1e-7 in float64
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-7, atol=1e-9)
    for i, (a, g) in enumerate(zip(ggot, gref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(g), rtol=1e-7, atol=1e-9,
                                   err_msg=f"gradient of argument {i}")


def main():
    assert len(jax.devices()) >= DEVICES, jax.devices()
    for seed, (name, op, fixed, array_params, mask) in enumerate(CASES):
        try:
            run_case(seed, op, fixed, array_params, mask)
        except Exception:
            print(f"case {name}, mask {mask}", file=sys.stderr)
            raise
    print("ok")


if __name__ == "__main__":
    main()
