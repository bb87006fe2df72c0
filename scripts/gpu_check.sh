#!/usr/bin/env bash
# The GPU check of issue 26, one command on a machine with an NVIDIA GPU and no network:
#
#     bash scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
#
# About 7 minutes in all, each part time-boxed, the most important first; every part writes its
# output under OUT_DIR as it goes, so a part that runs out of time loses nothing before it:
#   1. nvidia-smi and the versions (which card made every number);
#   2. the benchmark (scripts/gpu_bench.py): sort, device copy, forward and forward+backward of the
#      triton and scan engines and of SDPA, L = 1K ... 1M, bfloat16 and float32, causal rows, peak
#      memory, fraction of the bandwidth floor; bench.json rewritten after every row;
#   3. a torch.profiler kernel table of one forward+backward at L = 64K;
#   4. the triton engine's tests compiled on the GPU (TRITON_INTERPRET=0);
#   5. the test subset on the GPU backends (torch on CUDA, CuPy, JAX on the GPU).
# The project needs no install (PYTHONPATH), or `pip install --no-deps -e .`.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
start=$SECONDS
stamp() { echo "== $1 ($(( SECONDS - start )) s)" | tee -a "$out/log.txt"; }

stamp "card and versions"
nvidia-smi 2>&1 | tee "$out/nvidia-smi.txt"
python - <<'PY' 2>&1 | tee "$out/versions.txt"
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "jax", "cupy", "numba", "numpy", "slicedkern"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "unavailable:", type(exc).__name__, exc)
import torch
if torch.cuda.is_available():
    print("torch device:", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory // 2**20, "MiB")
PY

stamp "benchmark (budget 230 s)"
timeout 290 python scripts/gpu_bench.py --engines triton,scan --causal-lengths 1024,16384,65536 \
    --budget 230 --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"

stamp "kernel table at L = 65536"
timeout 60 python scripts/gpu_bench.py --lengths 65536 --dtypes bfloat16 --engines triton --repeat 1 \
    --budget 0 --profile-length 65536 2>&1 | tee "$out/profile.txt"

stamp "triton engine tests, compiled"
timeout 75 python -m pytest -q -p no:cacheprovider tests/engines/test_triton.py 2>&1 | tail -25 | tee "$out/test_triton.txt"

stamp "GPU backends test subset"
timeout 75 python -m pytest -q -p no:cacheprovider --backend torch_cuda,cupy,jax -x \
    tests/test_attention.py tests/test_gradients.py 2>&1 | tail -25 | tee "$out/test_backends.txt"
stamp "done"
