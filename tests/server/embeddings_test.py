"""/v1/embeddings end to end with the official `openai` client.

1. The golden embedding model (tests/golden/embed: Qwen3-Embedding's layout, last-token pooling
   from modules.json, Matryoshka) served with --runner auto and an fp32 KV cache: the vectors
   equal transformers' (expected.json) for token-id inputs, batched, with `dimensions`, in
   base64, through prefix-cache hits, with truncate_prompt_tokens; the errors (a generation
   endpoint, a bad `dimensions`, an empty or over-long input, a bad encoding_format).
2. The bundled model served with --runner pooling and text inputs: unit vectors of its hidden
   size, the same text the same vector, mean pooling nowhere declared so last token; and a
   generative server refuses /v1/embeddings.

usage: python embeddings_test.py KVLM_BINARY GOLDEN_EMBED_DIR BUNDLED_MODEL_DIR
"""
import base64
import json
import math
import os
import struct
import sys

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Checks, Server, metric  # noqa: E402

KVLM, GOLDEN, BUNDLED = sys.argv[1], sys.argv[2], sys.argv[3]
checks = Checks()
check = checks.check


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def expect_error(call, status, text, what):
    try:
        call()
    except openai.APIStatusError as e:
        body = e.response.json()["error"]
        check(e.status_code == status and text in body["message"], f"{what}: {e.status_code} {body['message']}")
        return
    check(False, f"{what}: no error")


golden = json.load(open(os.path.join(GOLDEN, "expected.json")))
inputs = [g["ids"] for g in golden["inputs"]]

srv = Server(KVLM, os.path.join(GOLDEN, "model"), "--dtype", "float32", "--max-model-len", "64")
try:
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
    name = client.models.list().data[0].id
    check(any("embedding model (--runner pooling)" in line for line in srv.log), "startup line names the runner")

    r = client.embeddings.create(model=name, input=inputs)
    check(len(r.data) == len(inputs) and [d.index for d in r.data] == list(range(len(inputs))), "one vector per input, in order")
    for i, d in enumerate(r.data):
        check(max_diff(d.embedding, golden["inputs"][i]["last"]) < 1e-4,
              f"input {i}: equals transformers' (max diff {max_diff(d.embedding, golden['inputs'][i]['last']):.2e})")
    check(r.usage.prompt_tokens == sum(len(x) for x in inputs) and r.usage.total_tokens == r.usage.prompt_tokens, "usage")

    # The 40-token input again: its first two pages come from the prefix cache this time.
    hits = metric(srv.metrics(), "kvlm:prefix_cache_hits_total")
    again = client.embeddings.create(model=name, input=inputs[3])
    check(metric(srv.metrics(), "kvlm:prefix_cache_hits_total") - hits == 32, "the repeat hit the prefix cache (2 pages)")
    check(max_diff(again.data[0].embedding, r.data[3].embedding) < 1e-5, "a prefix-cache hit gives the same vector")

    cut = client.embeddings.create(model=name, input=inputs, dimensions=16)
    for i, d in enumerate(cut.data):
        check(len(d.embedding) == 16 and max_diff(d.embedding, golden["inputs"][i]["last16"]) < 1e-4, f"dimensions=16, input {i}")

    raw = srv.post("/v1/embeddings", {"input": inputs[2], "encoding_format": "base64"})
    blob = base64.b64decode(json.loads(raw[1])["data"][0]["embedding"])
    floats = list(struct.unpack(f"<{len(blob) // 4}f", blob))
    alone = client.embeddings.create(model=name, input=inputs[2]).data[0].embedding
    check(len(blob) == 4 * 64 and max_diff(floats, alone) == 0, "base64 is the same float32 vector")

    t = client.embeddings.create(model=name, input=inputs[3], extra_body={"truncate_prompt_tokens": 5})
    tail = client.embeddings.create(model=name, input=inputs[3][-5:])
    check(max_diff(t.data[0].embedding, tail.data[0].embedding) < 1e-6 and t.usage.prompt_tokens == 5,
          "truncate_prompt_tokens keeps the last tokens")
    raw_vec = client.embeddings.create(model=name, input=inputs[1], extra_body={"normalize": False}).data[0].embedding
    check(abs(math.sqrt(sum(x * x for x in raw_vec)) - 1) > 0.1, "normalize: false returns the pooled vector as it is")

    expect_error(lambda: client.completions.create(model=name, prompt=[1, 2, 3]), 400, "embedding model", "completions refused")
    expect_error(lambda: client.embeddings.create(model=name, input=inputs[0], dimensions=65), 400, "between 1 and the model's 64",
                 "dimensions too large")
    expect_error(lambda: client.embeddings.create(model=name, input=[[1, 2], []]), 400, "must not be empty", "empty input")
    expect_error(lambda: client.embeddings.create(model=name, input=list(range(1, 80))), 400, "maximum context length",
                 "over-long input")
    expect_error(lambda: client.embeddings.create(model=name, input=[1, 2], encoding_format="int8"), 400, "encoding_format",
                 "bad encoding_format")
    expect_error(lambda: client.embeddings.create(model=name, input=[1, 300]), 400, "outside the model's vocabulary",
                 "token id out of range")
    expect_error(lambda: client.embeddings.create(model="other", input=[1, 2]), 404, "does not exist", "another model")
    # Bad bodies get the limits every POST route has: malformed JSON, nesting past the depth
    # limit, a body past --max-body (16 MiB): 400, 400, 413.
    st, body = srv.post("/v1/embeddings", raw=b'{"input": [1, 2')
    check(st == 400 and "JSON" in body, f"malformed JSON: {st} {body[:120]}")
    st, body = srv.post("/v1/embeddings", raw=b'{"input": ' + b"[" * 200 + b"1" + b"]" * 200 + b"}")
    check(st == 400, f"deep nesting: {st} {body[:120]}")
    st, body = srv.post("/v1/embeddings", raw=b'{"input": "' + b"a" * (17 << 20) + b'"}')
    check(st == 413, f"a 17 MiB body: {st}")
    status, _ = srv.get("/health")
    check(status == 200, "healthy after the errors")
finally:
    srv.stop()

tiny = Server(KVLM, BUNDLED, "--runner", "pooling")
try:
    client = openai.OpenAI(base_url=tiny.base + "/v1", api_key="none")
    name = client.models.list().data[0].id
    texts = ["The cat sat on the mat.", "Quantized KV caches hold more tokens.", "The cat sat on the mat."]
    r = client.embeddings.create(model=name, input=texts)
    norms = [math.sqrt(sum(x * x for x in d.embedding)) for d in r.data]
    check(all(abs(n - 1) < 1e-4 for n in norms), f"text inputs: unit vectors ({norms})")
    check(max_diff(r.data[0].embedding, r.data[2].embedding) < 1e-6, "the same text, the same vector")
    check(max_diff(r.data[0].embedding, r.data[1].embedding) > 1e-3, "different texts, different vectors")
    expect_error(lambda: client.embeddings.create(model=name, input="x", dimensions=8), 400, "does not support `dimensions`",
                 "dimensions on a model without Matryoshka")
    expect_error(lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}]), 400,
                 "embedding model", "chat refused")
finally:
    tiny.stop()

gen = Server(KVLM, BUNDLED)
try:
    client = openai.OpenAI(base_url=gen.base + "/v1", api_key="none")
    expect_error(lambda: client.embeddings.create(model=client.models.list().data[0].id, input="hello"), 400,
                 "--runner pooling", "a generative server refuses embeddings")
finally:
    gen.stop()

sys.exit(checks.report())
