"""The GPU check (``scripts/gpu_check.sh``, ``scripts/gpu_bench.py``) is prepared without a GPU:
its benchmark runs on the CPU at toy sizes with what it will run on a GPU (rows, SDPA
extrapolation, budget, the JSON rewritten after every row), and the shell script names files and
options that exist. Times are not checked here (docs/benchmarks.rst)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _helpers import ALL_BACKENDS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_bench():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_floor_counts_the_backwards_rereads(gpu_bench):
    L, D, H = 1000, 64, 8
    assert gpu_bench.floor_bytes(L, D, H, 2, False) == H * (2 * L + 2 * L * D) * 2
    # the backward re-reads q, k, v, reads out and its cotangent, writes dq, dk, dv
    assert gpu_bench.floor_bytes(L, D, H, 2, True) == H * (6 * L + 6 * L * D) * 2


def test_rows_extrapolation_and_json(gpu_bench, tmp_path, capsys):
    path = tmp_path / "bench.json"
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32,64", "--dtypes", "float32",
                    "--sdpa-max-length", "32", "--causal-lengths", "32", "--causal-engines", "scan",
                    "--repeat", "1", "--json", str(path)])
    rows = json.loads(path.read_text())
    printed = capsys.readouterr().out
    assert all(r["card"] == "cpu" for r in rows)
    kinds = {(r["impl"], r["L"], r["pass"]) for r in rows}
    for L in (32, 64):
        assert ("torch.sort 8 x L", L, "sort") in kinds
        for phase in ("fwd", "fwd+bwd"):
            assert ("scan", L, phase) in kinds and ("sdpa-efficient", L, phase) in kinds
    assert ("scan causal", 32, "fwd+bwd") in kinds
    # a length's causal rows follow its non-causal ones, before the next length (the budget's order)
    order = [(r["impl"], r["L"]) for r in rows]
    assert order.index(("scan causal", 32)) < order.index(("torch.sort 8 x L", 64))
    assert all(r["ms"] is not None and r["ms"] > 0 for r in rows), [r for r in rows if r["ms"] is None]
    for phase in ("fwd", "fwd+bwd"):
        sdpa = {r["L"]: r for r in rows if r["impl"] == "sdpa-efficient" and r["pass"] == phase}
        assert sdpa[32]["note"] == "" and sdpa[64]["note"].startswith("~ extrapolated")
        assert sdpa[64]["ms"] == pytest.approx(4 * sdpa[32]["ms"])
    assert printed.count("\n| ") == len(rows) + 1 and "device: cpu" in printed      # the header, then a line a row


def test_decode_rows_time_our_cache_and_the_softmax_cache(gpu_bench, tmp_path):
    """``--decode-lengths``: per cache length a DecodeCache row (naming the runs that served it) and a
    softmax KV-cache row, after the first length's rows."""
    path = tmp_path / "bench.json"
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32,64", "--dtypes", "float32",
                    "--sdpa-max-length", "32", "--decode-lengths", "16,64", "--repeat", "1", "--json", str(path)])
    rows = json.loads(path.read_text())
    decode = [(r["impl"], r["L"]) for r in rows if r["pass"] == "decode token"]
    assert [n for _, n in decode] == [16, 16, 64, 64]
    assert decode[0][0].startswith("DecodeCache (") and decode[1][0] == "softmax KV cache (SDPA)"
    assert all(r["ms"] > 0 for r in rows if r["pass"] == "decode token")
    order = [(r["impl"], r["L"]) for r in rows]
    assert order.index(decode[-1]) < order.index(("torch.sort 8 x L", 64))


def test_budget_skips_what_did_not_start(gpu_bench, tmp_path, capsys):
    path = tmp_path / "bench.json"
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32", "--dtypes", "float32",
                    "--repeat", "1", "--budget", "0", "--json", str(path)])
    assert "skipped 5 rows" in capsys.readouterr().out
    assert not path.exists()


def test_check_script_names_what_exists():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)
    for name in re.findall(r"(?:scripts|tests)/[\w/]+\.py", script):
        assert (ROOT / name).is_file(), name
    for backends in re.findall(r"--backend ([\w,]+)", script):
        assert set(backends.split(",")) <= set(ALL_BACKENDS), backends
    options = set(re.findall(r"(--[\w-]+)", (ROOT / "scripts" / "gpu_bench.py").read_text()))
    for line in re.findall(r"python scripts/gpu_bench\.py([^\n]*(?:\\\n[^\n]*)*)", script):
        for option in re.findall(r"(--[\w-]+)", line):
            assert option in options, option


def test_profile_splits_host_from_device_time(gpu_bench, capsys):
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32", "--dtypes", "float32",
                    "--budget", "0", "--profile-length", "32", "--profile-dtypes", "float32,float64"])
    printed = capsys.readouterr().out
    for dtype in ("float32", "float64"):
        assert f"scan, L = 32, {dtype}, on cpu:" in printed
    found = re.findall(r"first call \(compiles\) [\d.]+ ms; warm call: host returned after [\d.]+ ms, device done "
                       r"after [\d.]+ ms; (\d+) aten calls", printed)
    assert len(found) == 2 and all(int(calls) > 0 for calls in found)
    assert "# of Calls" in printed           # the operator tables


def test_tiles_option_sets_the_triton_kernels_shapes(gpu_bench, monkeypatch, capsys):
    """``--tiles`` (the check's A/B of the kernels' shapes) reaches the engine's block sizes and warps."""
    from slicedkern.engines.triton import _sums
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_C", "MERGE_WARPS"):
        monkeypatch.setattr(_sums, name, getattr(_sums, name))        # restored after the test
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32", "--dtypes", "float32",
                    "--repeat", "1", "--budget", "0", "--tiles", "32,16,8,2"])
    assert (_sums.BLOCK_M, _sums.BLOCK_N, _sums.BLOCK_C, _sums.MERGE_WARPS) == (32, 16, 8, 2)
    assert "triton tiles 32,16,8,2" in capsys.readouterr().out


def test_small_fused_option_sets_the_short_rows_threshold(gpu_bench, monkeypatch, capsys):
    """``--small-fused`` (the check's A/B of the one-launch forward of short rows) reaches the
    engine's threshold and is printed with the card."""
    from slicedkern.engines.triton import _sums
    monkeypatch.setattr(_sums, "SMALL_FUSED", _sums.SMALL_FUSED)        # restored after the test
    gpu_bench.main(["--device", "cpu", "--engines", "scan", "--lengths", "32", "--dtypes", "float32",
                    "--repeat", "1", "--budget", "0", "--small-fused", "0"])
    assert _sums.SMALL_FUSED == 0
    assert "one-launch forward up to L = 0" in capsys.readouterr().out
