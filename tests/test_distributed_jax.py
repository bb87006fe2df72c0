"""Sequence-parallel attention under ``jax.shard_map`` on 4 host devices, against one device.

The device count is fixed when JAX starts (``XLA_FLAGS=--xla_force_host_platform_device_count=4``),
so the comparison runs in a fresh interpreter (tests/_distributed_jax.py), with a deadline.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jax")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_shard_map_matches_one_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"
    try:
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "_distributed_jax.py")], env=env,
                              capture_output=True, text=True, timeout=540, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the 4-device JAX run did not finish in {exc.timeout} s")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok"), done.stdout[-2000:]
