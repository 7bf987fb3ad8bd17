"""Load test of `kvlm serve` (loopback, bounded): rounds of CLIENTS concurrent streaming
clients with mixed prompt lengths against a KV pool small enough that the scheduler must
preempt. Checks: every request completes; every stream is well-formed (strict SSE framing
on raw connections, the openai client's parser on the others); temperature-0 outputs equal
the same prompts run one at a time; the server's RSS and malloc'd bytes do not grow across
rounds; /metrics counters add up; preemptions happened; no KV page is held once every request
is done.

--aborts N adds N clients per round that disconnect after their first streamed chunk (the
server aborts them; the others must not notice). --speculative-config JSON serves with
speculative decoding (the value "dflash-random" makes a random one-layer DFlash drafter for
the model): the one-at-a-time references then come from a server without drafting, so the
concurrent drafted outputs are checked against plain decoding, and drafts must have happened.

The server runs with glibc's per-thread caches off (GLIBC_TUNABLES=glibc.malloc.tcache_count=0):
with ~200 connection threads each keeping a few hundred KiB of freed chunks, RSS and "heap in
use" creep up for a dozen rounds before they level off, which would hide a real leak of a
kilobyte per request. Without them both are flat, so a small slack catches one.

usage: python load_test.py KVLM_BINARY MODEL_DIR [--clients N] [--rounds R] [--aborts N]
                           [--speculative-config JSON | dflash-random]
"""
import argparse
import array
import asyncio
import json
import os
import random
import struct
import sys
import tempfile
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, metric, parse_sse, reasons  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("kvlm")
ap.add_argument("model")
ap.add_argument("--clients", type=int, default=200)
ap.add_argument("--rounds", type=int, default=4, help="the first warms up; RSS is compared between the second and the last")
ap.add_argument("--prompts", type=int, default=50, help="distinct prompts (each used by several clients)")
ap.add_argument("--kv-cache-memory", default="1MiB")
ap.add_argument("--rss-slack-kib", type=int, default=8192)
ap.add_argument("--heap-slack-kib", type=int, default=512)
ap.add_argument("--aborts", type=int, default=0, help="clients per round that disconnect after the first chunk")
ap.add_argument("--speculative-config", default="", help='JSON, or "dflash-random"')
args = ap.parse_args()

NAME = "tiny-chat"
MAX_LEN = 512
rng = random.Random(20240601)


def make_prompts():
    """Mixed lengths: short, medium and long token-id prompts, plus chat and text prompts."""
    prompts = []
    for i in range(args.prompts):
        kind = i % 5
        out_len = rng.randint(8, 48)
        if kind == 4:
            words = " ".join(rng.choice(["the", "cat", "robot", "sings", "under", "a", "green", "moon", "quietly"])
                             for _ in range(rng.randint(3, 40)))
            prompts.append({"chat": True, "messages": [{"role": "user", "content": words}], "max_tokens": out_len})
        elif kind == 3:
            prompts.append({"chat": False, "prompt": "Once upon a time " * rng.randint(1, 20), "max_tokens": out_len})
        else:
            n = rng.choice([rng.randint(4, 32), rng.randint(33, 160), rng.randint(161, 400)])
            prompts.append({"chat": False, "prompt": [rng.randint(3, 1000) for _ in range(n)], "max_tokens": out_len})
    return prompts


def write_random_drafter(model_dir, out_dir, block=4):
    """A random DFlash drafter (DFlashDraftModel, one Qwen3 layer) for the model in model_dir:
    config.json and fp32 safetensors written by hand (no numpy here); features of layer 0."""
    with open(os.path.join(model_dir, "config.json")) as f:
        t = json.load(f)
    h, nh, kvh = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    d = t.get("head_dim", h // nh)
    inter = 2 * h
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": nh,
           "num_key_value_heads": kvh, "head_dim": d, "vocab_size": t["vocab_size"],
           "max_position_embeddings": t["max_position_embeddings"], "rms_norm_eps": 1e-6,
           "rope_theta": t.get("rope_theta", 10000.0), "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": "float32", "block_size": block, "num_target_layers": t["num_hidden_layers"],
           "dflash_config": {"mask_token_id": 3, "target_layer_ids": [0]}}
    shapes = {"fc.weight": [h, h], "hidden_norm.weight": [h], "norm.weight": [h],
              "layers.0.input_layernorm.weight": [h], "layers.0.post_attention_layernorm.weight": [h],
              "layers.0.self_attn.q_proj.weight": [nh * d, h], "layers.0.self_attn.k_proj.weight": [kvh * d, h],
              "layers.0.self_attn.v_proj.weight": [kvh * d, h], "layers.0.self_attn.o_proj.weight": [h, nh * d],
              "layers.0.self_attn.q_norm.weight": [d], "layers.0.self_attn.k_norm.weight": [d],
              "layers.0.mlp.gate_proj.weight": [inter, h], "layers.0.mlp.up_proj.weight": [inter, h],
              "layers.0.mlp.down_proj.weight": [h, inter]}
    g = random.Random(7)
    header, blobs, off = {}, [], 0
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        norm = len(shape) == 1
        data = array.array("f", (1.0 + 0.1 * g.gauss(0, 1) if norm else 0.1 * g.gauss(0, 1) for _ in range(n))).tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return {"method": "dflash", "model": out_dir, "num_speculative_tokens": block - 1}


async def abort_stream(port, path, body):
    """A streaming request whose client disconnects after the first chunk of its body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(dict(body, max_tokens=300, stream=True)).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:40]
    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
    await reader.readexactly(size + 2)
    writer.close()


def request_body(p, stream):
    body = {"model": NAME, "temperature": 0, "max_tokens": p["max_tokens"], "ignore_eos": True}
    if p["chat"]:
        body["messages"] = p["messages"]
    else:
        body["prompt"] = p["prompt"]
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def raw_stream(port, path, body):
    """One streaming request on its own connection, decoded by hand: status line, headers,
    chunked transfer, and strict SSE framing (parse_sse)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    assert status_line.startswith("HTTP/1.1 200"), status_line
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines if h)}
    assert headers.get("content-type", "").startswith("text/event-stream"), headers
    assert headers.get("transfer-encoding") == "chunked", headers
    body_bytes = b""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        chunk = await reader.readexactly(size + 2)
        assert chunk.endswith(b"\r\n"), "bad chunk terminator"
        if size == 0:
            break
        body_bytes += chunk[:-2]
    writer.close()
    events, done = parse_sse(body_bytes.decode())
    assert done, "the stream did not end with data: [DONE]"
    chat = "chat" in path
    text, finishes, usage = "", [], None
    for i, ev in enumerate(events):
        assert ev["object"] == ("chat.completion.chunk" if chat else "text_completion"), ev
        assert ev["id"] == events[0]["id"]
        if ev.get("usage"):
            assert i == len(events) - 1 and ev["choices"] == [], "the usage chunk comes last"
            usage = ev["usage"]
            continue
        for c in ev["choices"]:
            assert c["index"] == 0
            if chat:
                text += c["delta"].get("content") or ""
            else:
                text += c["text"]
            if c["finish_reason"] is not None:
                finishes.append(c["finish_reason"])
    assert finishes == ["length"], finishes
    assert usage is not None
    return text, usage


async def client_stream(client, body):
    """One streaming request through the openai client."""
    chat = "messages" in body
    extra = {"ignore_eos": True}
    kw = dict(model=NAME, temperature=0, max_tokens=body["max_tokens"], stream=True,
              stream_options={"include_usage": True}, extra_body=extra)
    if chat:
        s = await client.chat.completions.create(messages=body["messages"], **kw)
    else:
        s = await client.completions.create(prompt=body["prompt"], **kw)
    text, finishes, usage = "", [], None
    async for ch in s:
        if ch.usage is not None:
            usage = ch.usage.model_dump()
        for c in ch.choices:
            text += (c.delta.content or "") if chat else c.text
            if c.finish_reason is not None:
                finishes.append(c.finish_reason)
    assert finishes == ["length"], finishes
    assert usage is not None
    return text, usage


async def run_round(srv, client, prompts, refs, round_no):
    jobs = []
    for i in range(args.clients):
        p = prompts[i % len(prompts)]
        jobs.append((i, p))
    rng.shuffle(jobs)

    async def one(i, p):
        body = request_body(p, True)
        path = "/v1/chat/completions" if p["chat"] else "/v1/completions"
        if i % 4 == 0:
            return i, p, await raw_stream(srv.port, path, body)
        return i, p, await client_stream(client, body)

    short = [p for p in prompts if not p["chat"] and isinstance(p["prompt"], list) and len(p["prompt"]) <= 160]

    async def aborter(i):  # a prompt that leaves room for 300 tokens, which it never waits for
        p = short[(7 * i + round_no) % len(short)]
        await abort_stream(srv.port, "/v1/completions", request_body(p, True))
        return None

    t0 = time.time()
    results = await asyncio.gather(*(one(i, p) for i, p in jobs), *(aborter(i) for i in range(args.aborts)),
                                   return_exceptions=True)
    dt = time.time() - t0
    failures, mismatches, prompt_tokens, completion_tokens = [], 0, 0, 0
    for r in results:
        if r is None:  # an aborting client
            continue
        if isinstance(r, BaseException):
            failures.append(repr(r))
            continue
        i, p, (text, usage) = r
        ref_text, ref_usage = refs[id(p)]
        if text != ref_text:
            mismatches += 1
            if mismatches <= 3:
                print(f"  mismatch (round {round_no}, client {i}): {text[:80]!r} vs one-at-a-time {ref_text[:80]!r}")
        assert usage["completion_tokens"] == p["max_tokens"], usage
        assert usage["prompt_tokens"] == ref_usage["prompt_tokens"], (usage, ref_usage)
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
    return dt, failures, mismatches, prompt_tokens, completion_tokens


def references(srv, prompts):
    """Each prompt alone, non-streaming, one at a time."""
    refs = {}
    for p in prompts:
        body = request_body(p, False)
        path = "/v1/chat/completions" if p["chat"] else "/v1/completions"
        status, text = srv.post(path, body)
        assert status == 200, text
        j = json.loads(text)
        c = j["choices"][0]
        refs[id(p)] = (c["message"]["content"] if p["chat"] else c["text"], j["usage"])
    return refs


def settle(srv, timeout=60):
    """Metrics once nothing runs or waits (an aborted request ends when the server notices)."""
    end = time.time() + timeout
    while True:
        m = srv.metrics()
        if (metric(m, "kvlm:num_requests_running") == 0 and metric(m, "kvlm:num_requests_waiting") == 0) or time.time() > end:
            return m
        time.sleep(0.05)


async def main_async():
    common = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory", args.kv_cache_memory, "--served-model-name", NAME,
              "--max-num-batched-tokens", "1024"]
    env = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    prompts = make_prompts()
    spec, tmp = args.speculative_config, None
    if spec:
        if spec == "dflash-random":
            tmp = tempfile.TemporaryDirectory(prefix="kvlm-load-drafter-")
            spec = json.dumps(write_random_drafter(args.model, tmp.name))
        plain = Server(args.kvlm, args.model, *common, env=env)
        try:
            refs = references(plain, prompts)
        finally:
            plain.stop()
        common += ["--speculative-config", spec]
        print(f"speculative decoding: {spec} (references from a server without it)")
    srv = Server(args.kvlm, args.model, *common, env=env)
    capacity = next((line.strip() for line in srv.log if "pages x" in line), "?")
    print(f"server: {capacity}")
    client = openai.AsyncOpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=600)
    ok = True
    try:
        if not spec:
            refs = references(srv, prompts)
        m0 = srv.metrics()
        rss, heap = [], []
        totals = {"prompt": 0, "completion": 0, "requests": 0, "failures": 0, "mismatches": 0}
        for r in range(args.rounds):
            dt, failures, mismatches, pt, ct = await run_round(srv, client, prompts, refs, r)
            if args.aborts:  # the server ends an aborted request (and its connection) when it notices
                settle(srv)
                await asyncio.sleep(0.5)
            rss.append(srv.rss_kib())
            totals["prompt"] += pt
            totals["completion"] += ct
            totals["requests"] += args.clients
            totals["failures"] += len(failures)
            totals["mismatches"] += mismatches
            m = srv.metrics()
            heap.append(metric(m, "kvlm:heap_in_use_bytes") / 1024)  # after the round, its aborts included
            print(f"round {r}: {args.clients} clients in {dt:.1f} s, {ct} tokens out, failures {len(failures)}, "
                  f"mismatches {mismatches}, preemptions so far {int(metric(m, 'kvlm:num_preemptions_total'))}, "
                  f"RSS {rss[-1] / 1024:.1f} MiB, heap in use {metric(m, 'kvlm:heap_in_use_bytes') / 2**20:.2f} MiB, "
                  f"{srv.threads()} threads")
            for f in failures[:5]:
                print("  failure:", f)
        m1 = settle(srv)

        def d(name, **labels):
            return metric(m1, name, **labels) - metric(m0, name, **labels)

        checks = []
        checks.append(("every request completed", totals["failures"] == 0))
        checks.append(("temperature-0 outputs equal one-at-a-time outputs", totals["mismatches"] == 0))
        checks.append(("preemptions happened", d("kvlm:num_preemptions_total") > 0))
        aborted = d("kvlm:request_success_total", finished_reason="abort")
        checks.append((f"request_success_total{{length}} + {{abort}} == requests + aborting clients ({int(aborted)} aborted)",
                       d("kvlm:request_success_total", finished_reason="length") + aborted
                       == totals["requests"] + args.rounds * args.aborts))
        checks.append(("aborts only from the aborting clients" if args.aborts else "no aborts",
                       (aborted >= 1) if args.aborts else aborted == 0))
        checks.append(("no errors", d("kvlm:request_success_total", finished_reason="error") == 0))
        checks.append(("no KV page held afterwards", metric(m1, "kvlm:kv_cache_usage_perc") == 0
                       and metric(m1, "kvlm:kv_cache_free_blocks") == metric(m1, "kvlm:kv_cache_blocks")))
        if spec:
            drafts = d("kvlm:spec_decode_num_drafts_total")
            accepted = d("kvlm:spec_decode_num_accepted_tokens_total")
            checks.append((f"drafts verified ({int(drafts)} drafts, {int(accepted)} tokens accepted)", drafts > 0))
        if not args.aborts:  # an aborted request's tokens and prompt count too
            checks.append(("generation_tokens_total == sum of completion_tokens",
                           d("kvlm:generation_tokens_total") == totals["completion"]))
            checks.append(("prefix_cache_queries_total == sum of prompt_tokens",
                           d("kvlm:prefix_cache_queries_total") == totals["prompt"]))
        checks.append(("prompt_tokens_total + prefix_cache_hits_total == queries",
                       d("kvlm:prompt_tokens_total") + d("kvlm:prefix_cache_hits_total") == d("kvlm:prefix_cache_queries_total")))
        every = totals["requests"] + args.rounds * args.aborts
        checks.append(("time_to_first_token count == requests", d("kvlm:time_to_first_token_seconds_count") == every))
        checks.append(("e2e latency count == requests", d("kvlm:e2e_request_latency_seconds_count") == every))
        checks.append(("nothing running or waiting afterwards", metric(m1, "kvlm:num_requests_running") == 0
                       and metric(m1, "kvlm:num_requests_waiting") == 0))
        checks.append(("finished requests add up to accepted", sum(reasons(m1).values()) == metric(m1, "kvlm:requests_total")))
        growth = rss[-1] - rss[1] if len(rss) > 2 else 0
        checks.append((f"RSS does not grow (after round 1: {rss[1] / 1024:.1f} MiB, after round {len(rss) - 1}: "
                       f"{rss[-1] / 1024:.1f} MiB, +{growth} KiB)", growth <= args.rss_slack_kib))
        heap_growth = heap[-1] - heap[1] if len(heap) > 2 else 0
        checks.append((f"malloc'd bytes do not grow (after round 1: {heap[1]:.0f} KiB, after round {len(heap) - 1}: "
                       f"{heap[-1]:.0f} KiB, {heap_growth:+.0f} KiB)", heap_growth <= args.heap_slack_kib))
        print(f"summary: {totals['requests']} requests from {args.clients} concurrent clients x {args.rounds} rounds, "
              f"{int(d('kvlm:num_preemptions_total'))} preemptions, {totals['failures']} failures, "
              f"RSS {rss[0] / 1024:.1f} -> {rss[-1] / 1024:.1f} MiB")
        for name, good in checks:
            print(f"{'PASS' if good else 'FAIL'} {name}")
            ok = ok and good
    finally:
        await client.close()
        rc = srv.stop()
        print(f"{'PASS' if rc == 0 else 'FAIL'} SIGTERM exit code {rc}")
        ok = ok and rc == 0
        if tmp:
            tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main_async()))
