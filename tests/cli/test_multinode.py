#!/usr/bin/env python3
"""Tensor parallelism over two processes on one host, CPU ranks, through the TCP bootstrap
(--nnodes 2 --node-rank R --distributed-init tcp://127.0.0.1:PORT, or torchrun's variables):

  * generate: the same tokens as one process;
  * serve: node 0 answers, node 1 follows; node 1 killed -> node 0 exits 1 naming it;
    node 0 killed -> node 1 exits 1 saying the leader went away;
  * a node that never arrives: node 0 fails after --distributed-timeout naming it;
  * a node with other options is refused, with both sides' options.

With DEVICE cuda (two GPUs): each node drives its own GPU (cuda:RANK, or LOCAL_RANK with
torchrun's variables) and the ranks sum through NCCL; the reference is one process with
-tp 2 (the same sums), and a node's death reaches the other through the watcher thread and
ncclCommAbort.

usage: test_multinode.py KVLM MODEL_DIR [cpu|cuda]
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

kvlm, model = sys.argv[1], sys.argv[2]
device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GEN = ["--prompt", "Once upon a time", "--max-tokens", "12", "--temperature", "0", "--ignore-eos"]


def dev(rank):
    return ["--device", "cpu" if device == "cpu" else f"cuda:{rank}"]


def node(cmd, rank, init, *extra, env=None):
    return subprocess.Popen([kvlm, cmd, "--model", model, "-tp", "2", "--nnodes", "2", "--node-rank", str(rank),
                             "--distributed-init", init, *dev(rank), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(p, timeout=60):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return None, out, err
    return p.returncode, out, err


ref = ["--device", "cpu"] if device == "cpu" else ["--device", "cuda", "-tp", "2"]
one = subprocess.run([kvlm, "generate", "--model", model, *ref, *GEN], capture_output=True, text=True, timeout=120)
check(one.returncode == 0 and one.stdout.strip(), f"one process: {one.stderr}")

# generate over two processes, flags; then torchrun's variables
init = f"tcp://127.0.0.1:{free_port()}"
n1 = node("generate", 1, init, *GEN)
n0 = node("generate", 0, init, *GEN)
rc0, out0, err0 = finish(n0)
rc1, out1, err1 = finish(n1)
check(rc0 == 0 and rc1 == 0, f"two processes exit 0: {rc0} {rc1}: {err0} {err1}")
check(out0 == one.stdout, f"two processes' tokens == one process's: {out0!r} vs {one.stdout!r}")
check(out1 == "", f"node 1 prints nothing on stdout: {out1!r}")

port = free_port()
procs = []
for rank in (1, 0):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
               LOCAL_RANK=str(rank))
    procs.append(subprocess.Popen([kvlm, "generate", "--model", model, "-tp", "2", "--device", device, *GEN],
                                  stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env))
r1, r0 = finish(procs[0]), finish(procs[1])
check(r0[0] == 0 and r1[0] == 0 and r0[1] == one.stdout, f"torchrun variables: {r0} {r1}")

# a node that never arrives
init = f"tcp://127.0.0.1:{free_port()}"
t0 = time.time()
rc, out, err = finish(node("generate", 0, init, *GEN, "--distributed-timeout", "2"))
check(rc == 1 and "node(s) 1 did not connect to " + init + " within 2 s" in err and time.time() - t0 < 30,
      f"missing node: {rc} {err}")

# a node with other options
init = f"tcp://127.0.0.1:{free_port()}"
n1 = node("generate", 1, init, *GEN, "--kv-cache-dtype", "fp8")
n0 = node("generate", 0, init, *GEN)
rc0, _, err0 = finish(n0)
rc1, _, err1 = finish(n1)
check(rc0 == 1 and "node 1 runs other options" in err0, f"mismatch, node 0: {rc0} {err0}")
check(rc1 == 1 and "node 0 refused this node" in err1, f"mismatch, node 1: {rc1} {err1}")

# serve: node 0 answers, node 1 follows; then each dies in turn


def serve_pair():
    init = f"tcp://127.0.0.1:{free_port()}"
    http = free_port()
    n1 = node("serve", 1, init, "--max-model-len", "256")
    n0 = node("serve", 0, init, "--max-model-len", "256", "--port", str(http))
    url = f"http://127.0.0.1:{http}"
    for _ in range(300):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                break
        except OSError:
            time.sleep(0.1)
    return n0, n1, url


def complete(url):
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                                                  "ignore_eos": True}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["text"]


n0, n1, url = serve_pair()
try:
    text = complete(url)
    check(text == one.stdout.rstrip("\n"), f"served text == one process's: {text!r} vs {one.stdout!r}")
except OSError as e:
    check(False, f"serve over two nodes: {e}")
n1.kill()
try:
    complete(url)
except OSError:
    pass
rc0, _, err0 = finish(n0, 30)
check(rc0 == 1 and "node 1" in err0 and "stopping the server" in err0, f"node 1 killed: node 0 {rc0}: {err0[-600:]}")
finish(n1, 5)

n0, n1, url = serve_pair()
try:
    complete(url)
except OSError as e:
    check(False, f"serve over two nodes (2): {e}")
n0.kill()
rc1, _, err1 = finish(n1, 30)
check(rc1 == 1 and "node 0 (the leader) closed the connection before telling this node to stop" in err1,
      f"node 0 killed: node 1 {rc1}: {err1[-600:]}")
finish(n0, 5)

print(f"multinode: {len(failures)} failure(s)")
sys.exit(1 if failures else 0)
