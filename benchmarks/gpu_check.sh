#!/usr/bin/env bash
# The checks that need a CUDA device, as one call of at most 8 minutes on one GPU (issue 27, item 8):
#   1. CUDA kernels per observed output and per output gradient, and per step for the callback's methods, counted
#      with torch.profiler (kernels the profiler links to the ops launched inside the package's code, plus the
#      CUDA runtime launch calls as a cross-check), on mlp, cnn, transformer and mlp48 (benchmarks/gpu_kernels.py);
#      and the CUDA syncs each step adds under torch.cuda.set_sync_debug_mode("warn") (warnings counted, with the
#      package lines that raised them);
#   2. the memory peak of one plain and one sampled step on issue 27's two models (benchmarks/memory.py --device
#      cuda: torch.cuda.max_memory_allocated over the state before the step, one fresh process per variant);
#   3. the GPU tests (tests/integration/test_callback_gpu.py: syncs per step, constant in depth; the 16-mixed
#      GradScaler) and the scratch bound on the device (tests/integration/test_callback_scratch_memory.py's CUDA test);
#   4. the overhead benchmark at 16-mixed and bf16-mixed (mlp, transformer, cnn, mlp48).
# Each section has its own time limit (seconds: 10 + 100 + 130 + 70 + 2 x 80 = 470), so one that hangs cannot take
# the others' time; a section cut short says so in its .txt file and in timing.txt.
# --dry-run: every section on the CPU with tiny models (gpu_kernels.py --dry-run: aten ops and host reads in place
# of kernels and syncs; memory.py --quick; overhead.py --quick), to check the script where there is no GPU.
# Results go to $OUT (default /tmp/gpu_check). Uses $PYTHON (default: python) with torch, lightning and this
# package installed (pip install -e ".[dev]"), or run from the repository root with the package on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
dry=0
scale=1
[ "${1:-}" = "--dry-run" ] && dry=1
if [ $dry = 1 ]; then
    scale=4  # a small CPU runs the tiny models slower than an H200 host runs the real ones
    kernels_args=(--dry-run --quick --models mlp,mlp48 --steps 2)
    memory_args=(--device cpu --quick --models lm_head --repeats 1)
    overhead_args=(--accelerator cpu --quick --rounds 1 --steps 4 --period-steps 50 --models mlp)
else
    kernels_args=(--models mlp,cnn,transformer,mlp48 --steps 4)
    memory_args=(--device cuda --repeats 1)  # max_memory_allocated does not move between processes as RSS does
    overhead_args=(--accelerator gpu --rounds 2 --steps 20 --models mlp,transformer,cnn,mlp48)
fi

section() {  # section NAME LIMIT COMMAND...: run COMMAND with a time limit, output to $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    limit=$((limit * scale))
    timeout -k 5 "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "*** cut short after ${limit} s" >>"$out/$name.txt"
    echo "$name: exit $rc, $((SECONDS - t0)) s (total $((SECONDS - start)) s)" | tee -a "$out/timing.txt"
    tail -25 "$out/$name.txt"
}

section device 10 "$py" -c "import torch; print(torch.__version__, torch.version.cuda,
    torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
section kernels 100 "$py" benchmarks/gpu_kernels.py "${kernels_args[@]}" --json "$out/kernels.json"
section memory 130 "$py" benchmarks/memory.py "${memory_args[@]}" --json "$out/memory.json"
section tests 70 "$py" -m pytest tests/integration/test_callback_gpu.py \
    tests/integration/test_callback_scratch_memory.py -k "not cpu" -s -rs -q -p no:cacheprovider
for precision in 16-mixed bf16-mixed; do
    section "overhead_$precision" 80 "$py" benchmarks/overhead.py --precision "$precision" \
        "${overhead_args[@]}" --variants plain,every_step,default_interval,tutorial,tutorial_stats --json "$out/overhead_$precision.json"
done
echo "gpu_check: $((SECONDS - start)) s in all; results in $out" | tee -a "$out/timing.txt"
