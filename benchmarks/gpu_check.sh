#!/usr/bin/env bash
# The checks that need a CUDA device, prepared as one short run for a machine that has one:
#   1. the GPU tests: CUDA syncs per sampled step under torch.cuda.set_sync_debug_mode (constant in depth), the
#      16-mixed GradScaler test, Lightning's FSDP strategy;
#   2. the overhead benchmark on the GPU in fp32 and in 16-mixed.
# Results go to $OUT (default /tmp/gpu_check). Uses $PYTHON (default: python) with torch, lightning and this
# package installed (pip install -e ".[dev]").
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
"$py" -c "import torch; print(torch.__version__, torch.cuda.get_device_name())" | tee "$out/device.txt"
"$py" -m pytest tests/test_gpu.py tests/test_fsdp.py::test_lightning_fsdp_strategy_logs_unsharded_values -rs -q -p no:cacheprovider 2>&1 | tee "$out/tests.txt"
for precision in 32-true 16-mixed; do
    "$py" benchmarks/overhead.py --accelerator gpu --precision "$precision" --rounds 3 --steps 20 \
        --json "$out/overhead_$precision.json" 2>&1 | tail -20 | tee "$out/overhead_$precision.txt"
done
