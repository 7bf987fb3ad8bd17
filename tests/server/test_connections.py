"""The connection layer of `kvlm serve` against raw sockets: pipelined requests answered in
order, the cap on requests in progress (503 + Retry-After), header and body deadlines
(slowloris), idle keep-alive connections closed, and the access log / stats lines.
usage: python3 test_connections.py KVLM MODEL"""
import json
import re
import resource
import socket
import sys
import time
import os

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server, metric  # noqa: E402

KVLM, MODEL = sys.argv[1], sys.argv[2]
failures = []
passed = 0


def check(cond, what):
    global passed
    if cond:
        passed += 1
    else:
        failures.append(what)
        print("FAIL:", what, flush=True)


def read_responses(sock, count, timeout=10):
    """Reads `count` HTTP/1.1 responses (Content-Length bodies) from `sock`: [(status, headers, body)]."""
    sock.settimeout(timeout)
    buf = b""
    out = []
    deadline = time.time() + timeout
    while len(out) < count and time.time() < deadline:
        head_end = buf.find(b"\r\n\r\n")
        if head_end >= 0:
            head = buf[:head_end].decode()
            lines = head.split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
            n = int(headers.get("content-length", "0"))
            if len(buf) >= head_end + 4 + n:
                out.append((int(lines[0].split()[1]), headers, buf[head_end + 4:head_end + 4 + n].decode()))
                buf = buf[head_end + 4 + n:]
                continue
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        buf += chunk
    return out


def get_health(port, timeout=10):
    """A fresh connection's GET /health: (status, seconds taken); status 0 when it failed."""
    t0 = time.time()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        r = read_responses(s, 1, timeout)
        s.close()
        return (r[0][0] if r else 0), time.time() - t0
    except OSError:
        return 0, time.time() - t0


def request(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else b""
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


# --- pipelining, keep-alive, the cap, body deadline, idle timeout, access log, stats ---------
srv = Server(KVLM, MODEL, "--max-model-len", "256", "--max-connections", "2", "--read-timeout", "2",
             "--keep-alive-timeout", "2", "--log-stats-interval", "1")
try:
    # Three requests in one write: three answers, in order, on the one connection.
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.sendall(request("GET", "/health") + request("POST", "/tokenize", {"prompt": "Hello there"}) +
              request("GET", "/v1/models"))
    rs = read_responses(s, 3)
    check([r[0] for r in rs] == [200, 200, 200], f"pipelined statuses: {[r[:2] for r in rs]}")
    check(len(rs) == 3 and '"count"' in rs[1][2] and '"data"' in rs[2][2], f"pipelined bodies in order: {rs}")
    # The connection stays usable afterwards (kept alive, handed back to the poller).
    s.sendall(request("POST", "/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0}))
    rs = read_responses(s, 1)
    check(rs and rs[0][0] == 200 and '"completion_tokens":3' in rs[0][2].replace(" ", ""), f"keep-alive reuse: {rs}")
    # Idle longer than --keep-alive-timeout 2: the server closes it.
    t0 = time.time()
    s.settimeout(8)
    try:
        eof = s.recv(1) == b""
    except OSError:
        eof = True
    check(eof and 1.5 < time.time() - t0 < 6, f"idle keep-alive closed after {time.time() - t0:.1f} s")
    s.close()

    # A body that cannot be read (bad gzip): 400, and the connection closes, so what follows is
    # not taken for a next request.
    c = socket.create_connection(("127.0.0.1", srv.port))
    c.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\n0123456789"
              b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    rs = read_responses(c, 2, 5)
    c.close()
    check(len(rs) == 1 and rs[0][0] == 400 and rs[0][1].get("connection") == "close", f"unreadable body: {rs}")

    # Headers over 64 KiB: 431 at once, before they end.
    c = socket.create_connection(("127.0.0.1", srv.port))
    try:
        c.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 70000)
    except OSError:
        pass
    rs = read_responses(c, 1, 5)
    c.close()
    check(rs and rs[0][0] == 431 and "larger than 65536 bytes" in rs[0][2], f"huge headers: {rs}")

    # Small bodies that never come wait in the poller and hold no worker (--max-connections 2):
    # a request that arrives whole is served at once beside them.
    small = []
    for _ in range(2):
        h = socket.create_connection(("127.0.0.1", srv.port))
        h.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        small.append(h)
    time.sleep(0.3)
    st, took = get_health(srv.port)
    check(st == 200 and took < 1.5, f"served beside two slow small bodies: {st} in {took:.2f} s")
    # Bodies over 32 KiB are read on a worker, and such requests may hold half of the workers:
    # a second one gets 503 with a JSON error and Retry-After at once, and a request that
    # arrives whole is still served.
    big = []
    for _ in range(2):
        h = socket.create_connection(("127.0.0.1", srv.port))
        h.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                  + b" " * 40000)
        big.append(h)
        time.sleep(0.3)
    t0 = time.time()
    rs = read_responses(big[1], 1, 5)
    check(rs and rs[0][0] == 503 and rs[0][1].get("retry-after") == "1" and time.time() - t0 < 2,
          f"a second large body in progress: {rs}")
    if rs:
        err = json.loads(rs[0][2])["error"]
        check("large request bodies" in err["message"] and err["code"] == "too_many_connections", f"503 body: {err}")
    big[1].close()
    st, took = get_health(srv.port)
    check(st == 200, f"served beside a large body in progress: {st}")
    # The body deadline (--read-timeout 2): 408 and closed, by the poller (small bodies) or by
    # the worker (the large one). A worker frees its slot just before closing, after the 408
    # is out: wait for the close (EOF) before counting on the slot.
    for h in small + big[:1]:
        rs = read_responses(h, 1, 6)
        check(rs and rs[0][0] == 408 and "did not arrive within 2 s" in rs[0][2], f"body deadline: {rs}")
        h.settimeout(5)
        try:
            while h.recv(4096):
                pass
        except socket.timeout:
            check(False, "the holder's connection did not close within 5 s of its 408")
        except ConnectionResetError:
            pass  # closed too (with unread bytes the kernel resets instead)
        h.close()
    st, took = get_health(srv.port)
    check(st == 200, f"served again once the holders are gone: {st}")
    m = srv.metrics()
    check(metric(m, "kvlm:http_responses_total", status="503") >= 1 and metric(m, "kvlm:http_responses_total", status="408") >= 3,
          f"refusals counted in /metrics: { {k: v for k, v in m.items() if k[0] == 'kvlm:http_responses_total'} }")

    # Access log: one line per request a worker answered, with tokens for a generation. The
    # large holder's 408 line is written by its worker and read from the server's stderr by a
    # thread: wait for it, so that it cannot land among the lines this request is checked by.
    deadline = time.time() + 5
    while time.time() < deadline and sum('"POST /v1/completions" 408' in l for l in srv.log) < 1:
        time.sleep(0.05)
    check(sum('"POST /v1/completions" 408' in l for l in srv.log) == 1, f"access log of the 408: {srv.log[-6:]}")
    before = len(srv.log)
    st, _ = srv.post("/v1/completions", {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    time.sleep(0.3)
    lines = [l for l in srv.log[before:] if '"POST /v1/completions"' in l]
    check(st == 200 and len(lines) == 1 and re.match(
        r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z 127\.0\.0\.1:\d+ "POST /v1/completions" 200 prompt_tokens=\d+ '
        r'completion_tokens=4 latency_ms=\d+\.\d$', lines[0].strip()), f"access log line: {lines}")
    st, _ = srv.post("/v1/completions", {"prompt": "x", "max_tokens": -1})
    time.sleep(0.3)
    check(any('"POST /v1/completions" 400 prompt_tokens=- completion_tokens=-' in l for l in srv.log[before:]),
          f"access log of a 400: {srv.log[before:]}")
    # The stats line (--log-stats-interval 1) after that activity.
    deadline = time.time() + 5
    while time.time() < deadline and not any("Avg generation throughput" in l for l in srv.log):
        time.sleep(0.2)
    check(any(re.search(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                        r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%", l) for l in srv.log),
          "stats line: " + "".join(srv.log[-5:]))
finally:
    check(srv.stop() == 0, "server exit code")

# --- --disable-log-requests / --disable-log-stats ---------------------------------------------
srv = Server(KVLM, MODEL, "--max-model-len", "256", "--disable-log-requests", "--disable-log-stats",
             "--log-stats-interval", "1", "--max-connections", "1")
try:
    st, _ = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
    # --max-connections 1: a large body in progress holds the one worker; the next request
    # gets 503 with Retry-After within a second (after its 0.5 s in the queue), not a stall.
    h = socket.create_connection(("127.0.0.1", srv.port))
    h.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b" " * 40000)
    time.sleep(0.3)
    t0 = time.time()
    c = socket.create_connection(("127.0.0.1", srv.port))
    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    rs = read_responses(c, 1, 5)
    c.close()
    check(rs and rs[0][0] == 503 and rs[0][1].get("retry-after") == "1" and time.time() - t0 < 2,
          f"over --max-connections: {rs} after {time.time() - t0:.1f} s")
    if rs:
        err = json.loads(rs[0][2])["error"]
        check("--max-connections" in err["message"] and err["code"] == "too_many_connections", f"503 body: {err}")
    h.close()
    # A request that finds the one worker busy waits (up to 0.5 s) instead of a 503 at once:
    # freed by a holder that gives up, the worker takes it.
    time.sleep(0.5)
    h = socket.create_connection(("127.0.0.1", srv.port))
    h.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b" " * 40000)
    time.sleep(0.3)
    c = socket.create_connection(("127.0.0.1", srv.port))
    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    time.sleep(0.1)
    h.close()
    rs = read_responses(c, 1, 5)
    c.close()
    check(rs and rs[0][0] == 200, f"queued for the worker a holder freed: {rs}")
    # A client that reconnects the moment its answer arrived is never refused by the worker
    # that has not yet let go of it.
    sts = [srv.get("/health")[0] for _ in range(50)]
    check(sts == [200] * 50, f"back-to-back requests on --max-connections 1: {sts}")
    time.sleep(2.5)
    check(st == 200 and not any('"POST /v1/completions"' in l for l in srv.log), "no access log: " + "".join(srv.log))
    check(not any("Avg prompt throughput" in l for l in srv.log), "no stats line: " + "".join(srv.log))
finally:
    check(srv.stop() == 0, "server exit code")

# --- slowloris: 1,100 connections sending a header byte a second ------------------------------
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
N = 1100 if min(hard, 8192) > 1300 else 400
srv = Server(KVLM, MODEL, "--max-model-len", "256", "--header-timeout", "3", "--disable-log-requests")
try:
    slow = []
    for _ in range(N):
        try:
            slow.append(socket.create_connection(("127.0.0.1", srv.port), timeout=5))
        except OSError:
            break
    check(len(slow) == N, f"opened {len(slow)} of {N} slow connections")
    line = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
    worst = 0.0
    ok_during = True
    threads_max = 0
    t_start = time.time()
    for second in range(3):
        for s in slow:
            try:
                s.send(line[second:second + 1])
            except OSError:
                pass
        threads_max = max(threads_max, srv.threads())
        st, took = get_health(srv.port)
        ok_during = ok_during and st == 200
        worst = max(worst, took)
        st, body = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 4, "temperature": 0})
        ok_during = ok_during and st == 200
        time.sleep(max(0, second + 1 - (time.time() - t_start)))
    check(ok_during and worst < 2.0, f"others served while {N} connections dribble headers: worst {worst:.2f} s")
    # No thread per slow connection.
    check(threads_max < 200, f"server threads during the attack: {threads_max}")
    # Past --header-timeout 3 from their first byte, they get 408 and are closed.
    time.sleep(max(0, 3.0 + 1.0 - (time.time() - t_start)))
    closed = timed_out = 0
    for s in slow:
        s.settimeout(3)
        try:
            data = s.recv(4096)
            closed += 1
            timed_out += data.startswith(b"HTTP/1.1 408")
        except OSError:
            pass
        s.close()
    check(closed == len(slow) and timed_out == len(slow), f"slow connections closed: {closed}, with 408: {timed_out} of {len(slow)}")
    st, _ = get_health(srv.port)
    check(st == 200, "healthy after the attack")
finally:
    check(srv.stop() == 0, "server exit code")

print(f"connection tests: {passed} passed, {len(failures)} failed")
sys.exit(1 if failures else 0)
