#!/usr/bin/env python3
"""Concurrent streaming against `kvlm serve SERVE_ARGS...` with a KV pool small enough to
preempt, standard library only (for machines without PyPI: the GPU machine runs it with
--device cuda --tensor-parallel-size 2). Checks: every stream completes and is well-formed
SSE; temperature-0 outputs equal the same prompts run one at a time on the same server, or
diverge only at a near-tie of the solo run (top-2 log-probability gap under --tie, for bf16
GPUs, whose GEMMs round differently at other batch sizes: the CPU's fp32 runs must be
equal, --tie 0); preemptions happened; no KV page is held afterwards.

usage: concurrent_check.py KVLM MODEL_DIR [--clients N] [--rounds R] -- SERVE_ARGS...
"""
import argparse
import json
import os
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, metric, parse_sse  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("kvlm")
ap.add_argument("model")
ap.add_argument("--clients", type=int, default=48)
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--tie", type=float, default=0.0, help="largest top-2 logprob gap a divergence may happen at")
argv = sys.argv[1:]
cut = argv.index("--") if "--" in argv else len(argv)
args = ap.parse_args(argv[:cut])
args.serve_args = argv[cut + 1:]

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing about rivers and old stone bridges".split()


def prompt(i):
    n = 4 + (i * 7) % 40
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def body(i, stream):
    return {"model": "m", "prompt": prompt(i), "max_tokens": 8 + (i * 5) % 40, "temperature": 0, "ignore_eos": True,
            "stream": stream, "logprobs": 2}


def stream_one(srv, i, out, errors):
    try:
        req = urllib.request.Request(srv.base + "/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps(body(i, True)).encode())
        with urllib.request.urlopen(req, timeout=600) as r:
            raw = r.read().decode()
        events, done = parse_sse(raw)  # asserts the framing
        if not done:
            raise ValueError(f"stream {i} did not end with [DONE]")
        toks, reason = [], None
        for e in events:
            c = e["choices"][0]
            toks += (c.get("logprobs") or {}).get("tokens", [])
            reason = c.get("finish_reason") or reason
        if reason != "length":
            raise ValueError(f"stream {i} finished with {reason}")
        out[i] = toks
    except Exception as e:  # noqa: BLE001
        errors.append(f"client {i}: {e}")


srv = Server(args.kvlm, args.model, "--served-model-name", "m", *args.serve_args)
ok = True
try:
    n = args.clients
    refs = {}
    for i in range(n):
        st, b = srv.post("/v1/completions", body(i, False))
        assert st == 200, b
        refs[i] = json.loads(b)["choices"][0]["logprobs"]  # tokens, top_logprobs
    m0 = srv.metrics()
    for rnd in range(args.rounds):
        out, errors = {}, []
        threads = [threading.Thread(target=stream_one, args=(srv, i, out, errors)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            ok = False
            print("FAIL:", errors[:5], file=sys.stderr)
        bad, ties = [], []
        for i in range(n):
            got, ref = out.get(i), refs[i]["tokens"]
            if got == ref:
                continue
            j = next((k for k in range(min(len(got or []), len(ref))) if got[k] != ref[k]), None)
            top = sorted(refs[i]["top_logprobs"][j].values(), reverse=True) if j is not None else []
            if len(top) >= 2 and top[0] - top[1] <= args.tie:
                ties.append(i)
            else:
                bad.append(i)
                print(f"FAIL: round {rnd}: client {i} diverges from its solo run at token {j}: {got!r} vs {ref!r} "
                      f"(solo top-2 logprobs {top})", file=sys.stderr)
        ok &= not bad
        print(f"round {rnd}: {len(out)}/{n} streams complete, {n - len(bad) - len(ties)}/{n} equal to the solo runs, "
              f"{len(ties)} diverging at a near-tie (gap <= {args.tie}), {len(bad)} otherwise")
    m1 = srv.metrics()
    preempted = metric(m1, "kvlm:num_preemptions_total") - metric(m0, "kvlm:num_preemptions_total")
    held = metric(m1, "kvlm:kv_cache_usage_perc")
    print(f"preemptions: {preempted:.0f}, KV cache usage afterwards: {held}")
    if preempted <= 0:
        ok = False
        print("FAIL: no preemption: the pool was not small enough to test it", file=sys.stderr)
    if held != 0:
        ok = False
        print("FAIL: KV pages still held after every request finished", file=sys.stderr)
finally:
    srv.stop()
print("concurrent check:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
