"""The chat page at GET / in headless Chromium, driven over the DevTools protocol (a pipe, so
nothing but Python's standard library is needed): the page loads with the model's name and
KV plan, a message sent from it streams an answer from /v1/chat/completions, and with
--api-key the page asks for the key and works once it is given. Skipped (77) without
Chromium (Debian's `chromium` package; scripts/install-deps installs it).

usage: python3 chat_page_test.py KVLM_BINARY MODEL_DIR [--screenshot FILE.png]
"""
import base64
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server  # noqa: E402

KVLM, MODEL = sys.argv[1], sys.argv[2]
SHOT = sys.argv[sys.argv.index("--screenshot") + 1] if "--screenshot" in sys.argv else None
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
if not CHROMIUM:
    print("skipped: no chromium on PATH")
    sys.exit(77)


class Browser:
    """Headless Chromium with --remote-debugging-pipe: JSON messages on fds 3 (in) and 4 (out)."""

    def __init__(self):
        self.to_chrome_r, self.to_chrome_w = os.pipe()
        self.from_chrome_r, self.from_chrome_w = os.pipe()
        r, w = self.to_chrome_r, self.from_chrome_w

        def fds():  # in the child: the pipe ends as fds 3 and 4, inheritable (os.pipe's are not)
            a, b = os.dup(r), os.dup(w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-pipe", "--window-size=1280,820", "--user-data-dir=" + os.path.join(WORK, "profile"),
             "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(self.to_chrome_r)
        os.close(self.from_chrome_w)
        self.buf = b""
        self.next_id = 0

    def call(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_chrome_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" in self.buf:
                raw, self.buf = self.buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self.next_id:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            chunk = os.read(self.from_chrome_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self.buf += chunk
        raise RuntimeError(f"{method}: no reply in {timeout} s")

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        return self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def js(self, session, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True}, session)
        return r.get("result", {}).get("value")

    def wait(self, session, expr, timeout=90):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.js(session, expr)
            if v:
                return v
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {expr}")

    def close(self):
        try:
            self.call("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - it may already be gone
            pass
        self.proc.wait(timeout=10)


WORK = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvlm-chat-page-{os.getpid()}")
os.makedirs(WORK, exist_ok=True)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


STATE = "document.body.dataset.state"
ANSWER = "(document.querySelector('.msg.assistant') || {}).textContent || ''"

# --- the page, a streamed answer ---------------------------------------------------------
srv = Server(KVLM, MODEL, "--served-model-name", "kvlm-tiny")
b = Browser()
try:
    s = b.open(srv.base + "/?q=" + "12%2B35%3D")
    b.wait(s, "document.querySelectorAll('#plan tr').length > 1")
    check(b.js(s, "document.getElementById('model').textContent") == "kvlm-tiny", "the model's name is not shown")
    # Consecutive layers with one plan share a row; the rows cover every layer, and the table
    # fits the side panel (no horizontal scrolling).
    layers = b.js(s, "[...document.querySelectorAll('#plan tbody tr')].reduce((n, r) => n + Number(r.dataset.layers), 0)")
    rows = b.js(s, "document.querySelectorAll('#plan tbody tr').length")
    want = len(json.loads(srv.get("/v1/kvlm/plan")[1])["layers"])
    check(layers == want and rows == 1, f"the KV plan covers {layers} layers in {rows} rows; the model has {want}, one plan")
    check(b.js(s, "const p = document.getElementById('plan'); p.scrollWidth <= p.clientWidth"), "the plan table is clipped")
    check("bytes/token" in (b.js(s, "document.getElementById('summary').textContent") or ""), "no KV summary")
    state = b.wait(s, f"['done', 'error'].includes({STATE}) && {STATE}")
    answer = b.js(s, ANSWER)
    log_text = b.js(s, "document.getElementById('log').textContent")
    check(state == "done", f"the message ended in state {state}: {log_text}")
    check(bool(answer and answer.strip()), f"no streamed answer: {answer!r}")
    check("tok/s" in (answer or ""), f"no token count under the answer: {answer!r}")
    # A second turn through the form, with settings changed in the panel.
    b.js(s, "document.getElementById('temperature').value = '0'; document.getElementById('max_tokens').value = '8';"
            "document.getElementById('input').value = 'Once upon a time'; document.getElementById('form').requestSubmit();")
    b.wait(s, f"document.querySelectorAll('.msg.assistant').length == 2 && {STATE} == 'done'")
    second = b.js(s, "document.querySelectorAll('.msg.assistant')[1].textContent")
    check("8 tokens" in second or "finish: stop" in second, f"max_tokens from the panel not applied: {second!r}")
    print("answer:", (answer or "").replace("\n", " ")[:120])
    if SHOT:
        png = base64.b64decode(b.call("Page.captureScreenshot", {"format": "png"}, s)["data"])
        with open(SHOT, "wb") as f:
            f.write(png)
        print(f"screenshot: {SHOT} ({len(png)} bytes)")
finally:
    b.close()
    srv.stop()

# --- a server with an API key: the page asks for it --------------------------------------
srv = Server(KVLM, MODEL, "--api-key", "page-key")
b = Browser()
try:
    s = b.open(srv.base + "/")
    b.wait(s, "!document.getElementById('keybox').classList.contains('hidden')", timeout=30)
    b.js(s, "const k = document.getElementById('key'); k.value = 'page-key'; k.dispatchEvent(new Event('change'));")
    b.wait(s, "document.querySelectorAll('#plan tr').length > 1", timeout=30)
    b.js(s, "document.getElementById('input').value = 'Hi'; document.getElementById('form').requestSubmit();")
    state = b.wait(s, f"['done', 'error'].includes({STATE}) && {STATE}")
    check(state == "done", f"with the key entered the message ended in {state}")
finally:
    b.close()
    srv.stop()
    shutil.rmtree(WORK, ignore_errors=True)

print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
