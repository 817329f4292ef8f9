#!/usr/bin/env bash
# The checks that need a CUDA device, prepared as one short run for a machine that has one:
#   1. the aten op counts per step, per hooked output and gradient, for parameters and the sentinel, on the GPU
#      (overhead.py --count-ops: each op that is not a view, detach or allocation is at least one kernel launch);
#   2. the GPU tests, which print the CUDA syncs per step under torch.cuda.set_sync_debug_mode (constant in depth;
#      one per step for the sentinel), the 16-mixed GradScaler test and Lightning's FSDP strategy;
#   3. the overhead benchmark on the GPU in fp32 and in 16-mixed (the three standard models, mlp48 and gpt2).
# About 8 minutes on one GPU.
# Results go to $OUT (default /tmp/gpu_check). Uses $PYTHON (default: python) with torch, lightning and this
# package installed (pip install -e ".[dev]").
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
"$py" benchmarks/overhead.py --count-ops --accelerator gpu --models mlp,cnn,transformer,mlp48 \
    --json "$out/op_counts.json" 2>&1 | tee "$out/op_counts.txt"
"$py" -m pytest tests/test_gpu.py -s tests/test_fsdp.py::test_lightning_fsdp_strategy_logs_unsharded_values -rs -q -p no:cacheprovider 2>&1 | tee "$out/tests.txt"
for precision in 32-true 16-mixed; do
    "$py" benchmarks/overhead.py --accelerator gpu --precision "$precision" --rounds 3 --steps 20 \
        --models mlp,transformer,cnn,mlp48,gpt2 --variants plain,every_step,default_interval,tutorial,tutorial_stats \
        --json "$out/overhead_$precision.json" 2>&1 | tail -20 | tee "$out/overhead_$precision.txt"
done
