#!/usr/bin/env bash
# Trains kvlm's bundled model end to end (issue 6), from the repository root:
#
#   bash tools/train/run.sh OUT_DIR [train.py options...]     # e.g. --smoke for a CPU test
#
# Writes OUT_DIR/model (Hugging Face directory), OUT_DIR/eval (evaluation sets),
# OUT_DIR/train_log.json, OUT_DIR/kv_stats.{json,md} and OUT_DIR/run.log.
# The whole run is planned to end within KVLM_TRAIN_TOTAL_S seconds (default 570): training
# stops KVLM_TRAIN_POST_S seconds (default 100) before that, which leaves time to save,
# evaluate and measure K/V statistics. Needs python3 with torch, transformers, tokenizers,
# safetensors, numpy and jinja2; no network.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash tools/train/run.sh OUT_DIR [train.py options]" >&2
  exit 2
fi
OUT=$1
shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
TOTAL=${KVLM_TRAIN_TOTAL_S:-570}
POST=${KVLM_TRAIN_POST_S:-100}
START=$(date +%s)
DEADLINE=$((START + TOTAL - POST))

mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

export TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TRANSFORMERS_VERBOSITY=${TRANSFORMERS_VERBOSITY:-error}
export PYTHONUNBUFFERED=1

KV_ARGS=()
for a in "$@"; do
  [[ "$a" == "--smoke" ]] && KV_ARGS=(--ctx 1024 --max-windows 2)
done

echo "== kvlm tools/train/run.sh: out=$OUT, budget ${TOTAL}s (training ends by +$((TOTAL - POST))s), $(date -u +%FT%TZ)"
"$PYTHON" - <<'EOF'
import importlib, sys
missing = []
for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy", "jinja2"):
    try:
        m = importlib.import_module(name)
        print(f"   {name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # report every missing package at once
        missing.append(f"{name}: {e}")
if missing:
    sys.exit("missing Python packages:\n  " + "\n  ".join(missing))
import torch
print(f"   cuda: {torch.cuda.is_available()}" + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
EOF

status=0
echo "== train ($(($(date +%s) - START))s)"
"$PYTHON" "$HERE/train.py" --out "$OUT" --deadline "$DEADLINE" "$@" || status=$?
if [[ ! -f "$OUT/model/model.safetensors" ]]; then
  echo "ERROR: training failed (exit $status) before saving the model" >&2
  exit 1
fi

echo "== kv stats ($(($(date +%s) - START))s)"
"$PYTHON" "$HERE/kv_stats.py" --model "$OUT/model" --text "$OUT/eval/heldout.txt" --out "$OUT" \
  ${KV_ARGS[@]+"${KV_ARGS[@]}"} || { echo "ERROR: kv_stats.py failed" >&2; status=1; }

echo "== done in $(($(date +%s) - START))s, exit $status"
ls -la "$OUT" "$OUT/model" "$OUT/eval"
exit $status
