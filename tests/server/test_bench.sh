#!/usr/bin/env bash
# `kvlm bench throughput` and `kvlm bench serve` (against a `kvlm serve` on loopback) with
# the tiny-chat model: their tables, their --json results, and clear errors.
# usage: KVLM=path/to/kvlm bash tests/server/test_bench.sh
set -uo pipefail
KVLM=${KVLM:?set KVLM to the kvlm binary}
here=$(cd "$(dirname "$0")" && pwd)
model="$here/../models/tiny-chat"
tmp=$(mktemp -d)
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAIL: $*"; }
json_get() { python3 -c "import json,sys; d=json.load(open('$1')); print(($2))"; }
# Waits (up to 2 minutes: a loaded 2-core CI machine loads slowly) for a line in a server's log.
wait_log() { for _ in $(seq 1 2400); do grep -sq "$2" "$1" && return 0; sleep 0.05; done; return 1; }

# --- bench throughput ------------------------------------------------------------------------
if "$KVLM" bench throughput --model "$model" --num-prompts 40 --input-len 48 --output-len 16 --max-model-len 128 \
  --kv-cache-memory 64KiB --json "$tmp/t.json" >"$tmp/t.out" 2>"$tmp/t.err"; then
  grep -q "Throughput Benchmark Result" "$tmp/t.out" && grep -q "Output token throughput (tok/s):" "$tmp/t.out" && ok \
    || bad "throughput table: $(cat "$tmp/t.out")"
  [ "$(json_get "$tmp/t.json" "d['num_requests'], d['failed_requests'], d['total_output_tokens'], d['total_input_tokens']")" = \
    "(40, 0, 640, 1920)" ] && ok || bad "throughput json: $(cat "$tmp/t.json")"
  [ "$(json_get "$tmp/t.json" "d['output_tokens_per_second'] > 0 and 1 <= d['max_concurrency'] <= 40 and d['preemptions'] >= 0")" = True ] \
    && ok || bad "throughput json figures: $(cat "$tmp/t.json")"
  grep -q "maximum concurrency for 128 tokens per request" "$tmp/t.err" && ok || bad "throughput prints the memory plan: $(cat "$tmp/t.err")"
else
  bad "bench throughput failed: $(cat "$tmp/t.err")"
fi
printf '{"prompt": "Once upon a time", "output_len": 5}\n{"prompt_token_ids": [1, 2, 3, 4]}\n\n{"prompt": "The robot"}\n' >"$tmp/d.jsonl"
"$KVLM" bench throughput --model "$model" --dataset "$tmp/d.jsonl" --output-len 7 --json "$tmp/d.json" >/dev/null 2>"$tmp/err" \
  && [ "$(json_get "$tmp/d.json" "d['num_requests'], d['total_output_tokens']")" = "(3, 19)" ] && ok \
  || bad "bench throughput --dataset: $(cat "$tmp/err") $(cat "$tmp/d.json" 2>/dev/null)"
printf '{"prompt": 5}\n' >"$tmp/bad.jsonl"
"$KVLM" bench throughput --model "$model" --dataset "$tmp/bad.jsonl" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "bad.jsonl:1: needs \"prompt\"" "$tmp/err" && ok || bad "bad dataset line: $(cat "$tmp/err")"
"$KVLM" bench throughput --model "$model" --num-prompts 0 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "num-prompts must be at least 1" "$tmp/err" && ok || bad "--num-prompts 0: $(cat "$tmp/err")"
"$KVLM" bench throughput --model "$model" --input-len 100 --output-len 100 --max-model-len 128 --kv-cache-memory 1MiB >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "more than --max-model-len 128" "$tmp/err" && ok || bad "too long for max-model-len: $(cat "$tmp/err")"

# --- bench serve -------------------------------------------------------------------------------
"$KVLM" serve --model "$model" --port 0 --max-model-len 256 --api-key bench-key >"$tmp/s.out" 2>"$tmp/s.err" &
server_pid=$!
wait_log "$tmp/s.err" "ready: serving"
port=$(grep -so "listening on http://127.0.0.1:[0-9]*" "$tmp/s.err" | grep -o "[0-9]*$")
if [ -z "$port" ] || ! grep -sq "ready: serving" "$tmp/s.err"; then
  bad "kvlm serve did not start: $(cat "$tmp/s.err")"
else
  url="http://127.0.0.1:$port"
  if "$KVLM" bench serve --base-url "$url" --api-key bench-key --num-prompts 20 --request-rate 100 --input-len 32 \
    --output-len 8 --ignore-eos --json "$tmp/s.json" >"$tmp/b.out" 2>"$tmp/b.err"; then
    for line in "Serving Benchmark Result" "Mean TTFT (ms):" "P99 TPOT (ms):" "Median ITL (ms):" "P90 E2EL (ms):" \
      "Output token throughput (tok/s):"; do
      grep -qF "$line" "$tmp/b.out" && ok || bad "bench serve table lacks '$line': $(cat "$tmp/b.out")"
    done
    [ "$(json_get "$tmp/s.json" "d['completed'], d['failed'], d['total_output_tokens'], d['total_input_tokens']")" = \
      "(20, 0, 160, 640)" ] && ok || bad "bench serve json: $(cat "$tmp/s.json")"
    [ "$(json_get "$tmp/s.json" "d['mean_ttft_ms'] > 0 and d['p99_ttft_ms'] >= d['median_ttft_ms'] and d['mean_tpot_ms'] > 0 and d['output_throughput'] > 0")" = True ] \
      && ok || bad "bench serve figures: $(cat "$tmp/s.json")"
  else
    bad "bench serve failed: $(cat "$tmp/b.err") $(cat "$tmp/b.out")"
  fi
  "$KVLM" bench serve --base-url "$url" --api-key bench-key --num-prompts 12 --max-concurrency 3 --input-len 16 --output-len 4 \
    --ignore-eos --json "$tmp/c.json" >/dev/null 2>"$tmp/err" \
    && [ "$(json_get "$tmp/c.json" "d['completed'], d['peak_concurrency'] <= 3")" = "(12, True)" ] && ok \
    || bad "bench serve --max-concurrency: $(cat "$tmp/err")"
  "$KVLM" bench serve --base-url "$url" --num-prompts 2 --input-len 4 --output-len 2 >/dev/null 2>"$tmp/err"
  [ $? -eq 1 ] && grep -q "401" "$tmp/err" && ok || bad "bench serve without the key: $(cat "$tmp/err")"
  "$KVLM" bench serve --base-url "$url" --api-key bench-key --endpoint /v1/chat/completions --dataset "$tmp/d.jsonl" \
    --output-len 3 --json "$tmp/ch.json" >/dev/null 2>"$tmp/err"
  [ $? -eq 1 ] && grep -q "chat needs a \"prompt\" string" "$tmp/err" && ok || bad "chat with token-id prompts: $(cat "$tmp/err")"
  printf '{"prompt": "Once upon a time"}\n{"prompt": "The robot", "output_len": 2}\n' >"$tmp/chat.jsonl"
  "$KVLM" bench serve --base-url "$url" --api-key bench-key --endpoint /v1/chat/completions --dataset "$tmp/chat.jsonl" \
    --output-len 3 --ignore-eos --json "$tmp/ch.json" >/dev/null 2>"$tmp/err" \
    && [ "$(json_get "$tmp/ch.json" "d['completed'], d['total_output_tokens']")" = "(2, 5)" ] && ok \
    || bad "bench serve chat: $(cat "$tmp/err")"
  kill -TERM "$server_pid"
  wait "$server_pid"
  rc=$?
  server_pid=""
  [ $rc -eq 0 ] && ok || bad "kvlm serve exited $rc after SIGTERM: $(cat "$tmp/s.err")"
  "$KVLM" bench serve --base-url "$url" --num-prompts 1 >/dev/null 2>"$tmp/err"
  [ $? -eq 1 ] && grep -q "cannot reach the server" "$tmp/err" && ok || bad "bench serve, no server: $(cat "$tmp/err")"
fi
"$KVLM" bench serve --base-url "ftp://x" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "base-url must look like http://HOST:PORT" "$tmp/err" && ok || bad "bad --base-url: $(cat "$tmp/err")"

# --- serve: flag errors before anything loads -------------------------------------------------------
"$KVLM" serve --model "$model" --kv-cache-memory lots >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "invalid size 'lots'" "$tmp/err" && ok || bad "serve --kv-cache-memory lots: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --port 70000 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "port must be between 0 and 65535" "$tmp/err" && ok || bad "serve --port 70000: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --max-num-seqs 0 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "max-num-seqs must be at least 1" "$tmp/err" && ok || bad "serve --max-num-seqs 0: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --max-model-len 4096 --port 0 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "exceeds the model's context length of 2048" "$tmp/err" && ok || bad "serve --max-model-len 4096: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --max-model-len 2048 --kv-cache-memory 64KiB --port 0 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "fewer than one request of" "$tmp/err" && ok || bad "serve with a pool too small: $(cat "$tmp/err")"
"$KVLM" serve --model "$tmp/nothing" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "nothing" "$tmp/err" && ok || bad "serve --model missing: $(cat "$tmp/err")"
# A port in use: a clear error, not a crash.
python3 -c "
import socket, subprocess, sys
s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)
r = subprocess.run([sys.argv[1], 'serve', '--model', sys.argv[2], '--port', str(s.getsockname()[1])], capture_output=True, text=True, timeout=60)
sys.exit(0 if r.returncode == 1 and 'cannot listen on 127.0.0.1' in r.stderr and 'Choose another with --port' in r.stderr else 1)
" "$KVLM" "$model" && ok || bad "serve on a busy port"
# An empty API key is refused; serving beyond loopback without a key warns.
"$KVLM" serve --model "$model" --api-key "" --port 0 >/dev/null 2>"$tmp/err"
[ $? -ne 0 ] && grep -q "an empty API key would let anyone in" "$tmp/err" && ok || bad "serve --api-key '': $(cat "$tmp/err")"
KVLM_API_KEY= "$KVLM" serve --model "$model" --host 0.0.0.0 --port 0 --max-model-len 256 >/dev/null 2>"$tmp/w.err" &
server_pid=$!
wait_log "$tmp/w.err" "listening on"
kill -INT $server_pid; wait $server_pid 2>/dev/null
grep -q "serving on 0.0.0.0 without an API key" "$tmp/w.err" && ok || bad "no warning for 0.0.0.0 without a key: $(cat "$tmp/w.err")"
# The bundled default model (no --model) is kvlm-tiny, which answers arithmetic in chat.
"$KVLM" serve --port 0 --max-model-len 256 >"$tmp/d.out" 2>"$tmp/d.err" &
server_pid=$!
wait_log "$tmp/d.err" "ready: serving"
port=$(grep -so "listening on http://127.0.0.1:[0-9]*" "$tmp/d.err" | grep -o "[0-9]*$")
python3 - "$port" >"$tmp/dm.out" 2>&1 <<'EOF' && ok || bad "serve without --model: $(cat "$tmp/d.err") $(cat "$tmp/dm.out")"
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
models = json.loads(urllib.request.urlopen(base + "/v1/models").read())
assert models["data"][0]["id"] == "kvlm-tiny", models
req = urllib.request.Request(base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
    data=json.dumps({"messages": [{"role": "user", "content": "What is 17 plus 25?"}], "temperature": 0, "max_tokens": 40}).encode())
r = json.loads(urllib.request.urlopen(req).read())
assert "The answer is 42." in r["choices"][0]["message"]["content"], r
EOF
# serve's CPU default pool: 16 sequences of --max-model-len (the planner's 256 of them, up to
# 4 GiB, made the bundled model start in 7-20 s with 4.4 GB of memory).
grep -q "the CPU default: 16 sequences of --max-model-len" "$tmp/d.err" \
  && grep -q "maximum concurrency for 256 tokens per request: 16.00x" "$tmp/d.err" && ok \
  || bad "serve's CPU default pool: $(cat "$tmp/d.err")"
# Request bodies: JSON whatever the Content-Type (curl -d sends form-urlencoded; httplib alone
# refused such a body over 8 KiB with a 413), gzip bodies inflated, and the 16 MiB limit held
# on the inflated size (a 40 KB gzip of 40 MiB gets 413, not 40 MiB of memory).
python3 - "$port" >"$tmp/body.out" 2>&1 <<'EOF' && ok || bad "request bodies: $(cat "$tmp/body.out")"
import gzip, json, sys, urllib.request, urllib.error
base = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, data, headers):
    req = urllib.request.Request(base + path, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
small = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0})
st, r = post("/v1/completions", (small + " " * 20000).encode(), {"Content-Type": "application/x-www-form-urlencoded"})
assert st == 200 and r["choices"][0]["text"], (st, r)
st, r = post("/tokenize", (json.dumps({"prompt": "Hi"}) + " " * 10000).encode(), {"Content-Type": "application/x-www-form-urlencoded"})
assert st == 200 and r["count"] >= 1, (st, r)
st, r = post("/v1/completions", gzip.compress(small.encode()), {"Content-Type": "application/json", "Content-Encoding": "gzip"})
assert st == 200 and r["choices"][0]["text"], (st, r)
bomb = gzip.compress(b" " * (40 << 20))
st, r = post("/v1/completions", bomb, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
assert st == 413 and "larger than this server's limit" in r["error"]["message"], (st, r)
st, r = post("/v1/completions", b'--b\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--b--\r\n',
             {"Content-Type": "multipart/form-data; boundary=b"})
assert st == 400 and "multipart bodies are not supported" in r["error"]["message"], (st, r)
# A number too large for a double is a 400 naming where it is (the parser alone said 500
# "internal error: [json.exception.out_of_range.406] ...").
for path, raw, param in [("/v1/completions", b'{"prompt": [1, 1e400], "max_tokens": 2}', "prompt[1]"),
                         ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": -1e400}', "temperature"),
                         ("/detokenize", b'{"tokens": [5, 6, 1e999]}', "tokens[2]")]:
    st, r = post(path, raw, {"Content-Type": "application/json"})
    assert st == 400 and r["error"]["param"] == param and "out of range" in r["error"]["message"], (path, st, r)
# A declared length over the limit, any Content-Type: 413 (the body is read and dropped).
import socket
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % (17 << 20))
s.sendall(b"{" * (17 << 20))
s.settimeout(10)
resp = b""
while b"larger than this server" not in resp:
    chunk = s.recv(65536)
    if not chunk:
        break
    resp += chunk
assert resp.startswith(b"HTTP/1.1 413") and b"larger than this server" in resp, resp[:300]
EOF
kill -TERM "$server_pid"
wait "$server_pid"
rc=$?
server_pid=""
[ $rc -eq 0 ] && ok || bad "kvlm serve (default model) exited $rc"

# A model without a tokenizer (stories260K) serves token-id prompts; text gets a clear 400.
# (Its own log files: a file an earlier server wrote to would satisfy the wait for "ready"
# before this server truncates it, and hand over the dead server's port.)
"$KVLM" serve --model "$(dirname "$0")/../../models/stories260K" --port 0 --max-model-len 64 >"$tmp/nt.out" 2>"$tmp/nt.err" &
server_pid=$!
wait_log "$tmp/nt.err" "ready: serving"
port=$(grep -so "listening on http://127.0.0.1:[0-9]*" "$tmp/nt.err" | grep -o "[0-9]*$")
python3 - "$port" >"$tmp/ntm.out" 2>&1 <<'EOF' && ok || bad "serve a model without a tokenizer: $(cat "$tmp/nt.err") $(cat "$tmp/ntm.out")"
import json, sys, urllib.request, urllib.error
base = f"http://127.0.0.1:{sys.argv[1]}"
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
models = json.loads(urllib.request.urlopen(base + "/v1/models").read())
assert models["data"][0]["id"] == "stories260K", models
status, r = post("/v1/completions", {"prompt": [1, 403, 407], "max_tokens": 5, "temperature": 0, "ignore_eos": True})
assert status == 200 and len(r["choices"][0]["token_ids"]) == 5 and r["choices"][0]["prompt_token_ids"] == [1, 403, 407], r
status, r = post("/v1/completions", {"prompt": "text needs a tokenizer"})
assert status == 400 and "tokenizer" in r["error"]["message"], r
status, r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
assert status == 400 and "chat template" in r["error"]["message"], r
EOF
kill -TERM "$server_pid"
wait "$server_pid"
rc=$?
server_pid=""
[ $rc -eq 0 ] && ok || bad "kvlm serve (stories260K) exited $rc"

# The connection layer (pipelining, the cap's 503, header and body deadlines against 1,100
# slowloris connections, idle keep-alive), the access log and the stats line, on raw sockets.
python3 "$here/test_connections.py" "$KVLM" "$model" >"$tmp/conn.out" 2>&1 && ok || bad "connections: $(cat "$tmp/conn.out")"

# vLLM's command line: flags kvlm refuses say why; an unknown flag names the closest one.
"$KVLM" serve --max-num-seq 3 >/dev/null 2>"$tmp/err"
[ $? -eq 2 ] && grep -q "unknown flag '--max-num-seq'; did you mean '--max-num-seqs'?" "$tmp/err" && ok \
  || bad "unknown flag: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --tensor-parallel-size 3 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "tensor-parallel-size 3 cannot split this model: num_attention_heads 4 is not divisible by 3 (config.json); sizes that work: 1, 2, 4" "$tmp/err" \
  && ! grep -q "listening on" "$tmp/err" && ok || bad "--tensor-parallel-size 3: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --pipeline-parallel-size 2 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "pipeline-parallel-size 2 is not supported" "$tmp/err" && ok \
  || bad "--pipeline-parallel-size 2: $(cat "$tmp/err")"
"$KVLM" serve --model "$model" --ssl-keyfile k.pem >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "ssl-keyfile k.pem is not supported: kvlm serves plain HTTP" "$tmp/err" && ok \
  || bad "--ssl-keyfile: $(cat "$tmp/err")"
"$KVLM" serve Qwen/Qwen3-8B >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "is not a local path: kvlm does not download models. Fetch it first, e.g. .huggingface-cli download Qwen/Qwen3-8B" "$tmp/err" && ok \
  || bad "serve a Hub id: $(cat "$tmp/err")"
"$KVLM" serve "$model" --model "$tmp" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "two models given" "$tmp/err" && ok || bad "two models: $(cat "$tmp/err")"
"$KVLM" serve "$model" --chat-template no-such-file.jinja >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "neither a file nor a Jinja template" "$tmp/err" && ok || bad "--chat-template missing: $(cat "$tmp/err")"
"$KVLM" serve "$model" --chat-template '{% for m in messages %}{{ m.content }}' >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "chat-template" "$tmp/err" && ! grep -q "listening on" "$tmp/err" && ok \
  || bad "--chat-template with a syntax error: $(cat "$tmp/err")"
"$KVLM" serve "$model" --generation-config "$tmp" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "generation-config: .* is not auto, vllm, or a directory holding generation_config.json" "$tmp/err" \
  && ok || bad "--generation-config without the file: $(cat "$tmp/err")"
"$KVLM" serve "$model" --allowed-origins '["x", 3]' >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "allowed-origins: every origin must be a non-empty string" "$tmp/err" && ok \
  || bad "--allowed-origins bad: $(cat "$tmp/err")"
"$KVLM" serve "$model" --quantization awq >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "invalid --quantization 'awq'" "$tmp/err" && ! grep -q "listening on" "$tmp/err" && ok \
  || bad "--quantization awq before listening: $(cat "$tmp/err")"
"$KVLM" serve "$model" --header-timeout 0 >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "header-timeout must be at least 1 second" "$tmp/err" && ok || bad "--header-timeout 0: $(cat "$tmp/err")"
"$KVLM" serve "$model" --tokenizer "$tmp" >/dev/null 2>"$tmp/err"
[ $? -eq 1 ] && grep -q "tokenizer '.*' has no tokenizer.json" "$tmp/err" && ok || bad "--tokenizer without one: $(cat "$tmp/err")"
# The accepted ones, on a server started as vLLM's would be: positional MODEL, --seed,
# --chat-template (a string), --tokenizer, --generation-config DIR, --allowed-origins (JSON),
# --uvicorn-log-level, and --swap-space / --tensor-parallel-size 1 (nothing to do: a warning).
mkdir -p "$tmp/gc" && echo '{"do_sample": true, "temperature": 0.0}' >"$tmp/gc/generation_config.json"
python3 - "$KVLM" "$model" "$here" "$tmp/gc" >"$tmp/vf.out" 2>&1 <<'EOF2' && ok || bad "vLLM flags: $(cat "$tmp/vf.out")"
import json, sys, urllib.request, urllib.error
sys.path.insert(0, sys.argv[3])
import serverlib
kvlm, model, gc = sys.argv[1], sys.argv[2], sys.argv[4]
tpl = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"

def start(*extra):
    return serverlib.Server(kvlm, model, *extra, positional=True)

def sample(s, n=2):
    outs = []
    for _ in range(n):
        st, body = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0})
        assert st == 200, body
        outs.append(json.loads(body)["choices"][0]["text"])
    return outs

common = ["--max-model-len", "256", "--seed", "7", "--swap-space", "4", "--tensor-parallel-size", "1",
          "--uvicorn-log-level", "warning", "--disable-log-requests"]
s = start(*common, "--chat-template", tpl, "--tokenizer", model, "--allowed-origins", '["http://a.example"]')
try:
    assert any("--swap-space is ignored" in l for l in s.log), s.log
    st, body = s.get("/v1/models")
    assert st == 200 and json.loads(body)["data"][0]["id"] == "tiny-chat", body
    first = sample(s)
    # The template given on the command line renders the messages.
    st, body = s.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    ids = json.loads(body)["tokens"]
    st, body = s.post("/detokenize", {"tokens": ids})
    assert json.loads(body)["prompt"] == "<<user>>hi\n<<assistant>>", body
    # CORS: the allowed origin is echoed, another gets nothing; preflights.
    def raw(method, origin, extra=None):
        req = urllib.request.Request(s.base + "/v1/models", method=method,
                                     headers={"Origin": origin, **(extra or {})})
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers)
    st, h = raw("GET", "http://a.example")
    assert st == 200 and h.get("Access-Control-Allow-Origin") == "http://a.example", h
    st, h = raw("GET", "http://evil.example")
    assert st == 200 and "Access-Control-Allow-Origin" not in h, h
    st, h = raw("OPTIONS", "http://a.example", {"Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers": "authorization, content-type"})
    assert st == 204 and h.get("Access-Control-Allow-Origin") == "http://a.example" and \
        "POST" in h.get("Access-Control-Allow-Methods", "") and "authorization" in h.get("Access-Control-Allow-Headers", ""), (st, h)
    st, h = raw("OPTIONS", "http://evil.example", {"Access-Control-Request-Method": "POST"})
    assert st == 403, (st, h)
finally:
    assert s.stop() == 0
# --seed: the same unseeded requests in the same order sample the same after a restart.
s = start(*common)
try:
    again = sample(s)
    assert again == first, (first, again)
finally:
    s.stop()
# --generation-config DIR: its temperature 0 is the default for requests that give none.
s = start("--max-model-len", "256", "--generation-config", gc, "--disable-log-requests")
try:
    outs = []
    for _ in range(2):
        st, body = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12})
        outs.append(json.loads(body)["choices"][0]["text"])
    st, body = s.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
    assert outs[0] == outs[1] == json.loads(body)["choices"][0]["text"], (outs, body)
finally:
    s.stop()
EOF2

# --no-enable-prefix-caching: a repeated prompt is computed again.
"$KVLM" serve --model "$model" --port 0 --max-model-len 256 --no-enable-prefix-caching >"$tmp/n.out" 2>"$tmp/n.err" &
server_pid=$!
wait_log "$tmp/n.err" "ready: serving"
port=$(grep -so "listening on http://127.0.0.1:[0-9]*" "$tmp/n.err" | grep -o "[0-9]*$")
python3 - "$port" >"$tmp/nm.out" 2>&1 <<'EOF' && ok || bad "--no-enable-prefix-caching: $(cat "$tmp/n.err") $(cat "$tmp/nm.out")"
import json, sys, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
body = json.dumps({"prompt": list(range(10, 90)), "max_tokens": 2}).encode()
for _ in range(2):
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    r = json.loads(urllib.request.urlopen(req).read())
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r
metrics = urllib.request.urlopen(base + "/metrics").read().decode()
assert 'kvlm:prefix_cache_hits_total{model_name="tiny-chat"} 0' in metrics, metrics
EOF
kill -TERM "$server_pid"
wait "$server_pid"
server_pid=""

echo "bench/serve CLI tests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
