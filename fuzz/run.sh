#!/usr/bin/env bash
# Runs one of the fuzzers for a few seconds from its seed corpus of valid and damaged files.
# usage: fuzz/run.sh path/to/fuzz_safetensors|path/to/fuzz_gguf|path/to/fuzz_request|path/to/fuzz_grammar SECONDS
set -euo pipefail
bin=$1
seconds=${2:-30}
name=$(basename "$bin")
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus"
case $name in
  fuzz_safetensors)
    cp "$here"/seeds/* "$work/corpus/"
    # Real checkpoints' headers make good seeds too (first 4 KiB of each).
    for f in "$here"/../tests/golden/models/*/*.safetensors; do
      head -c 4096 "$f" > "$work/corpus/$(basename "$(dirname "$f")")-$(basename "$f")"
    done
    ;;
  fuzz_gguf) cp "$here"/seeds-gguf/* "$work/corpus/" ;;
  fuzz_request) cp "$here"/seeds-request/* "$work/corpus/" ;;
  fuzz_grammar) cp "$here"/seeds-grammar/* "$work/corpus/" ;;
  *) echo "fuzz/run.sh: unknown fuzzer $name" >&2; exit 2 ;;
esac
"$bin" -max_total_time="$seconds" -max_len=4096 -timeout=5 -print_final_stats=1 "$work/corpus" 2>&1 | tail -n 12
echo "fuzz: ${seconds}s of $name without a crash"
