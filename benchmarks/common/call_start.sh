# Sourced first by a stored device-call script, run from the repository root with .whl carried
# (`source benchmarks/common/call_start.sh "$@"`): OUT is the script's first argument, made; the carried
# wheels installed and the checkout on PYTHONPATH (gpu_env.sh); the card and the UTC date written under OUT.
OUT=${1:?output folder}
mkdir -p "$OUT"
source benchmarks/common/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
date -u +%FT%TZ > "$OUT/date.txt"
