"""torch.compile and torch.export of the ops and the layers: the fast engines as registered operators.

Under ``torch.compile`` an op whose engine cannot be traced (the sweep on CPU tensors, triton on
CUDA ones) is one ``slicedkern::attention`` node, its backward one ``slicedkern::attention_backward``
(slicedkern/adapters/_torch_ops.py, docs/compile.rst). Checked here: the operators pass
``torch.library.opcheck`` (schema, fakes against real runs, autograd registration, AOT dispatch with
dynamic shapes); a compiled call runs the sweep and gives eager's result bit for bit, forward and
gradients; the layers compile with ``fullgraph=True`` and no graph break; dynamic lengths compile
once; ``torch.export`` works; bad arguments raise the eager errors. The compiles use the
``aot_eager`` backend (the graph as inductor receives it, without its C++ build) but one, which
checks inductor's own.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import slicedkern  # noqa: E402
from slicedkern.engines import available  # noqa: E402
from slicedkern.kernels import Abs, Hat  # noqa: E402
from slicedkern.nn.torch import SlicedAttention, SlicedTransformerEncoder, SlicedTransformerEncoderLayer  # noqa: E402
from slicedkern.ops.attention import _RELU, hat_spec, prepare  # noqa: E402

pytestmark = pytest.mark.skipif("sweep" not in available("torch"), reason="the sweep engine needs numba")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        # dynamo notes what it traces (torch's own functools caches, autograd.Function internals);
        # they say nothing about the results checked here
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


def _data(batch=(2, 3), lq=6, lk=7, dv=4, *, ties=True, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.normal(size=batch + (lq,)), rng.normal(size=batch + (lk,))
    if ties and lq and lk > 1:
        k[..., 1] = k[..., 0]                 # a tie among the keys and one between a query and a key
        q[..., 0] = k[..., 0]
    v = rng.normal(size=batch + (lk, dv))
    return (torch.tensor(a, requires_grad=True) for a in (q, k, v))


#: the calls of every kernel family and option the operators serve, as prepare() takes them
CASES = {
    "relu": dict(kernel=_RELU, center=True, normalize="abs"),
    "relu-mask-causal": dict(kernel=_RELU, center=True, normalize="relu", mask=True, causal=True),
    "hat-array": dict(hats=("bandwidth",), center=True, normalize="count"),
    "hat-mixture-causal": dict(hats=("bandwidths", "weights"), normalize=None, causal=True),
    "abs-kernel-mask": dict(kernel=Abs(), normalize="count", mask=True),
    "hat-fixed-causal": dict(kernel=Hat(0.7), normalize="abs", causal=True),
}


def _call(case, engine, *, batch=(2, 3), lq=6, lk=7, dtype=torch.float64):
    q, k, v = (a.detach().to(dtype).requires_grad_() for a in _data(batch, lq, lk))
    options = CASES[case]
    mask = None
    if options.get("mask"):
        mask = torch.ones(batch + (lk,), dtype=torch.bool)
        if lk > 1:
            mask[..., -1] = False
    hats = None
    if "hats" in options:
        if options["hats"] == ("bandwidth",):
            hats = hat_spec((torch.rand(batch, dtype=dtype) + 0.5).requires_grad_(), None, ("bandwidth", "weights"))
        else:
            bandwidths = (torch.rand(batch + (2,), dtype=dtype) + 0.5).requires_grad_()
            weights = torch.tensor([1.0, -0.5], dtype=dtype, requires_grad=True)
            hats = hat_spec(bandwidths, weights, ("bandwidths", "weights"))
    return prepare(q, k, v, hats, kernel=options.get("kernel"), key_mask=mask, center=options.get("center", False),
                   normalize=options["normalize"], eps=1e-6, causal=options.get("causal", False), engine=engine,
                   xp=None)


# ------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("engine", ["sweep", "scan"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_operators_pass_opcheck(case, engine):
    """Schema, fakes against real runs (shapes, strides, dtypes of the output and every residual),
    autograd registration and AOT dispatch with dynamic shapes, forward and backward."""
    from slicedkern._spec import spec_parts
    from slicedkern.adapters import _torch_ops

    call = _call(case, engine)
    args = (list(call.inputs), *spec_parts(call.spec), call.engine.name, call.out_dtype, True)
    torch.library.opcheck(_torch_ops.attention, args)
    out, *residuals = _torch_ops.attention(*args)
    grad = torch.randn_like(out)
    # the backward's own inputs need no gradient: its backward is a clear error (second order)
    backward_args = ([a.detach() for a in call.inputs], out.detach(), [r.detach() for r in residuals], grad,
                     *args[1:4])
    torch.library.opcheck(_torch_ops.attention_backward, backward_args)


@pytest.mark.parametrize("shape", [dict(lq=0), dict(lk=0), dict(batch=(0, 3)), dict(lq=1, lk=1)],
                         ids=["no-query", "no-key", "empty-batch", "one-each"])
@pytest.mark.parametrize("case", ["relu", "relu-mask-causal"])
def test_operators_fakes_hold_on_empty_axes(case, shape):
    from slicedkern._spec import spec_parts
    from slicedkern.adapters import _torch_ops

    call = _call(case, "sweep", **shape)
    args = (list(call.inputs), *spec_parts(call.spec), "sweep", call.out_dtype, True)
    torch.library.opcheck(_torch_ops.attention, args, test_utils=("test_schema", "test_faketensor"))


def test_kernel_sum_operator_passes_opcheck():
    from slicedkern._spec import KernelSumSpec, spec_parts
    from slicedkern.adapters import _torch_ops

    x, y, w = _data(batch=(3,), lq=5, lk=8, dv=2)
    args = ([x, y, w], *spec_parts(KernelSumSpec(Hat(0.8))), "sweep", torch.float64, True)
    torch.library.opcheck(_torch_ops.kernel_sum, args)


def test_spec_parts_round_trip_every_case():
    from slicedkern._spec import _DECODED, spec_from_parts, spec_parts

    for case in CASES:
        spec = _call(case, "scan").spec
        text, numbers = spec_parts(spec)
        _DECODED.pop((text, tuple(numbers)), None)      # parsed, not looked up
        back = spec_from_parts(text, numbers)
        assert back == spec and type(back.kernel) is type(spec.kernel)


# ---------------------------------------------------------------------------- the compiled ops
class _Graphs:
    """A torch.compile backend that keeps each graph it is given and runs it as aot_eager would."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs.append(gm)
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)

    def engines(self):
        """The engine named by each slicedkern operator node of the graphs."""
        return [node.args[3] for gm in self.graphs for node in gm.graph.nodes
                if node.op == "call_function" and "slicedkern" in str(node.target)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_op_runs_the_sweep_bit_for_bit(causal, dtype):
    """One graph, the sweep in it, and eager's numbers exactly, forward and gradients (float32 too:
    the op computes in its work dtype and casts, the same way on both paths)."""
    q, k, v = (a.detach().to(dtype).requires_grad_() for a in _data())
    bandwidth = torch.tensor([0.6, 1.3, 0.9], dtype=dtype, requires_grad=True)

    def loss(q, k, v, bandwidth):
        relu = slicedkern.relu_attention(q, k, v, causal=causal)
        hat = slicedkern.hat_attention(q, k, v, bandwidth, causal=causal, center=True)
        return (relu * hat).sum(), relu

    graphs = _Graphs()
    compiled = torch.compile(loss, fullgraph=True, backend=graphs)
    expected, expected_out = loss(q, k, v, bandwidth)
    want = torch.autograd.grad(expected, (q, k, v, bandwidth))
    got, got_out = compiled(q, k, v, bandwidth)
    have = torch.autograd.grad(got, (q, k, v, bandwidth))
    assert graphs.engines() == ["sweep", "sweep"]
    assert torch.equal(got_out, expected_out)
    for a, b in zip(have, want):
        assert torch.equal(a, b)


def test_compiled_op_uses_the_requested_engine_and_the_scan_traces():
    """``engine="scan"`` is traced as before (no operator node); the sweep requested by name is one."""
    q, k, v = _data()
    graphs = _Graphs()
    for engine in ("scan", "sweep"):
        torch.compile(lambda q, k, v: slicedkern.relu_attention(q, k, v, engine=engine), fullgraph=True,
                      backend=graphs)(q, k, v)
    assert graphs.engines() == ["sweep"]


def test_compiled_inference_keeps_no_residuals():
    """Without a gradient to come the operator returns the output alone."""
    q, k, v = (a.detach() for a in _data())
    graphs = _Graphs()
    with torch.no_grad():
        got = torch.compile(slicedkern.relu_attention, fullgraph=True, backend=graphs)(q, k, v)
    assert torch.equal(got, slicedkern.relu_attention(q, k, v))
    keeps = [node.args[5] for gm in graphs.graphs for node in gm.graph.nodes if "slicedkern" in str(node.target)]
    assert keeps == [False]


BAD_CALLS = {
    "'eps'": lambda q, k, v: slicedkern.relu_attention(q, k, v, eps=-1.0),
    "'normalize'": lambda q, k, v: slicedkern.relu_attention(q, k, v, normalize="l2"),
    "'k' and 'v'": lambda q, k, v: slicedkern.relu_attention(q, k, v[..., :-1, :]),
    "'bandwidth'": lambda q, k, v: slicedkern.hat_attention(q, k, v, -1.0),
    "'key_mask'": lambda q, k, v: slicedkern.relu_attention(q, k, v, key_mask=k),
    "'causal'": lambda q, k, v: slicedkern.relu_attention(q, k, v, causal="yes"),
}


@pytest.mark.parametrize("argument", sorted(BAD_CALLS))
def test_compiled_errors_are_the_eager_errors(argument):
    """The validation runs while dynamo traces: without ``fullgraph`` the eager ``ValueError`` /
    ``TypeError`` itself; with it, dynamo's error carries the same message (it refuses to let an
    exception leave a full graph)."""
    q, k, v = _data()
    fn = BAD_CALLS[argument]
    with pytest.raises((ValueError, TypeError)) as eager:
        fn(q, k, v)
    with pytest.raises(type(eager.value), match=argument):
        torch.compile(fn, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(Exception) as full:
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert str(eager.value) in str(full.value)


def test_compiled_op_with_dynamic_lengths_compiles_once():
    counts = []

    def backend(gm, example_inputs):
        counts.append(gm)
        return gm

    compiled = torch.compile(lambda q, k, v: slicedkern.relu_attention(q, k, v, causal=True), fullgraph=True,
                             dynamic=True, backend=backend)
    for length in (9, 13, 21, 34):
        q, k, v = (a.detach() for a in _data(lq=length, lk=length))
        assert torch.equal(compiled(q, k, v), slicedkern.relu_attention(q, k, v, causal=True))
    assert len(counts) == 1


# ------------------------------------------------------------------------------------ the layers
def _layer_models():
    torch.manual_seed(0)
    attention = SlicedAttention(16, 2, batch_first=True, dtype=torch.float64)
    stack = SlicedTransformerEncoder(
        SlicedTransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                      dtype=torch.float64), num_layers=2)
    mha = torch.nn.Sequential(torch.nn.Linear(16, 16, dtype=torch.float64),
                              torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                                               dtype=torch.float64))
    converted = slicedkern.nn.torch.convert_attention(mha)
    return {
        "attention-causal": lambda x: attention(x, x, x, is_causal=True)[0],
        "attention-padding": lambda x: attention(x, x, x, key_padding_mask=x[..., 0] > 1.0)[0],
        "stack-causal": lambda x: stack(x, is_causal=True,
                                        mask=torch.nn.Transformer.generate_square_subsequent_mask(
                                            x.shape[1], dtype=torch.float64)),
        "converted": converted,
    }, [attention, stack, converted]


@pytest.mark.parametrize("name", ["attention-causal", "attention-padding", "stack-causal", "converted"])
def test_layers_compile_whole_on_the_sweep(name):
    """fullgraph=True (no graph break), the sweep inside, eager's output and parameter gradients."""
    models, modules = _layer_models()
    model = models[name]
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    expected = model(x)
    expected.square().sum().backward()
    params = [p for m in modules for p in m.parameters()]
    want = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    graphs = _Graphs()
    got = torch.compile(model, fullgraph=True, backend=graphs)(x)
    got.square().sum().backward()
    assert graphs.engines() and set(graphs.engines()) == {"sweep"}
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for p, g in zip(params, want):
        if g is not None:
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-12)


def test_layer_compiles_with_inductor():
    """Inductor's own build (C++ for the layer's projections) around the operator nodes."""
    torch.manual_seed(0)
    layer = SlicedAttention(8, 2, batch_first=True)
    x = torch.randn(2, 10, 8, requires_grad=True)
    expected = layer(x, x, x, is_causal=True)[0]
    want = torch.autograd.grad(expected.sum(), x)[0]
    got = torch.compile(layer, fullgraph=True)(x, x, x, is_causal=True)[0]
    have = torch.autograd.grad(got.sum(), x)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)


def test_export_of_a_model_with_the_layer():
    torch.manual_seed(0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = SlicedAttention(16, 2, batch_first=True, dtype=torch.float64)

        def forward(self, x):
            return self.attention(x, x, x, is_causal=True)[0]

    model = Model()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    length = torch.export.Dim("length", min=2, max=4096)
    program = torch.export.export(model, (x,), dynamic_shapes={"x": {1: length}})
    targets = {str(node.target) for node in program.graph.nodes}
    assert "slicedkern.attention.default" in targets
    for n in (9, 17):
        y = torch.randn(2, n, 16, dtype=torch.float64)
        torch.testing.assert_close(program.module()(y), model(y), rtol=0, atol=0)


def test_layer_with_dynamic_lengths_compiles_once():
    torch.manual_seed(0)
    layer = SlicedAttention(16, 2, batch_first=True, dtype=torch.float64, rope=True)
    counts = []

    def backend(gm, example_inputs):
        counts.append(gm)
        return gm

    compiled = torch.compile(lambda x: layer(x, x, x, is_causal=True)[0], fullgraph=True, dynamic=True,
                             backend=backend)
    for length in (9, 13, 21):
        x = torch.randn(2, length, 16, dtype=torch.float64)
        assert torch.equal(compiled(x), layer(x, x, x, is_causal=True)[0])
    assert len(counts) == 1
