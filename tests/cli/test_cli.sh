#!/usr/bin/env bash
# End-to-end tests of the kvlm binary as a user runs it: output shapes, determinism, and a
# clear error (exit code 1 or 2, a message, no signal) for every kind of bad input.
# usage: KVLM=path/to/kvlm bash tests/cli/test_cli.sh
set -uo pipefail
KVLM=${KVLM:?set KVLM to the kvlm binary}
here=$(cd "$(dirname "$0")" && pwd)
golden="$here/../golden/models"
stories="$here/../../models/stories260K"  # trained, no tokenizer, vocab 512, 5 layers, context 512
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_error CODE NEEDLE -- ARGS...: exit code CODE and NEEDLE on stderr.
expect_error() {
  local code=$1 needle=$2
  shift 3
  "$KVLM" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  if [ "$rc" -ne "$code" ]; then bad "kvlm $* exited $rc, expected $code; stderr: $(cat "$tmp/err")"; return; fi
  if ! grep -qF -- "$needle" "$tmp/err"; then bad "kvlm $*: stderr lacks '$needle': $(cat "$tmp/err")"; return; fi
  ok
}

json_get() { python3 -c "import json,sys; d=json.load(open('$1')); print($2)"; }

# --- help and version ---------------------------------------------------------------------
"$KVLM" --help >"$tmp/out" 2>&1 && grep -q generate "$tmp/out" && grep -q inspect "$tmp/out" && ok || bad "--help"
"$KVLM" generate --help >"$tmp/out" 2>&1 && grep -q -- "--kv-cache-dtype" "$tmp/out" && ok || bad "generate --help"
"$KVLM" --version >/dev/null 2>&1 && ok || bad "--version"

# --- generate: JSON shape, greedy determinism, seeds, logprobs ----------------------------
ids=1,403,407,261,378,324,434,412,281,266,397,261
if "$KVLM" generate --prompt-ids $ids --max-tokens 16 --temperature 0 --ignore-eos --kv-cache-dtype fp8 --json \
  --logprobs 3 >"$tmp/a.json" 2>"$tmp/err"; then
  [ "$(json_get "$tmp/a.json" "len(d['token_ids'])")" = 16 ] && ok || bad "16 tokens expected"
  [ "$(json_get "$tmp/a.json" "d['prompt_token_ids'][:3]")" = "[1, 403, 407]" ] && ok || bad "prompt_token_ids"
  [ "$(json_get "$tmp/a.json" "len(d['logprobs'])")" = 16 ] && ok || bad "one logprobs entry per token"
  [ "$(json_get "$tmp/a.json" "all(len(e['top_logprobs'])==3 and e['top_logprobs'][0]['logprob']>=e['top_logprobs'][1]['logprob'] for e in d['logprobs'])")" = True ] && ok || bad "top-3 logprobs sorted"
  [ "$(json_get "$tmp/a.json" "all(e['token_id']==e['top_logprobs'][0]['token_id'] for e in d['logprobs'])")" = True ] && ok || bad "greedy token is the top-1"
  grep -q "store FP8 per-tensor KV without checkpoint scales" "$tmp/err" && ok || bad "missing-scale warning"
  [ "$(grep -c "without checkpoint scales" "$tmp/err")" = 1 ] && ok || bad "the missing-scale warning is printed once"
else
  bad "generate --json failed: $(cat "$tmp/err")"
fi
"$KVLM" generate --prompt-ids $ids --max-tokens 16 --temperature 0 --ignore-eos --kv-cache-dtype fp8 --json -q >"$tmp/b.json"
[ "$(json_get "$tmp/a.json" "d['token_ids']")" = "$(json_get "$tmp/b.json" "d['token_ids']")" ] && ok || bad "greedy is deterministic"
"$KVLM" generate --prompt-ids $ids --max-tokens 24 --temperature 1.0 --top-p 0.9 --seed 7 --json >"$tmp/s1.json"
"$KVLM" generate --prompt-ids $ids --max-tokens 24 --temperature 1.0 --top-p 0.9 --seed 7 --json >"$tmp/s2.json"
"$KVLM" generate --prompt-ids $ids --max-tokens 24 --temperature 1.0 --top-p 0.9 --seed 8 --json >"$tmp/s3.json"
[ "$(json_get "$tmp/s1.json" "d['token_ids']")" = "$(json_get "$tmp/s2.json" "d['token_ids']")" ] && ok || bad "same seed, same tokens"
[ "$(json_get "$tmp/s1.json" "d['token_ids']")" != "$(json_get "$tmp/s3.json" "d['token_ids']")" ] && ok || bad "another seed, other tokens"
"$KVLM" generate --model "$stories" --prompt-ids $ids --max-tokens 4 --temperature 0 >"$tmp/out" 2>&1 && grep -q "^generated" "$tmp/out" && ok || bad "readable summary"
for dt in auto float16 bfloat16 fp8 fp8_e4m3 fp8_e5m2 fp8_per_token_head int8_per_token_head int4_per_token_head; do
  "$KVLM" generate --prompt-ids $ids --max-tokens 4 --temperature 0 --kv-cache-dtype $dt --json -q >/dev/null && ok || bad "generate --kv-cache-dtype $dt"
done
# Every golden architecture runs from the CLI, including sharded and sliding-window models.
for m in "$golden"/*/; do
  "$KVLM" generate --model "$m" --prompt-ids 1,5,9,13 --max-tokens 8 --temperature 0 --ignore-eos --json -q >/dev/null \
    && ok || bad "generate --model $m"
done

# --- inspect -----------------------------------------------------------------------------
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window >"$tmp/out" 2>&1 \
  && grep -q "sliding(8)  bfloat16" "$tmp/out" && grep -q "full        fp8_e4m3" "$tmp/out" && grep -q "total KV bytes per token: 768" "$tmp/out" \
  && ok || bad "inspect mixed table: $(cat "$tmp/out")"
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype int8_per_token_head --json >"$tmp/i.json" \
  && [ "$(json_get "$tmp/i.json" "[l['scale_source'] for l in d['layers']][0]")" = "per-token-head dynamic" ] \
  && [ "$(json_get "$tmp/i.json" "d['kv_bytes_per_token']")" = 576 ] && ok || bad "inspect --json"
# int4: 2 kv heads of 32 -> 16 bytes of codes + a 4-byte slot per head, K and V, 4 layers; rotated by default.
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype int4_per_token_head --json >"$tmp/i4.json" \
  && [ "$(json_get "$tmp/i4.json" "d['kv_bytes_per_token']")" = 320 ] \
  && [ "$(json_get "$tmp/i4.json" "sorted(set(l['rotation'] for l in d['layers']))")" = "['hadamard']" ] && ok || bad "inspect int4 --json"
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype int4_per_token_head --kv-cache-rotation none >"$tmp/out" 2>&1 \
  && grep -q "int4      int4_per_token_head  explicit    per-token-head dynamic, zero point  none" "$tmp/out" && ok || bad "inspect int4 unrotated: $(cat "$tmp/out")"
# Parameters: every golden model's count is transformers' own (num_params in its expected/
# json); the mixtures of experts also say what one token reads and, per layer, their experts.
for m in "$golden"/*/; do
  name=$(basename "$m")
  "$KVLM" inspect --model "$m" --json >"$tmp/p.json" 2>/dev/null \
    && [ "$(json_get "$tmp/p.json" "d['parameters']")" = "$(json_get "$here/../golden/expected/$name.json" "d['num_params']")" ] \
    && ok || bad "inspect parameters of $name"
done
"$KVLM" inspect --model "$golden/qwen3-moe" --json >"$tmp/moe.json" \
  && [ "$(json_get "$tmp/moe.json" "d['parameters_per_token']")" = 147008 ] \
  && [ "$(json_get "$tmp/moe.json" "[l['mlp']['kind'] for l in d['layers']]")" = "['dense', 'experts', 'experts']" ] \
  && [ "$(json_get "$tmp/moe.json" "d['layers'][1]['mlp']['experts'], d['layers'][1]['mlp']['top_k']")" = "7 3" ] \
  && ok || bad "inspect qwen3-moe --json: $(cat "$tmp/moe.json")"
"$KVLM" inspect --model "$golden/gpt-oss" >"$tmp/out" 2>&1 \
  && grep -q "210K parameters, 118K read per token (2 of 5 experts)" "$tmp/out" \
  && grep -q "sliding(8)+sinks" "$tmp/out" && grep -q "full+sinks" "$tmp/out" \
  && grep -q "5 experts x 32, top 2 (12.9K of 31.7K per token)" "$tmp/out" && ok || bad "inspect gpt-oss: $(cat "$tmp/out")"
"$KVLM" generate --prompt-ids $ids --max-tokens 4 --temperature 0 --kv-cache-dtype int8_per_token_head --kv-cache-rotation hadamard --json -q >/dev/null \
  && ok || bad "generate int8 rotated"
# Exact sink / recent tokens: per layer in the plan, with the bytes of one exact token (bf16:
# 2 heads x 32 x 2 bytes, K and V = 256), and in generate's summary line.
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype int4_per_token_head --kv-cache-keep-sink 4 --kv-cache-keep-recent 64 --json >"$tmp/ik.json" \
  && [ "$(json_get "$tmp/ik.json" "sorted(set((l['keep_sink'], l['keep_recent'], l['exact_bytes_per_token']) for l in d['layers']))")" = "[(4, 64, 256)]" ] \
  && [ "$(json_get "$tmp/ik.json" "d['exact_bytes_per_token'], d['kv_bytes_per_token']")" = "1024 320" ] && ok || bad "inspect exact tokens --json"
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 0 --kv-cache-keep-recent 16 >"$tmp/out" 2>&1 \
  && grep -q "skip rule .* none      none " "$tmp/out" && grep -q "sink 0 + recent 16, bfloat16 256 B/token" "$tmp/out" && ok || bad "inspect exact tokens: $(cat "$tmp/out")"
"$KVLM" generate --prompt-ids $ids --max-tokens 6 --temperature 0 --kv-cache-dtype int4_per_token_head --kv-cache-keep-sink 4 --kv-cache-keep-recent 8 >/dev/null 2>"$tmp/err" \
  && grep -q "exact sink 4 + recent 8" "$tmp/err" && ok || bad "generate exact tokens: $(cat "$tmp/err")"
"$KVLM" inspect --kv-cache-keep-sink 4 >"$tmp/out" 2>&1 && grep -q "have no effect: no layer's KV cache is quantized" "$tmp/out" \
  && ok || bad "exact tokens without a quantized layer warn: $(cat "$tmp/out")"
# K and V apart (qwen3-mixed: 4 layers, 2 KV heads of 32): K bfloat16 128 B + V int4 2 x (16 + 4)
# = 168 B per layer and token; the table shows both sides, generate's summary line too.
"$KVLM" inspect --model "$golden/qwen3-mixed" --cache-type-k bfloat16 --cache-type-v int4_per_token_head --json >"$tmp/kv.json" \
  && [ "$(json_get "$tmp/kv.json" "d['kv_bytes_per_token'], d['layers'][0]['kv_dtype'], d['layers'][0]['v_dtype']")" = "672 bfloat16 int4" ] \
  && ok || bad "inspect K/V apart --json: $(cat "$tmp/kv.json")"
"$KVLM" inspect --model "$golden/qwen3-mixed" --kv-cache-dtype k=int8_per_token_head,v=int4_per_token_head >"$tmp/out" 2>&1 \
  && grep -q "k:int8 v:int4  k:int8_per_token_head v:int4_per_token_head" "$tmp/out" \
  && grep -q -- "-> K int8 / int8_per_token_head (explicit), V int4 / int4_per_token_head (explicit)" "$tmp/out" \
  && ok || bad "inspect K/V apart: $(cat "$tmp/out")"
"$KVLM" generate --prompt-ids $ids --max-tokens 6 --temperature 0 --kv-cache-dtype k=int8_per_token_head,v=int4_per_token_head >/dev/null 2>"$tmp/err" \
  && grep -q "KV K int8 int8_per_token_head, V int4 int4_per_token_head (1456 B/token" "$tmp/err" && ok || bad "generate K/V apart: $(cat "$tmp/err")"

# --- text: tokenizer, chat template, streaming, stop strings, chat -------------------------
chat="$here/../models/tiny-chat"
"$KVLM" tokenize --tokenizer "$chat" --text "Hello world, 123" --json >"$tmp/t.json" \
  && "$KVLM" detokenize --tokenizer "$chat" --ids "$(json_get "$tmp/t.json" "','.join(map(str, d['ids']))")" >"$tmp/d.txt" \
  && [ "$(cat "$tmp/d.txt")" = "Hello world, 123" ] && ok || bad "tokenize/detokenize round trip"
"$KVLM" tokenize --tokenizer "$chat" --text "<|im_start|>user" --json >"$tmp/t2.json" \
  && [ "$(json_get "$tmp/t2.json" "d['ids'][0]")" = 1 ] && ok || bad "special tokens in text"
printf '[{"role": "user", "content": "hi"}]' >"$tmp/msgs.json"
"$KVLM" render-template --tokenizer "$chat" --messages "$tmp/msgs.json" --add-generation-prompt >"$tmp/r.txt" \
  && grep -q "<|im_start|>user" "$tmp/r.txt" && tail -c 23 "$tmp/r.txt" | grep -q "<|im_start|>assistant" && ok || bad "render-template"
"$KVLM" generate --model "$chat" --prompt "Once upon a time" --max-tokens 12 --temperature 0 --ignore-eos >"$tmp/g.txt" 2>"$tmp/err" \
  && [ -s "$tmp/g.txt" ] && grep -q "prompt tokens, 12 generated" "$tmp/err" && ok || bad "generate --prompt: $(cat "$tmp/err")"
"$KVLM" generate --model "$chat" --prompt "Once upon a time" --max-tokens 12 --temperature 0 --ignore-eos --json >"$tmp/g.json" \
  && [ "$(json_get "$tmp/g.json" "d['text']")" = "$(cat "$tmp/g.txt")" ] && ok || bad "streamed text equals the JSON text"
stop=$(json_get "$tmp/g.json" "d['text'][3:6]")
if [ -n "$stop" ]; then
  "$KVLM" generate --model "$chat" --prompt "Once upon a time" --max-tokens 12 --temperature 0 --ignore-eos --stop "$stop" --json >"$tmp/s.json" \
    && [ "$(json_get "$tmp/s.json" "d['finish_reason'], d['text'] == '''$(json_get "$tmp/g.json" "d['text']")'''[:3]")" = "stop True" ] \
    && ok || bad "--stop ends before the stop string: $(cat "$tmp/s.json")"
fi
"$KVLM" generate --model "$chat" --prompt "hi" --chat --max-tokens 6 --temperature 0.7 --seed 3 --min-p 0.05 \
  --repetition-penalty 1.2 --presence-penalty 0.5 --frequency-penalty 0.5 --json >"$tmp/c.json" \
  && [ "$(json_get "$tmp/c.json" "d['prompt_token_ids'][0]")" = 1 ] && ok || bad "generate --chat with every sampling flag"
printf 'hello\n/reset\nhi again\n/exit\n' | "$KVLM" chat --model "$chat" --max-tokens 5 --temperature 0 >"$tmp/chat.txt" 2>"$tmp/err" \
  && grep -q "(conversation cleared)" "$tmp/chat.txt" && [ "$(grep -c "prompt tokens" "$tmp/err")" = 2 ] && ok || bad "chat session: $(cat "$tmp/err")"
expect_error 1 "has no tokenizer.json" -- generate --model "$stories" --prompt "hello"
expect_error 1 "has no tokenizer.json" -- chat --model "$golden/qwen3-mixed"
# chat has no --prompt-ids: its message points at generate, which does.
"$KVLM" chat --model "$golden/qwen3-mixed" </dev/null >/dev/null 2>"$tmp/err"
grep -q "kvlm generate --prompt-ids" "$tmp/err" && ok || bad "chat on a model without a tokenizer: $(cat "$tmp/err")"
# MODEL is positional on every command that loads one (as `vllm serve MODEL`); with --model
# too, they must agree.
"$KVLM" generate "$chat" --prompt "Once upon a time" --max-tokens 4 --temperature 0 --ignore-eos --json >"$tmp/pos.json" 2>/dev/null \
  && [ "$(json_get "$tmp/pos.json" "d['usage']['completion_tokens']")" = 4 ] && ok || bad "generate MODEL"
"$KVLM" inspect "$chat" >"$tmp/pos.txt" 2>&1 && grep -q "tiny-chat" "$tmp/pos.txt" && ok || bad "inspect MODEL: $(cat "$tmp/pos.txt")"
printf '/exit\n' | "$KVLM" chat "$chat" --max-tokens 2 >/dev/null 2>"$tmp/err" && ok || bad "chat MODEL: $(cat "$tmp/err")"
"$KVLM" eval perplexity "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 1 --json "$tmp/ppl.json" >/dev/null 2>"$tmp/err" && ok \
  || bad "eval perplexity MODEL: $(cat "$tmp/err")"
# --decode-steps scores the same tokens one step each: the same perplexity up to fp32 order.
"$KVLM" eval perplexity "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 1 --decode-steps \
  --json "$tmp/ppl-decode.json" >"$tmp/ppl-decode.txt" 2>"$tmp/err" && grep -q "one per step" "$tmp/ppl-decode.txt" \
  && python3 -c "import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); sys.exit(not (b['decode_steps'] and abs(a['ppl']-b['ppl']) <= 1e-3*a['ppl']))" \
     "$tmp/ppl.json" "$tmp/ppl-decode.json" && ok || bad "eval perplexity --decode-steps: $(cat "$tmp/err" "$tmp/ppl-decode.txt")"
"$KVLM" bench throughput "$chat" --num-prompts 2 --input-len 8 --output-len 4 >/dev/null 2>"$tmp/err" && ok \
  || bad "bench throughput MODEL: $(cat "$tmp/err")"
expect_error 1 "two models given" -- generate "$chat" --model "$golden/qwen3-mixed" --prompt-ids 1
# The prefix cache's host tier: planned in whole pages and said at startup; refused where it
# cannot work, before anything runs.
"$KVLM" bench throughput "$chat" --num-prompts 2 --input-len 8 --output-len 4 --kv-offload-gib 0.01 >/dev/null 2>"$tmp/err" \
  && grep -q "host tier (--kv-offload-gib): .* pages = .* tokens" "$tmp/err" && ok || bad "bench --kv-offload-gib: $(cat "$tmp/err")"
expect_error 1 "--kv-offload-gib keeps the pages the prefix cache evicts: it needs prefix caching" -- \
  bench throughput "$chat" --num-prompts 1 --kv-offload-gib 0.01 --no-enable-prefix-caching
expect_error 1 "of host memory available; give it less" -- bench throughput "$chat" --num-prompts 1 --kv-offload-gib 900000
expect_error 2 "--kv-offload-gib: Value -1 not in range" -- bench throughput "$chat" --num-prompts 1 --kv-offload-gib -1
# bench multiturn: conversations whose histories outgrow a small pool; with the tier, later
# turns find their prefixes in host memory (tokens counted in the JSON), without it they cannot.
"$KVLM" bench multiturn "$stories" --conversations 8 --turns 3 --system-len 64 --user-len 16 --output-len 8 \
    --kv-cache-memory 400KiB --max-model-len 256 --kv-offload-gib 0.01 --json "$tmp/mt.json" >"$tmp/mt.out" 2>"$tmp/err" \
  && grep -q "Time to First Token, later turns" "$tmp/mt.out" \
  && python3 -c "import json; d=json.load(open('$tmp/mt.json')); h=d['host_tier']; assert d['failed_requests'] == 0 and h['hit_tokens'] > 0 and h['restored_pages'] > 0 and d['ttft_later_turns']['count'] == 16, d" \
  && ok || bad "bench multiturn: $(cat "$tmp/mt.out" "$tmp/err")"
expect_error 1 "the last turn's conversation holds 1536 tokens" -- bench multiturn "$stories" --turns 4 --max-model-len 512
# Exact sink / recent tokens: the tier keeps the exact copies hits read beside the pages, and
# the startup line says how much of --kv-offload-gib they take.
"$KVLM" bench multiturn "$stories" --conversations 8 --turns 3 --system-len 64 --user-len 16 --output-len 8 \
    --kv-cache-memory 600KiB --max-model-len 256 --kv-offload-gib 0.01 --kv-cache-dtype int4_per_token_head \
    --kv-cache-keep-sink 4 --kv-cache-keep-recent 16 --max-num-seqs 4 --max-num-batched-tokens 128 \
    --json "$tmp/mtx.json" >"$tmp/mt.out" 2>"$tmp/err" \
  && grep -q "host tier (--kv-offload-gib): .*; exact sink/recent tokens: .* exact pages" "$tmp/err" \
  && python3 -c "import json; d=json.load(open('$tmp/mtx.json')); h=d['host_tier']; assert d['failed_requests'] == 0 and h['exact_capacity_pages'] > 0 and h['exact_restored_pages'] > 0 and h['restored_pages'] > 0, d" \
  && ok || bad "bench multiturn with exact tokens and a host tier: $(cat "$tmp/mt.out" "$tmp/err")"
# The same under tensor parallelism: each rank copies its heads' part of every page.
"$KVLM" bench multiturn "$stories" --tensor-parallel-size 2 --conversations 8 --turns 3 --system-len 64 --user-len 16 \
    --output-len 8 --kv-cache-memory 200KiB --max-model-len 256 --kv-offload-gib 0.01 --json "$tmp/mt2.json" \
    >"$tmp/mt.out" 2>"$tmp/err" \
  && python3 -c "import json; d=json.load(open('$tmp/mt2.json')); h=d['host_tier']; assert d['failed_requests'] == 0 and h['restored_pages'] > 0, d" \
  && ok || bad "bench multiturn --tensor-parallel-size 2: $(cat "$tmp/mt.out" "$tmp/err")"
# The disk tier: a second process on the same model and directory reads back the pages the
# first left there (written when it stopped); flags that cannot work are refused first.
for run in 1 2; do
  "$KVLM" bench multiturn "$stories" --conversations 4 --turns 2 --system-len 64 --user-len 16 --output-len 8 \
      --kv-cache-memory 400KiB --max-model-len 256 --kv-offload-gib 0.002 --kv-offload-dir "$tmp/kvdisk" \
      --kv-offload-disk-gib 0.05 --json "$tmp/disk$run.json" >"$tmp/disk.out" 2>"$tmp/err" \
    && grep -q "Disk tier (--kv-offload-dir)" "$tmp/disk.out" || bad "bench multiturn --kv-offload-dir: $(cat "$tmp/err")"
done
python3 -c "
import json
a, b = (json.load(open('$tmp/disk%d.json' % i)) for i in (1, 2))
assert a['disk_tier']['read_pages'] == 0 and b['disk_tier']['read_pages'] > 0, (a['disk_tier'], b['disk_tier'])
assert b['disk_tier']['damaged_files'] == 0 and b['cached_input_tokens'] > a['cached_input_tokens'], (a, b)
" && ok || bad "the disk tier's pages were not found after a restart: $(cat "$tmp/disk.out")"
expect_error 1 "--kv-offload-dir needs --kv-offload-disk-gib" -- \
  bench throughput "$chat" --num-prompts 1 --kv-offload-gib 0.01 --kv-offload-dir "$tmp/kvdisk"
expect_error 1 "--kv-offload-disk-gib sizes the disk tier of --kv-offload-dir: give the directory too" -- \
  bench throughput "$chat" --num-prompts 1 --kv-offload-gib 0.01 --kv-offload-disk-gib 1
expect_error 1 "pages reach the disk tier through the host tier; give --kv-offload-gib too" -- \
  bench throughput "$chat" --num-prompts 1 --kv-offload-dir "$tmp/kvdisk" --kv-offload-disk-gib 1
expect_error 1 "--kv-offload-dir: cannot create" -- bench throughput "$chat" --num-prompts 1 --kv-offload-gib 0.01 \
  --kv-offload-dir "$tmp/disk1.json/sub" --kv-offload-disk-gib 1
# Flags checked before anything loads.
expect_error 1 "--scheduling-policy must be fcfs or priority" -- serve "$chat" --scheduling-policy lottery --port 0
expect_error 1 "--runner must be auto, generate or pooling" -- generate "$chat" --runner embed --prompt-ids 1
expect_error 1 "embedding model (--runner pooling)" -- generate "$golden/../embed/model" --prompt-ids 1,2
"$KVLM" generate --help >"$tmp/help" 2>&1; grep -q "^  MODEL" "$tmp/help" && ok || bad "generate's help shows MODEL"
mkdir -p "$tmp/nochat" && cp "$chat"/config.json "$chat"/model.safetensors "$chat"/tokenizer.json "$tmp/nochat/"
expect_error 1 "no chat template" -- chat --model "$tmp/nochat"
expect_error 1 "no tokenizer.json" -- tokenize --tokenizer "$tmp" --text x
expect_error 1 "--min-p must be in [0, 1]" -- generate --prompt-ids 1 --min-p 2
expect_error 2 "excludes" -- generate --prompt x --prompt-ids 1

# --- bad input: clear errors, never a crash ----------------------------------------------
expect_error 1 "valid values are: auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, fp8_per_token_head, int8_per_token_head" -- \
  generate --prompt-ids 1,2 --kv-cache-dtype fp8_e6m1
expect_error 1 "layer 9 but the model has 5 layers" -- inspect --model "$stories" --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 9
expect_error 1 "invalid --kv-cache-rotation 'walsh'; valid values are: auto" -- inspect --kv-cache-rotation walsh
expect_error 1 "invalid --kv-cache-keep-recent -3; give a token count between 0 and 65536" -- inspect --kv-cache-keep-recent -3
expect_error 1 "invalid --kv-cache-keep-sink 100000" -- generate --prompt-ids 1 --kv-cache-dtype int4_per_token_head --kv-cache-keep-sink 100000
expect_error 1 "invalid --kv-cache-dtype-skip-layers entry 'full'" -- inspect --kv-cache-dtype-skip-layers full
# K and V apart: the k=,v= form and llama.cpp's --cache-type-k / --cache-type-v, with errors that
# name the form and the valid values.
expect_error 1 "invalid --kv-cache-dtype entry 'x=fp8'; write --kv-cache-dtype k=DTYPE,v=DTYPE" -- inspect --kv-cache-dtype k=fp8,x=fp8
expect_error 1 "--kv-cache-dtype sets v twice" -- inspect --kv-cache-dtype v=fp8,v=int8_per_token_head
expect_error 1 "invalid --kv-cache-dtype v= 'int3'; valid values are: auto" -- inspect --kv-cache-dtype k=fp8,v=int3
expect_error 1 "invalid --cache-type-v 'q4_0'; valid values are: auto" -- inspect --cache-type-v q4_0
expect_error 1 "give them or --kv-cache-dtype (which takes k=A,v=B too), not both" -- inspect --kv-cache-dtype fp8 --cache-type-k fp8
# Plan files: malformed ones, and entries that do not fit the model, name the file and the entry.
echo '{"kvlm_kv_plan": 1, "layers": [{"layer": 9, "k": "fp8"}]}' >"$tmp/p9.json"
expect_error 1 "names layer 9, but the target model has layers 0..4" -- inspect --model "$stories" --kv-cache-plan "$tmp/p9.json"
echo '{"kvlm_kv_plan": 1, "layers": [{"layer": 1, "k": "int3"}]}' >"$tmp/pbad.json"
expect_error 1 "pbad.json: layers[0] \"k\": invalid dtype 'int3'; valid values are: auto" -- inspect --kv-cache-plan "$tmp/pbad.json"
echo '{"kvlm_kv_plan": 1, "layers": [{"layer": 1, "k": "fp8"' >"$tmp/ptrunc.json"
expect_error 1 "is not valid JSON" -- generate --prompt-ids 1 --kv-cache-plan "$tmp/ptrunc.json"
expect_error 1 "cannot read KV plan file $tmp/none.json" -- generate --prompt-ids 1 --kv-cache-plan "$tmp/none.json"
echo '{"kvlm_kv_plan": 1, "layers": [{"model": "draft", "layer": 0, "k": "fp8"}]}' >"$tmp/pdraft.json"
expect_error 1 "names draft layer 0, but no DFlash drafter is loaded" -- inspect --kv-cache-plan "$tmp/pdraft.json"
echo '{"kvlm_kv_plan": 1, "layers": [{"layer": 0, "k": "bfloat16", "rotation": "hadamard"}]}' >"$tmp/prot.json"
expect_error 1 "layer 0 asks for a Hadamard rotation of K, which is held in bfloat16" -- inspect --kv-cache-dtype int8_per_token_head --kv-cache-plan "$tmp/prot.json"
# inspect --write-kv-plan writes the resolved plan; fed back alone it resolves to the same
# formats and bytes, every side from the plan file.
"$KVLM" inspect --model "$stories" --dtype bfloat16 --kv-cache-dtype k=int8_per_token_head,v=int4_per_token_head \
  --kv-cache-dtype-skip-layers 0 --write-kv-plan "$tmp/w.json" --json >"$tmp/w1.json" 2>/dev/null \
  && "$KVLM" inspect --model "$stories" --dtype bfloat16 --kv-cache-plan "$tmp/w.json" --json >"$tmp/w2.json" \
  && [ "$(json_get "$tmp/w1.json" "d['kv_bytes_per_token'], [(l['kv_dtype'], l.get('v_dtype'), l['rotation']) for l in d['layers']]")" = \
       "$(json_get "$tmp/w2.json" "d['kv_bytes_per_token'], [(l['kv_dtype'], l.get('v_dtype'), l['rotation']) for l in d['layers']]")" ] \
  && [ "$(json_get "$tmp/w2.json" "sorted(set(l['dtype_source'] for l in d['layers']))")" = "['plan file']" ] \
  && ok || bad "inspect --write-kv-plan round trip: $(cat "$tmp/w.json")"
# kvlm calibrate --kld-budget on the bundled model: it measures, prints the candidates, writes a
# plan that loads, checked on 2 windows the search did not use (--check-windows' default) and
# within the budget there.
tiny="$here/../../models/kvlm-tiny"
"$KVLM" calibrate --model "$tiny" --kld-budget 1e-3 --ctx 128 --windows 2 --text "$tiny/eval/heldout.txt" \
    --out "$tmp/cal.json" >"$tmp/cal.out" 2>"$tmp/cal.err" \
  && grep -q "uniform int8+rot" "$tmp/cal.out" && grep -q "^\*" "$tmp/cal.out" \
  && grep -q "on the check windows: KLD" "$tmp/cal.err" \
  && [ "$(json_get "$tmp/cal.json" "d['calibration']['check_windows']")" = "2" ] \
  && python3 -c "import json; c=json.load(open('$tmp/cal.json'))['calibration']; assert c['check_kld'] + 2 * c['check_kld_err'] <= 1e-3, c" \
  && ok || bad "calibrate --kld-budget: $(cat "$tmp/cal.out" "$tmp/cal.err")"
# The search's KLD is what eval perplexity measures on the same windows: a text of exactly 2
# windows of 128 tokens, searched on both (no check windows), re-measured by eval.
head -c 1200 "$tiny/eval/heldout.txt" >"$tmp/short.txt"
if "$KVLM" calibrate --model "$tiny" --kld-budget 1e-3 --ctx 128 --windows 2 --check-windows 0 --text "$tmp/short.txt" \
     --out "$tmp/cal2.json" >"$tmp/cal2.out" 2>"$tmp/cal2.err"; then
  kld=$(json_get "$tmp/cal2.json" "d['calibration']['kld']")
  "$KVLM" eval perplexity --model "$tiny" --kv-cache-dtype bfloat16 --text "$tmp/short.txt" --ctx 128 --max-chunks 2 \
      --save-logits "$tmp/base.logits" >/dev/null 2>&1 \
    && "$KVLM" eval perplexity --model "$tiny" --kv-cache-plan "$tmp/cal2.json" --text "$tmp/short.txt" --ctx 128 \
      --max-chunks 2 --kl-divergence-base "$tmp/base.logits" --json "$tmp/cal-eval.json" >/dev/null 2>&1 \
    && python3 -c "import json; d=json.load(open('$tmp/cal-eval.json')); k=d['kld_mean']; assert k <= 1e-3 and abs(k - $kld) <= 1e-9 + 1e-6 * $kld and len(d['kld_windows']) == 2, (k, $kld)" \
    && ok || bad "calibrated plan re-measured: $(cat "$tmp/cal-eval.json")"
else
  bad "calibrate --check-windows 0: $(cat "$tmp/cal2.err")"
fi
# --context: exact rows are a cost per sequence, counted over the served context; at 64 tokens
# of context 4 + 64 exact rows cost more than a 16-bit layer, so no layer keeps them.
"$KVLM" calibrate --model "$tiny" --kld-budget 1e-3 --ctx 128 --windows 2 --text "$tiny/eval/heldout.txt" --context 64 \
    --out "$tmp/cal64.json" >"$tmp/cal64.out" 2>"$tmp/cal64.err" \
  && grep -q "at 64 tokens of context" "$tmp/cal64.out" \
  && [ "$(json_get "$tmp/cal64.json" "sum(l.get('keep_sink', 0) + l.get('keep_recent', 0) for l in d['layers'])")" = "0" ] \
  && [ "$(json_get "$tmp/cal64.json" "d['calibration']['context']")" = "64" ] \
  && ok || bad "calibrate --context 64: $(cat "$tmp/cal64.out" "$tmp/cal64.err")"
# A text too short for the check windows asked for: the search says so and how many it used.
"$KVLM" calibrate --model "$tiny" --kld-budget 1e-3 --ctx 128 --windows 2 --check-windows 3 --text "$tmp/short.txt" \
    --out "$tmp/cal-short.json" >"$tmp/cal-short.out" 2>"$tmp/cal-short.err" \
  && grep -q "the text fills 2 windows of 128 tokens: 1 check window instead of 3; give more text" "$tmp/cal-short.err" \
  && python3 -c "import json; c=json.load(open('$tmp/cal-short.json'))['calibration']; assert (c['windows'], c['check_windows']) == (1, 1), c" \
  && ok || bad "calibrate on a short text: $(cat "$tmp/cal-short.out" "$tmp/cal-short.err")"
expect_error 1 "--kld-budget" -- calibrate --kld-budget -1 --out "$tmp/x.json"
# An output file that is one of the command's inputs is refused before anything is written, and
# a --json FILE that looks like an option says what --json wants.
cp "$tmp/cal.json" "$tmp/keep.json"
expect_error 1 "--json $tmp/keep.json is the --kv-cache-plan file this command reads" -- \
  eval perplexity --model "$tiny" --text "$tiny/eval/heldout.txt" --ctx 64 --kv-cache-plan "$tmp/keep.json" --json "$tmp/keep.json"
cmp -s "$tmp/cal.json" "$tmp/keep.json" && ok || bad "the plan file changed"
expect_error 1 "--out $tiny/eval/heldout.txt is the --text file" -- \
  calibrate --model "$tiny" --kld-budget 1e-3 --text "$tiny/eval/heldout.txt" --out "$tiny/eval/heldout.txt"
expect_error 2 "--json: takes the FILE to write (e.g. --json results.json), not '--kv-cache-dtype'" -- \
  eval perplexity --model "$tiny" --text "$tiny/eval/heldout.txt" --json --kv-cache-dtype bfloat16
expect_error 1 "unknown --attention-backend 'flashinfer'; available backends: cpu" -- inspect --attention-backend flashinfer
expect_error 1 "invalid --device 'tpu'" -- generate --prompt-ids 1 --device tpu
expect_error 1 "a GPU is named cuda:N with N its index" -- generate --prompt-ids 1 --device cuda:x
expect_error 1 "a GPU is named cuda:N with N its index" -- inspect --device cuda:-1
if ! "$KVLM" inspect --device cuda >/dev/null 2>&1; then  # no GPU here: the index is refused as the GPU is
  expect_error 1 "--device cuda:7:" -- inspect --device cuda:7
fi
expect_error 1 "invalid --dtype 'int8'" -- generate --prompt-ids 1 --dtype int8
expect_error 1 "invalid --block-size 12" -- generate --prompt-ids 1 --block-size 12
expect_error 1 "outside the model's vocabulary (0..511)" -- generate --model "$stories" --prompt-ids 1,99999
expect_error 1 "invalid token id 'x'" -- generate --prompt-ids 1,x
expect_error 1 "exceeds the model's context length of 512" -- generate --model "$stories" --prompt-ids 1,2,3 --max-tokens 600
expect_error 1 "--max-tokens must be at least 1" -- generate --prompt-ids 1 --max-tokens 0
expect_error 1 "unknown method 'medusa'; valid methods are: ngram, dflash" -- \
  generate --prompt-ids 1 --speculative-config '{"method":"medusa","num_speculative_tokens":2}'
expect_error 1 "--speculative-config model '/nonexistent/drafter' is not a directory" -- \
  generate --prompt-ids 1 --speculative-config '{"method":"dflash","model":"/nonexistent/drafter","num_speculative_tokens":2}'
expect_error 1 "is a Qwen3ForCausalLM, not a DFlash drafter" -- \
  inspect --speculative-config "{\"method\":\"dflash\",\"model\":\"$here/../../models/kvlm-tiny\",\"num_speculative_tokens\":2}"
# n-gram drafting changes nothing in the output.
plain=$("$KVLM" generate --prompt-ids 1,10,11,12,10,11,12,10,11 --max-tokens 24 --temperature 0 --ignore-eos --json 2>/dev/null)
drafted=$("$KVLM" generate --prompt-ids 1,10,11,12,10,11,12,10,11 --max-tokens 24 --temperature 0 --ignore-eos --json \
  --speculative-config '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":3}' 2>/dev/null)
p_ids=$(printf '%s' "$plain" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])' 2>/dev/null || echo x)
d_ids=$(printf '%s' "$drafted" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])' 2>/dev/null || echo y)
[ "$p_ids" = "$d_ids" ] && ok || bad "n-gram drafting changed the greedy output: $p_ids vs $d_ids"
# What drafting saves is forward passes: one per token after the first without it, fewer with
# the bundled DFlash drafter on the question it was trained beside.
q="A notebook costs 15 dollars and a candle costs 6 dollars. Selma buys 5 notebooks and 4 candles. How many dollars does Selma spend?"
"$KVLM" generate --chat --prompt "$q" --max-tokens 60 --temperature 0 --ignore-eos --json >"$tmp/p.json" 2>/dev/null
"$KVLM" generate --chat --prompt "$q" --max-tokens 60 --temperature 0 --ignore-eos --json \
  --speculative-config '{"method":"dflash","model":"'"$here"'/../../models/kvlm-tiny-dflash","num_speculative_tokens":7}' \
  >"$tmp/d.json" 2>"$tmp/spec.err"
p_steps=$(json_get "$tmp/p.json" "d['timing']['decode_steps']" 2>/dev/null || echo x)
d_steps=$(json_get "$tmp/d.json" "d['timing']['decode_steps']" 2>/dev/null || echo 99)
[ "$p_steps" = 59 ] && [ "$d_steps" -lt 30 ] 2>/dev/null && ok || bad "decode steps: $p_steps plain (want 59), $d_steps drafted (want < 30)"
[ "$(json_get "$tmp/p.json" "d['token_ids']")" = "$(json_get "$tmp/d.json" "d['token_ids']")" ] && ok || bad "DFlash changed the greedy text"
# --json prints the same summary on stderr.
grep -q "59 tokens after the first took $d_steps forward passes of the model instead of 59" "$tmp/spec.err" && ok ||
  bad "the drafting summary names the passes saved: $(cat "$tmp/spec.err")"
expect_error 1 "--temperature must be" -- generate --prompt-ids 1 --temperature -1
expect_error 1 "--top-p must be in (0, 1]" -- generate --prompt-ids 1 --top-p 0
expect_error 1 "give a prompt" -- generate --prompt-ids ""
expect_error 1 "give a prompt: --prompt TEXT or --prompt-ids" -- generate
expect_error 1 "does not exist" -- generate --model "$tmp/nope" --prompt-ids 1
# The model path is checked first, on every command: text prompts on a missing path, a Hub id
# or a directory without a model said "has no tokenizer.json ... give --prompt-ids".
expect_error 1 "model '$tmp/nope' does not exist; give a Hugging Face model directory" -- generate --model "$tmp/nope" --prompt hi
expect_error 1 "does not exist" -- chat --model "$tmp/nope"
expect_error 1 "does not exist" -- inspect --model "$tmp/nope"
expect_error 1 "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir models/SmolLM2-135M-Instruct" -- \
  generate --model HuggingFaceTB/SmolLM2-135M-Instruct --prompt hi
mkdir -p "$tmp/empty"
expect_error 1 "has no config.json (nor a .gguf file)" -- generate --model "$tmp/empty" --prompt hi
"$KVLM" generate --help >"$tmp/help" 2>&1; grep -q "or a .gguf file" "$tmp/help" && ok || bad "--model's help names GGUF files"
# GGUF paths: a damaged .gguf, a file that is not one, a directory holding two, and text
# on a GGUF model (whose tokenizer kvlm does not read yet).
printf 'GGUF\003\000\000\000' > "$tmp/bad.gguf"
expect_error 1 "not a valid GGUF file" -- generate --model "$tmp/bad.gguf" --prompt-ids 1
echo hello > "$tmp/model.bin"
expect_error 1 "is a file but not a .gguf file" -- generate --model "$tmp/model.bin" --prompt-ids 1
mkdir -p "$tmp/two" && cp "$tmp/bad.gguf" "$tmp/two/a.gguf" && cp "$tmp/bad.gguf" "$tmp/two/b.gguf"
expect_error 1 "holds 2 .gguf files" -- generate --model "$tmp/two" --prompt-ids 1
expect_error 1 "not a valid GGUF file" -- generate --model "$tmp/bad.gguf" --prompt "hi"
expect_error 1 "not a valid GGUF file" -- tokenize --tokenizer "$tmp/bad.gguf" --text "hi"
expect_error 1 "a GGUF model cannot be calibrated yet" -- calibrate --model "$tmp/bad.gguf" --out "$tmp/calibrated"

m="$tmp/model"
cp -r "$golden/qwen3-mixed" "$m"
head -c 1000 "$golden/qwen3-mixed/model.safetensors" >"$m/model.safetensors"
expect_error 1 "not a valid safetensors file" -- generate --model "$m" --prompt-ids 1
python3 - "$m/model.safetensors" <<'PY'
import struct, sys
open(sys.argv[1], "wb").write(struct.pack("<Q", 20) + b'{"a": broken json!!}')
PY
expect_error 1 "header is not valid JSON" -- generate --model "$m" --prompt-ids 1
cp "$golden/qwen3-mixed/model.safetensors" "$m/model.safetensors"
python3 - "$m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["intermediate_size"] = 99; json.dump(c, open(sys.argv[1], "w"))
PY
expect_error 1 "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [128, 64] but config.json implies [99, 64]" -- \
  generate --model "$m" --prompt-ids 1
python3 - "$m/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["intermediate_size"] = 128; c["architectures"] = ["FalconForCausalLM"]; json.dump(c, open(sys.argv[1], "w"))
PY
expect_error 1 "unsupported architecture 'FalconForCausalLM'" -- generate --model "$m" --prompt-ids 1
echo '{"hidden_size": ' >"$m/config.json"
expect_error 1 "config.json is not valid JSON" -- inspect --model "$m"
cp "$golden/llama-gqa/config.json" "$m/config.json"
rm -f "$m/model.safetensors"
cp "$golden/llama-gqa/"*.safetensors "$golden/llama-gqa/model.safetensors.index.json" "$m/"
rm "$m/model-00002-of-00002.safetensors"
expect_error 1 "lists shard 'model-00002-of-00002.safetensors'" -- generate --model "$m" --prompt-ids 1
cp "$golden/llama-gqa/model-00002-of-00002.safetensors" "$m/"
python3 - "$m/model.safetensors.index.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); del c["weight_map"]["model.norm.weight"]; json.dump(c, open(sys.argv[1], "w"))
PY
expect_error 1 "missing tensor 'model.norm.weight'" -- generate --model "$m" --prompt-ids 1

# A checkpoint that declares an FP8 KV scheme with calibrated scales (compressed-tensors):
# auto picks it up, an explicit bfloat16 overrides it (seed 002).
python3 - "$golden/llama-gqa" "$m" <<'PY'
import json, struct, sys
src, dst = sys.argv[1], sys.argv[2]
c = json.load(open(f"{src}/config.json"))
c["quantization_config"] = {"quant_method": "compressed-tensors",
                            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
json.dump(c, open(f"{dst}/config.json", "w"))
tensors = {}
for i in range(c["num_hidden_layers"]):
    for kv, v in (("k", 0.02), ("v", 0.01)):
        tensors[f"model.layers.{i}.self_attn.{kv}_proj.output_scale"] = v
header, data = {}, b""
for name, v in tensors.items():
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
    data += struct.pack("<f", v)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open(f"{dst}/scales.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + data)
idx = json.load(open(f"{dst}/model.safetensors.index.json"))
idx["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
for name in tensors: idx["weight_map"][name] = "scales.safetensors"
json.dump(idx, open(f"{dst}/model.safetensors.index.json", "w"))
PY
"$KVLM" inspect --model "$m" --json >"$tmp/ct.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/ct.json" "(d['resolved']['source'], d['layers'][0]['kv_dtype'], d['layers'][0]['scale_source'], d['layers'][0]['k_scale_tensor'])")" = \
       "('checkpoint scheme', 'fp8_e4m3', 'checkpoint', 'model.layers.0.self_attn.k_proj.output_scale')" ] \
  && ok || bad "compressed-tensors scheme + scales: $(cat "$tmp/err")"
"$KVLM" inspect --model "$m" --kv-cache-dtype bfloat16 --json >"$tmp/ct2.json" \
  && [ "$(json_get "$tmp/ct2.json" "(d['resolved']['source'], d['layers'][0]['kv_dtype'])")" = "('explicit', 'bfloat16')" ] \
  && ok || bad "explicit bfloat16 beats the checkpoint's fp8 scheme"
"$KVLM" generate --model "$m" --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 --json >/dev/null 2>"$tmp/err" \
  && ! grep -q "without checkpoint scales" "$tmp/err" && ok || bad "generate with checkpoint scales"
# K explicit, V auto: V still follows the checkpoint's scheme (with its scales), K does not.
"$KVLM" inspect --model "$m" --kv-cache-dtype k=int8_per_token_head --json >"$tmp/ct3.json" \
  && [ "$(json_get "$tmp/ct3.json" "(d['kv_cache_dtype'], d['resolved']['source'], d['v_resolved']['source'], d['layers'][0]['kv_dtype'], d['layers'][0]['v_dtype'], d['layers'][0]['v_scale'])")" = \
       "('k=int8_per_token_head,v=auto', 'explicit', 'checkpoint scheme', 'int8', 'fp8_e4m3', [0.009999999776482582])" ] \
  && ok || bad "K explicit, V from the checkpoint's scheme: $(cat "$tmp/ct3.json")"
"$KVLM" generate --model "$m" --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 --cache-type-k int8_per_token_head -q --json >/dev/null \
  && ok || bad "generate with K int8 and the checkpoint's FP8 V"
# The plan file tops the precedence, side by side: layer 0's V from the plan beats the explicit
# dtype and the checkpoint's scheme; layer 1 (not in the plan) keeps explicit K and the
# checkpoint's FP8 V with its scales. Layer 0's K rotation is not in the plan: auto rotates it
# (a quantized side of a layer with a 4-bit side), with the plan's seed.
cat >"$tmp/plan.json" <<'JSON'
{"kvlm_kv_plan": 1, "layers": [{"layer": 0, "v": "int4_per_token_head", "rotation": {"v": "hadamard"}, "rotation_seed": 3}]}
JSON
"$KVLM" inspect --model "$m" --kv-cache-dtype k=int8_per_token_head --kv-cache-plan "$tmp/plan.json" --json >"$tmp/ct4.json" \
  && [ "$(json_get "$tmp/ct4.json" "[(l['kv_dtype'], l.get('v_dtype'), l['dtype_source'], l.get('v_dtype_source'), l['rotation'], l.get('rotation_seed')) for l in d['layers'][:2]]")" = \
       "[('int8', 'int4', 'explicit', 'plan file', 'hadamard', 3), ('int8', 'fp8_e4m3', 'explicit', 'checkpoint scheme', 'none', None)]" ] \
  && ok || bad "plan file > explicit > checkpoint scheme: $(cat "$tmp/ct4.json")"
"$KVLM" inspect --model "$m" --kv-cache-plan "$tmp/plan.json" >"$tmp/out" 2>&1 \
  && grep -q "k:checkpoint scheme v:plan file" "$tmp/out" && grep -q "hadamard_v seed 3" "$tmp/out" \
  && ok || bad "inspect shows each side's source: $(cat "$tmp/out")"
"$KVLM" generate --model "$m" --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 --kv-cache-plan "$tmp/plan.json" -q --json >/dev/null \
  && ok || bad "generate with a plan file over the checkpoint's scheme"

# --- FP8 checkpoints (tests/golden/models/*-fp8-*, tools/make_fp8_goldens.py) -------------
fp8ct="$golden/llama-gqa-fp8-ct"
"$KVLM" inspect --model "$fp8ct" >"$tmp/out" 2>&1 \
  && grep -q "weights    FP8 E4M3 weights, per-channel scales, dynamic per-token activations (compressed-tensors)" "$tmp/out" \
  && ok || bad "inspect names the FP8 weight scheme: $(cat "$tmp/out")"
"$KVLM" inspect --model "$golden/qwen2-bias-fp8-modelopt" --json >"$tmp/mo.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/mo.json" "(d['weights']['format'], d['weights']['scaling'], d['weights']['origin'])")" = \
       "('fp8_e4m3', 'per-tensor', 'modelopt')" ] && ok || bad "inspect --json weights (modelopt hf_quant_config.json): $(cat "$tmp/err")"
"$KVLM" inspect --model "$golden/qwen3-mixed-fp8-block" --json >"$tmp/bl.json" \
  && [ "$(json_get "$tmp/bl.json" "(d['weights']['scaling'], d['weights']['block'])")" = "('block', [128, 128])" ] \
  && ok || bad "inspect --json block weights"
"$KVLM" inspect --json >"$tmp/dense.json" && [ "$(json_get "$tmp/dense.json" "d['weights']['format']")" = "bfloat16" ] \
  && ok || bad "inspect --json weights of a 16-bit model"
"$KVLM" generate --model "$fp8ct" --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 >/dev/null 2>"$tmp/err" \
  && grep -q "FP8 weights (compressed-tensors)" "$tmp/err" && ok || bad "generate on an FP8 checkpoint: $(cat "$tmp/err")"
# --quantization fp8 on a 16-bit checkpoint: quantized at load; on an FP8 one: its own scheme.
"$KVLM" generate --quantization fp8 --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null 2>"$tmp/err" \
  && grep -q "FP8 weights (--quantization fp8)" "$tmp/err" && ok || bad "--quantization fp8: $(cat "$tmp/err")"
"$KVLM" inspect --model "$fp8ct" --quantization fp8 >"$tmp/out" 2>&1 && grep -q "(compressed-tensors)" "$tmp/out" \
  && ok || bad "--quantization fp8 keeps an FP8 checkpoint's scheme"
expect_error 1 "invalid --quantization 'int8'; valid values: fp8" -- generate --quantization int8 --prompt-ids 1
# The KV scheme of an FP8-weight checkpoint: auto takes it, an explicit dtype beats it (seed 002).
m8="$tmp/fp8kv"
mkdir -p "$m8" && cp "$fp8ct"/* "$m8/"
python3 - "$m8" <<'PY'
import json, struct, sys
d = sys.argv[1]
c = json.load(open(f"{d}/config.json"))
c["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                               "symmetric": True}
json.dump(c, open(f"{d}/config.json", "w"))
tensors = {f"model.layers.{i}.self_attn.{kv}_proj.output_scale": s
           for i in range(c["num_hidden_layers"]) for kv, s in (("k", 0.03), ("v", 0.02))}
header, data = {}, b""
for name, v in tensors.items():
    header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
    data += struct.pack("<f", v)
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open(f"{d}/kv-scales.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + data)
idx = json.load(open(f"{d}/model.safetensors.index.json"))
for name in tensors: idx["weight_map"][name] = "kv-scales.safetensors"
json.dump(idx, open(f"{d}/model.safetensors.index.json", "w"))
PY
"$KVLM" inspect --model "$m8" --json >"$tmp/kv8.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/kv8.json" "(d['weights']['origin'], d['resolved']['source'], d['layers'][0]['kv_dtype'], round(d['layers'][0]['k_scale'][0], 6))")" = \
       "('compressed-tensors', 'checkpoint scheme', 'fp8_e4m3', 0.03)" ] \
  && ok || bad "FP8 checkpoint's kv_cache_scheme and scales: $(cat "$tmp/err") $(cat "$tmp/kv8.json" | head -30)"
"$KVLM" inspect --model "$m8" --kv-cache-dtype bfloat16 --json >"$tmp/kv8b.json" \
  && [ "$(json_get "$tmp/kv8b.json" "(d['resolved']['source'], d['layers'][0]['kv_dtype'])")" = "('explicit', 'bfloat16')" ] \
  && ok || bad "explicit bfloat16 beats the FP8 checkpoint's KV scheme"
for kv in auto bfloat16; do
  "$KVLM" generate --model "$m8" --kv-cache-dtype $kv --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 >/dev/null 2>"$tmp/err" \
    && ok || bad "generate on the FP8 checkpoint with --kv-cache-dtype $kv: $(cat "$tmp/err")"
done
# Corrupt or inconsistent FP8 checkpoints: clear errors that name the tensor.
fp8_edit() {  # fp8_edit DIR PYTHON: rewrites the single-file checkpoint DIR/model.safetensors
  python3 - "$1" "$2" <<'PY'
import json, struct, sys
d, code = sys.argv[1], sys.argv[2]
raw = open(f"{d}/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); body = raw[8 + n:]
meta = hdr.pop("__metadata__", None)
t = {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in hdr.items()}
exec(code)
out, data = {}, b""
for k, (dt, sh, b) in t.items():
    out[k] = {"dtype": dt, "shape": sh, "data_offsets": [len(data), len(data) + len(b)]}
    data += b
if meta: out["__metadata__"] = meta
h = json.dumps(out).encode(); h += b" " * (-len(h) % 8)
open(f"{d}/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + data)
PY
}
mo="$tmp/mo-bad"
mkdir -p "$mo" && cp "$golden/qwen2-bias-fp8-modelopt"/* "$mo/"
fp8_edit "$mo" 'del t["model.layers.1.mlp.down_proj.weight_scale"]'
expect_error 1 "'model.layers.1.mlp.down_proj.weight' is float8_e4m3fn but the checkpoint has no 'model.layers.1.mlp.down_proj.weight_scale'" \
  -- generate --model "$mo" --prompt-ids 1
cp "$golden/qwen2-bias-fp8-modelopt/model.safetensors" "$mo/"
fp8_edit "$mo" 't["model.layers.0.self_attn.o_proj.weight_scale"] = ("F32", [2], struct.pack("<ff", 0.1, 0.1))'
expect_error 1 "scale tensor 'model.layers.0.self_attn.o_proj.weight_scale' has shape [2]; the modelopt per-tensor scheme of config.json needs [] or [1]" \
  -- generate --model "$mo" --prompt-ids 1
cp "$golden/qwen2-bias-fp8-modelopt/model.safetensors" "$mo/"
fp8_edit "$mo" 't["model.layers.0.self_attn.q_proj.weight_scale"] = ("F32", [], struct.pack("<f", float("nan")))'
expect_error 1 "scale tensor 'model.layers.0.self_attn.q_proj.weight_scale' holds nan" -- generate --model "$mo" --prompt-ids 1
cp "$golden/qwen2-bias-fp8-modelopt/model.safetensors" "$mo/"
rm "$mo/hf_quant_config.json"
expect_error 1 "is float8_e4m3fn, but config.json declares no FP8 quantization_config" -- generate --model "$mo" --prompt-ids 1
bl="$tmp/bl-bad"
mkdir -p "$bl" && cp "$golden/qwen3-mixed-fp8-block"/* "$bl/"
python3 - "$bl/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["quantization_config"]["weight_block_size"] = [64, 64]; json.dump(c, open(sys.argv[1], "w"))
PY
expect_error 1 "needs [2, 1] (one scale per 64x64 block of the [128, 64] weight)" -- generate --model "$bl" --prompt-ids 1
python3 - "$bl/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}}}
json.dump(c, open(sys.argv[1], "w"))
PY
# a W4A16 config over FP8 tensors: the packed tensors decide (there are none), and FP8 tensors
# without an FP8 scheme to scale them are refused
expect_error 1 "is float8_e4m3fn, but config.json declares no FP8 quantization_config" -- generate --model "$bl" --prompt-ids 1

# --- 4-bit checkpoints (tests/data/int4): inspect names the scheme and each module's path;
# what kvlm cannot run is refused by field --------------------------------------------------
int4="$here/../data/int4"
"$KVLM" inspect --model "$int4/ct_w4a16" >"$tmp/out" 2>&1 && grep -q "compressed-tensors W4A16, groups of 32, symmetric" "$tmp/out" \
  && grep -q "4-bit g32 as Q4_1" "$tmp/out" && ok || bad "inspect shows a compressed-tensors W4A16 checkpoint: $(cat "$tmp/out")"
"$KVLM" inspect --model "$int4/mxfp4" >"$tmp/out" 2>&1 && grep -q "MXFP4 (E2M1 codes, an E8M0 scale per 32): 8 modules" "$tmp/out" \
  && ok || bad "inspect shows an MXFP4 GPT-OSS: $(cat "$tmp/out")"
"$KVLM" generate --model "$int4/awq" --prompt-ids 1,5,9 --max-tokens 4 --temperature 0 >"$tmp/out" 2>&1 && ok \
  || bad "an AWQ checkpoint generates: $(cat "$tmp/out")"
w4a8="$tmp/w4a8"
mkdir -p "$w4a8" && cp "$int4/ct_w4a16"/* "$w4a8/"
python3 - "$w4a8/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}
json.dump(c, open(sys.argv[1], "w"))
PY
expect_error 1 "quantized activations beside 4-bit weights (e.g. W4A8) are not supported" -- generate --model "$w4a8" --prompt-ids 1

# --- a hybrid linear-attention model (Qwen3.5 golden): CPU, one rank, n-gram drafting ------
q35="$golden/qwen3.5"
"$KVLM" inspect --model "$q35" >"$tmp/out" 2>&1 && grep -q "linear (Gated DeltaNet)" "$tmp/out" \
  && grep -q "linear-attention state: 32256 bytes per running sequence" "$tmp/out" && ok \
  || bad "inspect lists Qwen3.5's Gated DeltaNet layers and their state: $(cat "$tmp/out")"
"$KVLM" generate --model "$q35" --prompt-ids 1,54,232,73 --max-tokens 4 --temperature 0 >"$tmp/out" 2>&1 && ok \
  || bad "a Qwen3.5 checkpoint generates on the CPU: $(cat "$tmp/out")"
# --mamba-ssm-cache-dtype bfloat16: the matrices in bf16 (4 layers x (1920 B window + 3072 B))
"$KVLM" inspect --model "$q35" --mamba-ssm-cache-dtype bfloat16 >"$tmp/out" 2>&1 \
  && grep -q "linear-attention state: 19968 bytes per running sequence" "$tmp/out" \
  && grep -q "delta-rule matrices in bfloat16" "$tmp/out" && ok \
  || bad "inspect counts a bf16 state: $(cat "$tmp/out")"
"$KVLM" generate --model "$q35" --prompt-ids 1,54,232,73 --max-tokens 4 --temperature 0 \
  --mamba-ssm-cache-dtype bfloat16 >"$tmp/out" 2>&1 && ok || bad "Qwen3.5 generates with a bf16 state: $(cat "$tmp/out")"
expect_error 1 "--mamba-ssm-cache-dtype must be auto, float32 or bfloat16, got 'float16'" -- generate --model "$q35" \
  --prompt-ids 1,2 --mamba-ssm-cache-dtype float16
# n-gram drafting: a rejected draft rolls the recurrent state back; the tokens are the plain run's.
"$KVLM" generate --model "$q35" --prompt-ids 1,45,87,45,87,45,87,45 --max-tokens 12 --temperature 0 \
  --dtype float32 >"$tmp/plain.out" 2>/dev/null \
  && "$KVLM" generate --model "$q35" --prompt-ids 1,45,87,45,87,45,87,45 --max-tokens 12 --temperature 0 \
    --dtype float32 --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}' \
    >"$tmp/spec.out" 2>"$tmp/err" \
  && cmp -s "$tmp/plain.out" "$tmp/spec.out" && grep -Eq "of [1-9][0-9]* draft tokens accepted" "$tmp/err" && ok \
  || bad "n-gram drafting on Qwen3.5 gives the plain tokens: $(cat "$tmp/plain.out" "$tmp/spec.out" "$tmp/err")"
expect_error 1 "DFlash drafting is not supported on models with Gated DeltaNet layers" -- generate --model "$q35" \
  --prompt-ids 1,2 --speculative-config \
  '{"method":"dflash","model":"'"$here"'/../../models/kvlm-tiny-dflash","num_speculative_tokens":7}'
# Tensor parallelism splits the Gated DeltaNet layers by key heads: two ranks, one rank's tokens.
"$KVLM" generate --model "$q35" --prompt-ids 1,54,232,73 --max-tokens 6 --temperature 0 --dtype float32 \
  >"$tmp/tp1.out" 2>&1 \
  && "$KVLM" generate --model "$q35" --prompt-ids 1,54,232,73 --max-tokens 6 --temperature 0 --dtype float32 \
    --tensor-parallel-size 2 >"$tmp/tp2.out" 2>&1 \
  && grep -q "^generated" "$tmp/tp1.out" && [ "$(grep "^generated" "$tmp/tp1.out")" = "$(grep "^generated" "$tmp/tp2.out")" ] \
  && ok || bad "Qwen3.5 over 2 tensor-parallel ranks gives one rank's tokens: $(cat "$tmp/tp1.out" "$tmp/tp2.out")"
"$KVLM" inspect --model "$q35" --tensor-parallel-size 2 >"$tmp/out" 2>&1 \
  && grep -q "rank 1: .*linear key heads 1-1 (value heads 2-3, 16128 state bytes per sequence)" "$tmp/out" && ok \
  || bad "inspect shows each rank's Gated DeltaNet heads: $(cat "$tmp/out")"
expect_error 1 "linear_num_key_heads 2 is not divisible by 4" -- generate --model "$q35" --prompt-ids 1,2 \
  --tensor-parallel-size 4
# Qwen3-Next: interleaved DeltaNet projections, experts with a shared expert
"$KVLM" inspect --model "$golden/qwen3-next" >"$tmp/out" 2>&1 \
  && grep -q "6 experts x 32, top 2 + shared 48" "$tmp/out" && ok \
  || bad "inspect shows Qwen3-Next's shared expert: $(cat "$tmp/out")"
"$KVLM" generate --model "$golden/qwen3-next" --prompt-ids 1,54,232,73 --max-tokens 4 --temperature 0 >"$tmp/out" 2>&1 && ok \
  || bad "a Qwen3-Next checkpoint generates on the CPU: $(cat "$tmp/out")"

# --- the bundled model: kvlm-tiny, trained by tools/train, answers arithmetic -------------
"$KVLM" inspect >"$tmp/out" 2>&1 && grep -q "models/kvlm-tiny" "$tmp/out" && ok || bad "the bundled default is kvlm-tiny"
"$KVLM" generate --chat --prompt "Ada has 12 apples. She buys 7 more apples. She gives 5 apples to Ben. How many apples does Ada have now?" \
  --temperature 0 --max-tokens 80 >"$tmp/out" 2>"$tmp/err" && grep -q "The answer is 14." "$tmp/out" && ok \
  || bad "kvlm-tiny solves an arithmetic problem: $(cat "$tmp/out" "$tmp/err")"

# --- calibrate: a new directory whose checkpoint carries the scales; the input untouched ---
chat="$here/../models/tiny-chat"
before=$(cd "$chat" && sha256sum * | sha256sum)
"$KVLM" calibrate --model "$chat" --out "$tmp/cal" --dataset "$here/../../README.md" --num-samples 4 --max-length 128 \
  >"$tmp/out" 2>"$tmp/err" && grep -q "calibrated 2 layers on 4 samples" "$tmp/out" && ok || bad "calibrate: $(cat "$tmp/err")"
[ "$(cd "$chat" && sha256sum * | sha256sum)" = "$before" ] && [ ! -e "$chat/model.safetensors.index.json" ] && ok \
  || bad "calibrate modified its input directory"
"$KVLM" inspect --model "$tmp/cal" --json >"$tmp/cal.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/cal.json" "(d['resolved']['source'], d['layers'][1]['kv_dtype'], d['layers'][1]['scale_source'], d['layers'][1]['k_scale_tensor'])")" = \
       "('checkpoint scheme', 'fp8_e4m3', 'checkpoint', 'model.layers.1.self_attn.k_scale')" ] \
  && ok || bad "calibrated model: $(cat "$tmp/err")"
# The scales are absmax / 448 of what was observed: positive and small for this model.
python3 - "$tmp/cal" <<'PY' && ok || bad "calibrated scale tensors"
import json, struct, sys
d = sys.argv[1]
idx = json.load(open(f"{d}/model.safetensors.index.json"))
f = idx["weight_map"]["model.layers.0.self_attn.v_scale"]
raw = open(f"{d}/{f}", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
lo, hi = hdr["model.layers.0.self_attn.v_scale"]["data_offsets"]
v = struct.unpack("<f", raw[8 + n + lo:8 + n + hi])[0]
cfg = json.load(open(f"{d}/config.json"))["quantization_config"]
assert cfg["quant_method"] == "compressed-tensors" and cfg["kv_cache_scheme"]["strategy"] == "tensor", cfg
assert 1e-5 < v < 1.0, v
assert "model.embed_tokens.weight" in idx["weight_map"]
PY
"$KVLM" calibrate --model "$chat" --out "$tmp/cal-h" --dataset "$here/../../README.md" --num-samples 2 --per-head >/dev/null 2>&1 \
  && "$KVLM" inspect --model "$tmp/cal-h" --json >"$tmp/calh.json" \
  && [ "$(json_get "$tmp/calh.json" "d['layers'][0]['scale_source']")" = "checkpoint" ] && ok || bad "calibrate --per-head"
"$KVLM" generate --model "$tmp/cal" --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null 2>"$tmp/err" \
  && ! grep -q "without checkpoint scales" "$tmp/err" && ok || bad "generate on the calibrated model: $(cat "$tmp/err")"
expect_error 1 "not an empty directory" -- calibrate --model "$chat" --out "$tmp/cal" --dataset "$here/../../README.md"
expect_error 1 "never modified" -- calibrate --model "$chat" --out "$chat" --dataset "$here/../../README.md"
expect_error 1 "none found in the model directory" -- calibrate --model "$stories" --out "$tmp/cal-x"
expect_error 1 "give --dataset as a .ids file" -- calibrate --model "$stories" --out "$tmp/cal-x" --dataset "$here/../../README.md"
python3 -c "print(' '.join(str(i % 500 + 1) for i in range(24)))" >"$tmp/cal.ids"
"$KVLM" calibrate --model "$stories" --out "$tmp/cal-ids" --dataset "$tmp/cal.ids" --max-length 8 >"$tmp/out" 2>"$tmp/err" \
  && grep -q "on 3 samples (24 tokens)" "$tmp/out" && ok || bad "calibrate from token ids: $(cat "$tmp/err")"
expect_error 2 "--out" -- calibrate --model "$chat"

# --- eval: perplexity with a saved baseline, task accuracy ------------------------------
"$KVLM" eval perplexity --model "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 6 --kv-cache-dtype float16 \
  --save-logits "$tmp/base.lgp" --json "$tmp/p0.json" >"$tmp/out" 2>"$tmp/err" && grep -q "^PPL" "$tmp/out" && ok \
  || bad "eval perplexity: $(cat "$tmp/err")"
"$KVLM" eval perplexity --model "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 6 --kv-cache-dtype float16 \
  --kl-divergence-base "$tmp/base.lgp" --json "$tmp/p1.json" >/dev/null 2>&1 \
  && [ "$(json_get "$tmp/p1.json" "(d['kld_max'] < 1e-9, d['same_top'], d['delta_ppl'] == 0)")" = "(True, 1.0, True)" ] \
  && ok || bad "the same run against itself has zero KLD"
"$KVLM" eval perplexity --model "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 6 --kv-cache-dtype fp8_e5m2 \
  --kl-divergence-base "$tmp/base.lgp" --json "$tmp/p2.json" >/dev/null 2>&1 \
  && [ "$(json_get "$tmp/p2.json" "(d['kld_mean'] > 1e-5, d['kld_p99'] >= d['kld_median'], d['kv_bytes_per_token'])")" = "(True, True, 256)" ] \
  && ok || bad "fp8_e5m2 against the fp16 baseline"
expect_error 1 "use the same model, --ctx and text" -- eval perplexity --model "$chat" --text "$here/../../README.md" --ctx 32 \
  --kl-divergence-base "$tmp/base.lgp"
head -c 100 "$tmp/base.lgp" >"$tmp/trunc.lgp"
expect_error 1 "truncated" -- eval perplexity --model "$chat" --text "$here/../../README.md" --ctx 64 --max-chunks 6 \
  --kl-divergence-base "$tmp/trunc.lgp"
expect_error 1 "fewer than one window" -- eval perplexity --model "$chat" --text "$chat/generation_config.json" --ctx 512
printf '%s\n' '{"prompt": "The answer is", "answer": "42", "regex": "(\\d+)"}' '{"prompt": "Hi", "answer": 7, "stop": "."}' >"$tmp/task.jsonl"
"$KVLM" eval task --model "$chat" --data "$tmp/task.jsonl" --max-tokens 8 --log-samples "$tmp/samples.jsonl" --json "$tmp/task.json" \
  >"$tmp/out" 2>"$tmp/err" && grep -q "^accuracy" "$tmp/out" && [ "$(wc -l <"$tmp/samples.jsonl")" = 2 ] \
  && [ "$(json_get "$tmp/task.json" "d['items']")" = 2 ] && ok || bad "eval task: $(cat "$tmp/err")"
echo '{"prompt": "x", "answer": "1", "regex": "(("}' >"$tmp/badre.jsonl"
expect_error 1 "not a valid regular expression" -- eval task --model "$chat" --data "$tmp/badre.jsonl"
echo 'not json' >"$tmp/badjson.jsonl"
expect_error 1 "badjson.jsonl:1: not valid JSON" -- eval task --model "$chat" --data "$tmp/badjson.jsonl"

# Tensor parallelism on the CPU (ranks as threads): the same greedy tokens as one rank, with
# -tp (vLLM's short form) or --tensor-parallel-size; a size that does not split the model is
# refused before any weight loads, with the sizes that work; inspect shows each rank's share.
expect_error 1 "--tensor-parallel-size 4 cannot split this model: num_attention_heads 6 is not divisible by 4 (config.json); sizes that work: 1, 2" \
  -- generate --device cpu --prompt "Hello" -tp 4
expect_error 1 "--tensor-parallel-size must be at least 1" -- generate --device cpu --prompt "Hello" --tensor-parallel-size 0
expect_error 1 "kvlm calibrate runs the model on the CPU as one rank" -- calibrate --model "$chat" -tp 2 --out "$tmp/cal-tp"
one=$("$KVLM" generate --device cpu --prompt "Once upon a time" --max-tokens 16 --temperature 0 --ignore-eos 2>/dev/null)
two=$("$KVLM" generate --device cpu -tp 2 --prompt "Once upon a time" --max-tokens 16 --temperature 0 --ignore-eos 2>"$tmp/err")
[ -n "$one" ] && [ "$one" = "$two" ] && grep -q "tensor parallel 2 (1792 KV B/token per rank)" "$tmp/err" && ok \
  || bad "-tp 2 vs one rank: '$one' vs '$two': $(cat "$tmp/err")"
"$KVLM" inspect --tensor-parallel-size 2 >"$tmp/out" 2>"$tmp/err" \
  && grep -q "rank 1: q heads 3-5, kv heads 1-1, MLP columns 512-1023, 1792 KV bytes per token" "$tmp/out" && ok \
  || bad "inspect -tp 2: $(cat "$tmp/out" "$tmp/err")"
"$KVLM" inspect --json -tp 2 >"$tmp/i.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/i.json" "d['tensor_parallel']['ranks'][1]['kv_heads']")" = "[1, 1]" ] && ok \
  || bad "inspect --json -tp 2: $(cat "$tmp/err")"
# A mixture of experts: each rank holds its columns of every expert (and of the dense MLP of
# Qwen3-MoE's mlp_only_layers); GPT-OSS has no dense MLP.
"$KVLM" inspect --model "$golden/qwen3-moe" -tp 2 >"$tmp/out" 2>"$tmp/err" \
  && grep -q "rank 1: q heads 2-3, kv heads 1-1, MLP columns 48-95, columns 16-31 of every expert" "$tmp/out" && ok \
  || bad "inspect qwen3-moe -tp 2: $(cat "$tmp/out" "$tmp/err")"
"$KVLM" inspect --model "$golden/gpt-oss" --json -tp 2 >"$tmp/i.json" 2>"$tmp/err" \
  && [ "$(json_get "$tmp/i.json" "d['tensor_parallel']['ranks'][1]['expert_columns']")" = "[16, 31]" ] \
  && [ "$(json_get "$tmp/i.json" "d['tensor_parallel']['ranks'][1]['mlp_columns']")" = "None" ] && ok \
  || bad "inspect gpt-oss --json -tp 2: $(cat "$tmp/err")"

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
