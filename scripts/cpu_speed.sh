#!/usr/bin/env bash
# The CPU comparison of docs/results/cpu.md in one command: decode ms/token and prompt tokens/s of h2o-chat's
# default weights (the embedded GGUF's own 4-bit values) and of float32 weights, each run with llama.cpp on the
# same GGUF as a row of the same run; start-up (cold and warm) and resident memory. Needs llama-cpp-python
# (see h2o_chat/measure/llamacpp.py for the build flags). ~30 min on a 2-core machine; keep the machine quiet.
#   scripts/cpu_speed.sh [OUT_DIR]        (default docs/results/cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/cpu}
mkdir -p "$out"
threads=${THREADS:-2}
{
  echo "date: $(date -u +%F)"
  echo "cpu: $(lscpu | sed -n 's/^Model name:[[:space:]]*//p'), $(nproc) cores; threads $threads"
  python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'
} | tee "$out/machine.txt"

echo "== decode, 4-bit weights (the default): the compiled and the eager step" >&2
h2o-chat bench --threads "$threads" --lengths 512,2048,4096,8192 --budget 512 \
  --configs h2o,h2o-compiled,llama.cpp | tee "$out/decode-compiled.txt"
for weights in 4bit none; do
  echo "== decode, --quantize $weights" >&2
  h2o-chat bench --quantize "$weights" --threads "$threads" --lengths 512,2048,4096,8192 --budget 512 \
    --configs dynamic,h2o,llama.cpp | tee "$out/decode-$weights.txt"
  echo "== prefill 4096, --quantize $weights" >&2
  h2o-chat bench --prefill --quantize "$weights" --threads "$threads" --lengths 4096 --budget 512 \
    --configs transformers-chunked,h2o,snap,llama.cpp | tee "$out/prefill-$weights.txt"
done

echo "== start-up and resident memory" >&2
for weights in 4bit none; do
  cold=$(mktemp -d)
  for run in cold warm; do
    start=$EPOCHREALTIME
    echo "Say hi." | H2O_CHAT_CACHE=$cold h2o-chat --quantize "$weights" --max-new-tokens 1 --threads "$threads" \
      >/dev/null 2>&1
    echo "$weights $run: $(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $start }") s to a 1-token reply"
  done
  rm -rf "$cold"
  python - "$weights" <<'EOF'
import sys, psutil
from h2o_chat.models.loading import load
from h2o_chat.models.registry import load_registry
before = psutil.Process().memory_info().rss
loaded = load(load_registry().resolve(None), device="cpu", quantize=sys.argv[1])
rss = psutil.Process().memory_info().rss
print(f"{sys.argv[1]}: resident {rss / 2**20:.0f} MB after loading (weights {loaded.weight_bytes / 2**20:.0f} MB "
      f"as held; {before / 2**20:.0f} MB before)")
EOF
done | tee "$out/startup.txt"
