"""Helpers shared by the server tests: start `kvlm serve` on loopback, raw HTTP, metrics."""
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request


def model_with_template(model, template, prefix="kvlm-template-"):
    """A temporary model directory: `model`'s files linked, its tokenizer_config.json's chat
    template replaced by the file `template`."""
    work = tempfile.mkdtemp(prefix=prefix)
    for f in os.listdir(model):
        if f != "tokenizer_config.json" and os.path.isfile(os.path.join(model, f)):
            os.symlink(os.path.abspath(os.path.join(model, f)), os.path.join(work, f))
    cfg = json.load(open(os.path.join(model, "tokenizer_config.json")))
    cfg["chat_template"] = open(template).read()
    json.dump(cfg, open(os.path.join(work, "tokenizer_config.json"), "w"))
    return work


class Checks:
    """Named checks that keep going after a failure; report() prints the tally, returns the exit code."""

    def __init__(self):
        self.passed = 0
        self.failures = []

    def check(self, cond, what):
        if cond:
            self.passed += 1
        else:
            self.failures.append(what)
            print("FAIL:", what, flush=True)

    def report(self):
        print(f"{self.passed} checks passed, {len(self.failures)} failed")
        return 1 if self.failures else 0


class Server:
    """`kvlm serve` on 127.0.0.1 with --port 0; the port is read from its startup line."""

    def __init__(self, kvlm, model, *args, env=None, ready_timeout=120, positional=False):
        self.log = []
        full_env = dict(os.environ)
        full_env.pop("KVLM_API_KEY", None)
        if env:
            full_env.update(env)
        # positional: `kvlm serve MODEL`, as `vllm serve MODEL`
        model_args = [model] if positional else ["--model", model]
        self.proc = subprocess.Popen([kvlm, "serve", *model_args, "--port", "0", *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=full_env)
        self._port = None
        self._seen = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        with self._seen:
            self._seen.wait_for(lambda: self._port is not None or self.proc.poll() is not None, timeout=ready_timeout)
        if self._port is None:
            self.proc.kill()
            raise RuntimeError("kvlm serve did not start: " + "".join(self.log))
        self.port = self._port
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + ready_timeout
        while time.time() < deadline:
            status, _ = self.get("/health")
            if status == 200:
                break
            if self.proc.poll() is not None:
                raise RuntimeError("kvlm serve exited: " + "".join(self.log))
            time.sleep(0.05)
        else:
            raise RuntimeError("kvlm serve never became healthy: " + "".join(self.log))

    def _read(self):
        for line in self.proc.stderr:
            with self._seen:
                self.log.append(line)
                m = re.search(r"listening on http://[^:]+:(\d+)", line)
                if m and self._port is None:
                    self._port = int(m.group(1))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def request(self, method, path, body=None, headers=None, raw=None, timeout=60):
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=headers or {})
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return 0, ""

    def get(self, path, headers=None):
        return self.request("GET", path, headers=headers)

    def post(self, path, body=None, headers=None, raw=None):
        return self.request("POST", path, body, headers, raw)

    def metrics(self, headers=None):
        status, text = self.get("/metrics", headers)
        assert status == 200, f"/metrics answered {status}: {text[:300]}"
        return parse_metrics(text)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Signals the server and returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def status_field(self, field):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0

    def rss_kib(self):
        return self.status_field("VmRSS")

    def threads(self):
        return self.status_field("Threads")

    def raw_stream_and_hang_up(self, path, body, read_bytes, headers=None):
        """Sends a request on a raw socket, reads `read_bytes` of the response, closes."""
        payload = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        s = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        s.sendall(head.encode() + b"\r\n" + payload)
        got = b""
        while len(got) < read_bytes:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        s.close()
        return got.decode(errors="replace")


def parse_metrics(text):
    """Prometheus text -> {(name, frozenset(labels without model_name)): value}, checking the format."""
    out = {}
    types = {}
    for line in text.splitlines():
        assert line, "empty line in /metrics"
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (\S+)', line)
        assert m, f"malformed metrics line: {line!r}"
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        assert "model_name" in labels, line
        labels.pop("model_name")
        out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


def metric(m, name, **labels):
    return m.get((name, frozenset(labels.items())), 0.0)


def reasons(m):
    return {r: metric(m, "kvlm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort", "error")}


def parse_sse(body):
    """A complete SSE body -> (list of JSON events, saw [DONE]); checks the framing."""
    events, done = [], False
    assert body.endswith("\n\n"), "stream does not end with a blank line"
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"bad SSE block {block[:80]!r}"
        assert not done, "data after [DONE]"
        payload = block[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done
