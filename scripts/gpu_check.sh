#!/usr/bin/env bash
# The GPU check of issue 26, one command on a machine with an NVIDIA GPU and no network:
#
#     bash scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
#
# At most GPU_CHECK_DEADLINE seconds (540) in all, each part time-boxed, the most important first; every part writes its
# output under OUT_DIR as it goes, so a part that runs out of time loses nothing before it:
#   1. nvidia-smi and the versions (which card made every number);
#   1b. the triton engine's tests compiled on the GPU (TRITON_INTERPRET=0), before the timings;
#   2. the benchmark (scripts/gpu_bench.py): sort, device copy, forward and forward+backward of the
#      triton and scan engines and of SDPA, L = 1K ... 1M, bfloat16 and float32, causal rows (triton
#      and scan), decoding per token (DecodeCache against a softmax KV cache, 1K ... 1M), peak
#      memory, fraction of the bandwidth floor; bench.json rewritten after every row;
#   3. torch.compile of the layer on triton against eager at L = 16384 (scripts/compile_bench.py, into bench.txt);
#   4. a torch.profiler kernel table of one forward+backward at L = 64K;
#   5. (moved to 1b);
#   6. the test subset on the GPU backends (torch on CUDA, CuPy, JAX on the GPU);
#   7. the triton engine's short rows (L = 256, 1024) through the sorts and two passes against its
#      one-launch forward (small_attend), for the threshold _sums.SMALL_FUSED;
#   8. the triton engine at 16K with the kernels' shapes of 2026-11-27 (tiles of 64 keys, pass 2 on 4
#      warps, which spilled registers) against today's (16 keys, 8 warps), for the A/B.
# It writes eight files, the most a device call brings back: log.txt, card.txt, bench.json,
# bench.txt, profile.txt, test_triton.txt, test_backends.txt, tiles.txt.
# The project needs no install (PYTHONPATH), or `pip install --no-deps -e .`; its one pure-Python
# dependency, array_api_compat, was missing on the H100 image of 2026-11-27: copy the package folder
# from a local venv into an ignored folder of the checkout (.gpudeps/array_api_compat), carry it, and
# prepend that folder to PYTHONPATH. The check stops at once, saying so, when it cannot import it.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check_out}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0
start=$SECONDS
# the whole check ends by GPU_CHECK_DEADLINE seconds (default 540, for a device call of 600 s): each
# part runs for the smaller of its own limit and what is left, and a part with under 20 s left is skipped
deadline=${GPU_CHECK_DEADLINE:-540}
stamp() { echo "== $1 ($(( SECONDS - start )) s)" | tee -a "$out/log.txt"; }
limit() {   # limit SECONDS: the time a part may take now, or 0 when too little is left
    local left=$(( deadline - (SECONDS - start) ))
    (( left > $1 )) && left=$1
    (( left < 20 )) && left=0
    echo $left
}
boxed() {   # boxed SECONDS COMMAND...: COMMAND under timeout, skipped (saying so) when too little is left
    local t; t=$(limit "$1"); shift
    if (( t == 0 )); then echo "skipped: the check's deadline of $deadline s is near" | tee -a "$out/log.txt"; return 124; fi
    timeout "$t" "$@"
}

stamp "card and versions"
nvidia-smi 2>&1 | tee "$out/card.txt"
python - <<'PY' 2>&1 | tee -a "$out/card.txt"
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

python -c "import array_api_compat" 2>/dev/null || {
    echo "array_api_compat cannot be imported: carry it (see the head of this script)" | tee -a "$out/log.txt"
    exit 1
}

# first: the run of 2026-12-04 found the causal kernels failing to compile under Triton 3.6 (fixed
# since on CPU, docs/benchmarks.rst, "On a GPU"); into a file, then its tail: a timeout kills a
# whole pipeline, and pytest's summary with it
stamp "triton engine tests, compiled"
boxed 120 python -m pytest -q -rf --tb=line -p no:cacheprovider tests/engines/test_triton.py \
    > "$out/test_triton.txt" 2>&1; tail -25 "$out/test_triton.txt"

stamp "benchmark (budget 150 s)"
boxed 210 python scripts/gpu_bench.py --engines triton,scan --causal-engines triton,scan --causal-lengths 1024,16384,65536 \
    --decode-lengths 1024,65536,1048576 \
    --budget 150 --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"

# torch.compile of the layer on triton (one operator node per call; its backward makes the forward's
# residuals again, docs/compile.rst) against eager, at L = 16384, appended to bench.txt
stamp "compiled layer against eager, L = 16384"
for causal in 0 1; do
    boxed 60 python scripts/compile_bench.py --device cuda --length 16384 --causal $causal --repeats 5 \
        2>&1 | tail -3 | tee -a "$out/bench.txt"
done

# the kernels compiled by the benchmark serve every length (the binary search's depth is an argument)
stamp "kernel table at L = 65536"
boxed 80 python scripts/gpu_bench.py --lengths 65536 --engines triton --budget 0 --profile-length 65536 \
    --profile-dtypes bfloat16,float32 > "$out/profile.txt" 2>&1; cat "$out/profile.txt"


stamp "GPU backends test subset"
boxed 70 python -m pytest -q -rf --tb=line -p no:cacheprovider --backend torch_cuda,cupy,jax \
    tests/test_attention.py tests/test_gradients.py > "$out/test_backends.txt" 2>&1; tail -25 "$out/test_backends.txt"
stamp "triton short rows A/B at L = 256 and 1024 (the sorts and two passes, then one launch)"
small_run() {     # small_run THRESHOLD: appended to $out/tiles.txt
    echo "-- small-fused $1" >> "$out/tiles.txt"
    boxed 45 python scripts/gpu_bench.py --lengths 256,1024 --engines triton --budget 25 --small-fused "$1" \
        >> "$out/tiles.txt" 2>&1; grep -E "^-- |device|triton" "$out/tiles.txt" | tail -12
}
small_run 0
small_run 1024
stamp "triton tiles A/B at L = 16384 (64 keys on 4 warps, then the engine's own)"
tiles_run() {     # tiles_run NAME [gpu_bench options]: appended to $out/tiles.txt
    echo "-- tiles $1" >> "$out/tiles.txt"; shift
    boxed 60 python scripts/gpu_bench.py --lengths 16384 --engines triton --budget 40 "$@" \
        >> "$out/tiles.txt" 2>&1; grep -E "^-- |device|triton" "$out/tiles.txt"
}
tiles_run old --tiles 64,64,32,4
tiles_run new
stamp "done"
