"""The benchmarks: ``python -m slicedkern bench`` and the asv suite in ``asv_bench/``.

Tiny sizes only: these tests check that the bench and the asv suite run and report what they
claim, not how fast anything is.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import io
import itertools
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from _helpers import require_selected

from slicedkern import __main__ as cli
from slicedkern import bench
from slicedkern.bench import backends as bench_backends
from slicedkern.bench import run as bench_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(sizes=[64, 128], repeats=1, batch=2, dim=8, min_time=0.0, progress=False)


def _installed(name):
    return importlib.util.find_spec(name) is not None


def _subprocess_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _expected_keys(backend):
    be = bench_backends.make_backend(backend, "cpu", 1, 1)
    engines = ["scan"] + (["sweep"] if bench_run.sweep_serves(be)[0] else [])
    keys = [f"relu_fwd:{e}" for e in engines] + [f"relu_fwdbwd:{e}" for e in engines] + ["hat_fwd"]
    keys += ["sdpa"] if _installed("torch") else ["softmax"]      # a NumPy softmax without torch
    return keys + ["dense"]


# --------------------------------------------------------------------------------- the bench
@pytest.mark.parametrize("backend", bench_backends.BACKEND_NAMES)
def test_bench_table(backend, request):
    require_selected(request.config, backend)
    pytest.importorskip(backend)
    sizes = [64] if backend == "jax" else [64, 128]      # JAX compiles once per shape: keep it short
    result = bench.run_bench(backend=backend, budget=math.inf, **{**TINY, "sizes": sizes})
    assert result.sizes == sizes
    assert [c.key for c in result.columns] == _expected_keys(backend)
    for n in result.sizes:
        for col in result.columns:
            t = result.times[n, col.key]
            if col.key.startswith(("relu_fwd:", "hat", "sdpa", "softmax", "dense")):
                assert t.measured, (n, col.key, t, result.notes)
            if t.seconds is not None:
                assert math.isfinite(t.seconds) and t.seconds > 0, (n, col.key, t)
                assert t.calls == 1
        ratio, estimated = result.speedup(n, "dense")
        assert ratio is not None and math.isfinite(ratio) and not estimated
    text = result.format()
    lines = text.splitlines()
    for n in sizes:
        assert sum(line.split()[:1] == [str(n)] for line in lines) == 2    # one row in each table
    for words in ("ReLU fwd", "ReLU fwd+bwd", "hat fwd", "dense fwd", "speed-up", "peak MiB",
                  "CPU:", "versions:"):
        assert words in text
    assert ("SDPA fwd" in text) == _installed("torch")
    assert ("softmax fwd" in text) != _installed("torch")
    baseline = "sdpa" if _installed("torch") else "softmax"
    for n in sizes:     # the headline: sliced attention against softmax attention, measured
        ratio, estimated = result.speedup(n, baseline)
        assert ratio is not None and math.isfinite(ratio) and not estimated


def test_bench_engine_columns(monkeypatch):
    """One forward and one forward+backward column per engine, the speed-up from the fastest."""
    monkeypatch.setattr(bench_run, "sweep_serves", lambda backend: (True, ""))
    result = bench.run_bench(backend="numpy", budget=math.inf, **TINY)
    keys = [c.key for c in result.columns]
    assert keys[:4] == ["relu_fwd:scan", "relu_fwd:sweep", "relu_fwdbwd:scan", "relu_fwdbwd:sweep"]
    for n in result.sizes:
        assert result.best_sliced(n) == min(result.times[n, k].seconds for k in keys[:2])
        assert {"relu_fwd:scan", "relu_fwd:sweep"} <= {k for (m, k) in result.memory if m == n}
    lines = result.format().splitlines()
    assert lines[lines.index("time per call") + 2].split()[:5] == ["scan", "sweep", "scan", "sweep",
                                                                   "b=0.5"]


def test_bench_budget_extrapolates(monkeypatch):
    result = bench.run_bench(backend="numpy", budget=0.0, **TINY)
    times = [result.times[n, "relu_fwd:scan"] for n in result.sizes]
    assert times[0].measured and times[1].estimated    # even the headline, beyond 30 x budget
    monkeypatch.setattr(bench_run, "HEADLINE_FACTOR", math.inf)
    result = bench.run_bench(backend="numpy", budget=0.0, **TINY)
    assert all(result.times[n, "relu_fwd:scan"].measured for n in result.sizes)
    dense = [result.times[n, "dense"] for n in result.sizes]
    assert dense[0].measured and dense[1].estimated   # 128 extrapolated from 64, x L^2
    assert dense[1].seconds == pytest.approx(4 * dense[0].seconds)
    assert "~" in result.format()


def test_bench_skips_dense_above_limit(monkeypatch):
    monkeypatch.setattr(bench_run, "DENSE_MAX", 64)
    result = bench.run_bench(backend="numpy", budget=math.inf, **TINY)
    assert result.times[64, "dense"].measured
    assert result.times[128, "dense"].seconds is None
    assert result.times[128, "dense"].note == "skip"


def test_bench_progress_bar():
    stream = io.StringIO()
    bench.run_bench(backend="numpy", budget=math.inf, stream=stream,
                     **{**TINY, "sizes": [64], "progress": True})
    text = stream.getvalue()
    assert "\r[" in text and "L=64" in text
    assert text.endswith("\r")                         # erased at the end


def test_bench_errors():
    with pytest.raises(ValueError, match="CPU only"):
        bench.run_bench(backend="numpy", device="cuda", **TINY)
    with pytest.raises(ValueError, match="backend"):
        bench.run_bench(backend="cupy", **TINY)


def test_cli_bench(capsys):
    status = cli.main(["bench", "--backend", "numpy", "--sizes", "64,128", "--repeats", "1",
                       "--batch", "2", "--dim", "8", "--no-progress"])
    assert status == 0
    out = capsys.readouterr().out
    assert "time per call" in out and "ReLU fwd" in out and "total bench time" in out


def test_cli_bench_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--sizes", "64,abc"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_cli_plot(tmp_path, capsys):
    path = tmp_path / "bench.png"
    argv = ["bench", "--backend", "numpy", "--sizes", "64,128", "--repeats", "1", "--batch", "2",
            "--dim", "8", "--no-progress", "--plot", str(path)]
    if _installed("matplotlib"):
        assert cli.main(argv) == 0
        assert path.stat().st_size > 0
    else:
        assert cli.main(argv) == 2
        assert "matplotlib" in capsys.readouterr().err


def test_cli_help():
    proc = subprocess.run([sys.executable, "-m", "slicedkern", "bench", "--help"], cwd=ROOT,
                          env=_subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for option in ("--backend", "--sizes", "--device", "--batch", "--dim", "--repeats", "--plot", "--causal",
                   "--decode-sizes"):
        assert option in proc.stdout


def test_cli_imports_no_framework():
    code = ("import sys, slicedkern, slicedkern.bench, slicedkern.__main__ as m\n"
            "try:\n    m.main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(k for k in ('torch', 'jax', 'matplotlib', 'numba') if k in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"



# ------------------------------------------------------------------------- the causal section
def _table_rows(text, header):
    """The cells of the Markdown table that follows the line starting with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 4:]:                  # title, blank, header, rule
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_bench_causal_tables():
    pytest.importorskip("torch")
    from slicedkern.bench import causal
    text = causal.run_causal(sizes=[64, 128], decode_sizes=[32, 64], batch=2, dim=8, repeats=1, steps=3,
                             budget=math.inf)
    attention = _table_rows(text, "Causal attention")
    engines = causal.causal_engines()
    assert "scan" in engines and "triton" not in engines
    labels = [f"relu causal, engine={e}" for e in engines] + ["relu, not causal (default engine)",
                                                               "SDPA is_causal"]
    assert [(int(r[0]), r[1]) for r in attention] == [(n, label) for n in (64, 128) for label in labels]
    # structure, not timing: every cell a plain measured number (no "~", nothing extrapolated); a
    # ratio printed with two decimals may read 0.00 under load (issue 23, item 4)
    for row in attention:
        assert all(not cell.startswith("~") and float(cell) >= 0 for cell in row[2:5]), row
    decode = _table_rows(text, "Decoding")
    assert [int(r[0]) for r in decode] == [32, 64]
    assert all(not cell.startswith("~") and float(cell) >= 0 for r in decode for cell in r[1:4])


def test_bench_causal_extrapolates_sdpa():
    pytest.importorskip("torch")
    from slicedkern.bench import causal
    text = causal.run_causal(sizes=[2048], decode_sizes=[], batch=1, dim=4, repeats=1, budget=0.0)
    sdpa = [r for r in _table_rows(text, "Causal attention") if r[1] == "SDPA is_causal"]
    assert sdpa[0][2].startswith("~") and sdpa[0][3].startswith("~")      # timed at 1024, x 4
    assert "Decoding" not in text


def test_cli_bench_causal(capsys):
    pytest.importorskip("torch")
    status = cli.main(["bench", "--causal", "--causal-sizes", "64", "--decode-sizes", "32", "--repeats", "1",
                       "--batch", "2", "--dim", "8"])
    assert status == 0
    out = capsys.readouterr().out
    assert "SDPA is_causal" in out and "DecodeCache" in out

# ---------------------------------------------------------------------------------- asv suite
@pytest.fixture(scope="module")
def asv_modules():
    """The benchmark modules of ``asv_bench/benchmarks``, imported as asv does."""
    path = os.path.join(ROOT, "asv_bench")
    sys.path.insert(0, path)
    try:
        names = sorted(f[:-3] for f in os.listdir(os.path.join(path, "benchmarks"))
                       if f.startswith("bench_") and f.endswith(".py"))
        return [importlib.import_module(f"benchmarks.{name}") for name in names]
    finally:
        sys.path.remove(path)


_PREFIXES = ("time_", "peakmem_", "track_")


def _benchmark_classes(modules):
    for module in modules:
        for name, cls in vars(module).items():
            if (inspect.isclass(cls) and not name.startswith("_") and cls.__module__ == module.__name__
                    and any(m.startswith(_PREFIXES) for m in dir(cls))):
                yield cls


def test_asv_suite_layout(asv_modules):
    classes = list(_benchmark_classes(asv_modules))
    names = {c.__name__ for c in classes}
    assert {"KernelSum", "ReluAttention", "ReluAttentionGrad", "HatAttention", "HatAttentionGrad",
            "EnergyDistance"} <= names
    for cls in classes:
        assert len(cls.params) == len(cls.param_names), cls
        assert cls.param_names[:3] == ["backend", "engine", "n"], cls
        assert cls.params[0] == ["numpy", "torch", "jax"]      # never depends on what is installed
        assert cls.params[1] == ["scan", "sweep"]
    methods = {m for c in classes for m in dir(c) if m.startswith(_PREFIXES)}
    assert {"time_forward", "time_forward_backward", "peakmem_forward", "track_float32_error",
            "time_kernel_sum", "time_energy_distance"} <= methods


def _engine_choice():
    """What the engine selection does now, seen through the public ``engine_for``."""
    import slicedkern
    seen = [slicedkern.engine_for(np.zeros(2, dtype=np.float32))]
    if _installed("jax"):
        import jax.numpy as jnp
        try:
            seen.append(slicedkern.engine_for(jnp.zeros(2, dtype=jnp.float32)))
        except ValueError:              # "sweep" forced: JAX arrays are not served
            seen.append("refused")
    return seen


@pytest.mark.parametrize("backend", bench_backends.BACKEND_NAMES)
def test_asv_benchmarks_run(asv_modules, backend, request):
    """Every benchmark's setup / methods / teardown on tiny sizes; skips only where it may."""
    require_selected(request.config, backend)
    pytest.importorskip(backend)
    before = _engine_choice()
    ran = set()
    for cls in _benchmark_classes(asv_modules):
        if backend == "jax" and not cls.__name__.startswith("ReluAttention"):
            continue                        # JAX: the jit and grad paths once (compiling is slow)
        extras = list(itertools.product(*cls.params[3:]))   # e.g. every kernel of KernelSum
        for extra in extras:
            for engine in ("scan", "sweep"):
                params = (backend, engine, 64, *extra)
                bench = cls()
                try:
                    bench.setup(*params)
                except NotImplementedError:
                    continue
                try:
                    for name in dir(cls):
                        if name.startswith(_PREFIXES):
                            value = getattr(bench, name)(*params)
                            if name.startswith("track_"):
                                unit = getattr(cls, name).unit
                                if unit == "RMS relative error":    # a Monte-Carlo error (directions)
                                    assert 0 < value < 0.1, (cls.__name__, params, value)
                                else:                               # a float32 rounding error
                                    assert unit == "relative error"
                                    assert 0 <= value < 1e-4, (cls.__name__, params, value)
                            ran.add((cls.__name__, engine))
                finally:
                    bench.teardown(*params)
                assert _engine_choice() == before, (cls.__name__, params)   # context was left
    # what this version has must run, not skip
    import slicedkern
    expected = {"ReluAttention", "ReluAttentionGrad"}
    if backend != "jax":
        expected |= {"KernelSum", "HatAttention", "HatAttentionGrad"}
        expected |= {"EnergyDistance"} if hasattr(slicedkern, "energy_distance") else set()
    engines = ["scan"] + (["sweep"] if bench_run.sweep_serves(
        bench_backends.make_backend(backend, "cpu", 1, 1))[0] else [])
    missing = {(name, e) for name in expected for e in engines} - ran
    if backend == "torch":                  # causal attention and decoding: torch only, the scan at least
        missing |= {("CausalAttention", "scan"), ("Decode", "scan")} - ran
    assert not missing, missing


def test_asv_engine_skip(asv_modules):
    """An engine that cannot serve the arrays skips (NotImplementedError), never fails."""
    common = importlib.import_module("benchmarks.common")
    # the triton engine serves torch tensors only (the sweep now serves JAX on the CPU too)
    with pytest.raises(NotImplementedError):
        common.engine_context("triton", np.zeros(3, dtype=np.float32))


# ------------------------------------------------------------------ the softmax baseline without torch
def test_numpy_softmax_baseline_is_softmax_attention():
    be = bench_backends.make_backend("numpy", "cpu", 2, 4)
    baseline = bench_backends.NumpySoftmax(be)
    q, k, v, _ = baseline.inputs(be, 5)
    assert q.shape == (2, 1, 5, 4) and q.dtype == np.float32
    out = baseline.run(q, k, v, None)
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / 2.0
    weights = np.exp(scores) / np.exp(scores).sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(out, weights @ v.astype(np.float64), rtol=1e-5, atol=1e-6)


def test_bench_without_torch_compares_with_a_numpy_softmax(monkeypatch):
    installed = bench_run.Backend.installed
    monkeypatch.setattr(bench_run.Backend, "installed", lambda self: self is not bench_run.Backend.TORCH
                        and installed(self))
    result = bench.run_bench(backend="numpy", budget=math.inf, **{**TINY, "sizes": [64]})
    assert "softmax" in [c.key for c in result.columns] and "sdpa" not in [c.key for c in result.columns]
    ratio, estimated = result.speedup(64, "softmax")
    assert ratio is not None and math.isfinite(ratio) and not estimated
    text = result.format()
    assert "softmax fwd" in text and "vs softmax fwd" in text and "SDPA fwd" not in text


def test_readme_example_output_names_this_version():
    """The README's bench output is of this release (it said 0.1.0 on 0.2.0: issue 23, item 3)."""
    import re

    import slicedkern
    with open(os.path.join(ROOT, "README.md")) as f:
        versions = re.findall(r"^slicedkern (\S+) bench on ", f.read(), flags=re.MULTILINE)
    assert versions, "the README shows no bench output"
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        declared = re.search(r'^version = "([^"]+)"', f.read(), flags=re.MULTILINE).group(1)
    assert set(versions) == {declared}
    assert slicedkern.__version__ in (declared, "0+unknown")


def test_bench_stats_compares_torch_with_numpy_on_the_sliced_energy_distance():
    torch = pytest.importorskip("torch")
    from slicedkern.bench.stats import run_stats
    text = run_stats(sizes=[200], rd_sizes=[50], sliced_sizes=[300], repeats=1)
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 300 |")]
    assert [r[1].strip() for r in rows] == ["NumPy float64", "torch float32", "torch float64"]
    values = [float(r[4]) for r in rows]
    assert float(rows[0][3]) == 1.0 and all(float(r[3]) > 0 for r in rows)
    np.testing.assert_allclose(values, values[0], rtol=1e-5)      # the same statistic on both libraries
    assert f"{torch.get_num_threads()} torch threads" in text
