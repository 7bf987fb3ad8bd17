#!/usr/bin/env python3
"""lm-evaluation-harness against `kvlm serve`, once per KV cache mode: one table.

For each KV mode: start `kvlm serve` on loopback with that mode, wait for /health, run
`lm_eval run --model local-completions` (or local-chat-completions with --api chat) on the
kvlm_* tasks in tools/lm_eval/tasks (the bundled model's eval data, greedy, exact match after
the item's regex), stop the server. Optionally (--compare, the default) run `kvlm eval task`
with the same mode on the same items and count the items whose completion or verdict differ.

Writes into --out: table.md (mode -> exact match ± stderr, n), results.json (every mode's raw
lm_eval results JSON, the server's KV line, the comparison) and raw.tar.gz (lm_eval outputs
with per-sample logs, server and lm_eval logs, one folder per mode). Exit status 0 only when
every mode ran; a failed mode is a row saying why, and the run goes on to the next mode.

Normally started by tools/lm_eval/run.sh, which makes the venv; it runs lm_eval as
`<this python> -m lm_eval`. Standard library only.
"""
import argparse
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TASKS_DIR = os.path.join(HERE, "tasks")
SERVED_NAME = "kvlm"
TASK_FILES = {"arithmetic": "arithmetic.jsonl", "recall_1k": "recall_1k.jsonl",
              "recall_4k": "recall_4k.jsonl", "recall_8k": "recall_8k.jsonl"}


def mode_table(num_layers):
    """(key, label, serve flags, uses the calibrated model dir) as tools/accuracy_table.py names them."""
    last = num_layers - 1
    return [
        ("bfloat16", "bfloat16", ["--kv-cache-dtype", "bfloat16"], False),
        ("float16", "float16", ["--kv-cache-dtype", "float16"], False),
        ("fp8_e4m3", "fp8_e4m3, scale 1.0", ["--kv-cache-dtype", "fp8_e4m3"], False),
        ("fp8_calibrated", "fp8_e4m3, calibrated scales", ["--kv-cache-dtype", "fp8_e4m3"], True),
        ("fp8_e5m2", "fp8_e5m2", ["--kv-cache-dtype", "fp8_e5m2"], False),
        ("fp8_per_token_head", "fp8_per_token_head", ["--kv-cache-dtype", "fp8_per_token_head"], False),
        ("int8_per_token_head", "int8_per_token_head", ["--kv-cache-dtype", "int8_per_token_head"], False),
        ("fp8_skip_first_last", f"fp8_e4m3, layers 0 and {last} kept",
         ["--kv-cache-dtype", "fp8_e4m3", "--kv-cache-dtype-skip-layers", f"0,{last}"], False),
    ]


class Failure(Exception):
    pass


def log(msg):
    print(f"[lm_eval/run] {msg}", flush=True)


def tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def default_kvlm():
    if os.environ.get("KVLM"):
        return os.environ["KVLM"]
    for d in ("build-gpu", "build", "build-cpu"):
        p = os.path.join(ROOT, d, "kvlm")
        if os.path.exists(p):
            return p
    return os.path.join(ROOT, "build", "kvlm")


def run_logged(cmd, logpath, env=None, timeout=None):
    with open(logpath, "w") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        lf.flush()
        try:
            p = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Failure(f"timed out after {timeout} s: {' '.join(cmd[:4])} ... (log {logpath})")
    return p.returncode


class Server:
    """`kvlm serve` on 127.0.0.1 with a free port (--port 0, read from its first line)."""

    def __init__(self, cmd, logpath, start_timeout):
        self.cmd, self.logpath, self.start_timeout = cmd, logpath, start_timeout
        self.proc = None
        self.base = None
        self.kv_line = ""
        self.scale_warning = False

    def __enter__(self):
        self.logf = open(self.logpath, "w")
        self.logf.write("$ " + " ".join(self.cmd) + "\n")
        self.logf.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self.logf, stderr=subprocess.STDOUT)
        deadline = time.time() + self.start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise Failure(f"kvlm serve exited with status {self.proc.returncode} before it was ready:\n"
                              + tail(self.logpath))
            text = open(self.logpath, errors="replace").read()
            if self.base is None:
                m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
                if m:
                    self.base = m.group(1)
            if self.base is not None:
                try:
                    with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                        if r.status == 200:
                            m = re.search(r"model '[^']*': [^\n]*; KV cache ([^\n]*)", text)
                            self.kv_line = m.group(1).strip() if m else ""
                            self.scale_warning = "without checkpoint scales" in text
                            return self
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
            time.sleep(0.5)
        raise Failure(f"kvlm serve was not ready (/health 200) within {self.start_timeout} s:\n" + tail(self.logpath))

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()
        return False


def lm_eval_tasks(tasks, api):
    return [f"kvlm_{t}" + ("_chat" if api == "chat" else "") for t in tasks]


def run_lm_eval(args, base, tasks, outdir, logpath):
    chat = args.api == "chat"
    model_args = {
        "model": SERVED_NAME,
        "base_url": base + ("/v1/chat/completions" if chat else "/v1/completions"),
        "num_concurrent": args.num_concurrent,
        "max_retries": args.max_retries,
        "timeout": args.request_timeout,
    }
    if not chat and args.token_ids:
        # lm_eval tokenizes with transformers (the model directory's tokenizer) and sends ids.
        cfg = json.load(open(os.path.join(args.model, "config.json")))
        model_args.update(tokenizer_backend="huggingface", tokenizer=args.model,
                          max_length=cfg.get("max_position_embeddings", 2048))
    elif not chat:
        # Send the rendered prompt as text; kvlm tokenizes it (as `kvlm eval task` does).
        model_args["tokenizer_backend"] = "none"
    cmd = [sys.executable, "-m", "lm_eval", "run",
           "--model", "local-chat-completions" if chat else "local-completions",
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", ",".join(lm_eval_tasks(tasks, args.api)),
           "--include_path", TASKS_DIR,
           "--output_path", outdir, "--log_samples",
           "--metadata", json.dumps({"kvlm_data_dir": args.data_dir})]
    if chat:
        cmd.append("--apply_chat_template")
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=os.path.join(outdir, ".hf-datasets-cache"))
    rc = run_logged(cmd, logpath, env=env, timeout=args.lm_eval_timeout)
    text = open(logpath, errors="replace").read()
    rejected = re.findall(r"API request failed[^\n]*", text)
    if rc != 0:
        why = f"lm_eval exited with status {rc}"
        if rejected:
            why += f"; the server answered with an error: {rejected[0][:600]}"
        raise Failure(why + "\n" + tail(logpath))
    found = sorted(glob.glob(os.path.join(outdir, "*", "results_*.json")))
    if not found:
        raise Failure(f"lm_eval wrote no results_*.json under {outdir}\n" + tail(logpath))
    shutil.rmtree(os.path.join(outdir, ".hf-datasets-cache"), ignore_errors=True)
    return json.load(open(found[-1])), found[-1], rejected


def samples_of(results_path, task_name):
    d = os.path.dirname(results_path)
    stamp = os.path.basename(results_path)[len("results_"):-len(".json")]
    path = os.path.join(d, f"samples_{task_name}_{stamp}.jsonl")
    out = {}
    if os.path.exists(path):
        for line in open(path):
            s = json.loads(line)
            out[s["doc_id"]] = s
    return out


def compare_with_kvlm_eval(args, model_dir, flags, task, samples, workdir):
    """`kvlm eval task` on the same items and mode: how many completions / verdicts differ."""
    if not samples:
        raise Failure(f"no lm_eval per-sample log for {task}: cannot compare with `kvlm eval task`")
    log_samples = os.path.join(workdir, f"kvlm_eval_{task}.jsonl")
    js = os.path.join(workdir, f"kvlm_eval_{task}.json")
    cmd = [args.kvlm, "-q", "eval", "task", "--model", model_dir, "--data",
           os.path.join(args.data_dir, TASK_FILES[task]), "--device", args.device,
           "--max-tokens", str(args.max_gen_toks), "--limit", str(args.limit or 0),
           *flags, "--log-samples", log_samples, "--json", js]
    rc = run_logged(cmd, os.path.join(workdir, f"kvlm_eval_{task}.log"))
    if rc != 0:
        raise Failure(f"kvlm eval task failed ({rc}):\n" + tail(os.path.join(workdir, f"kvlm_eval_{task}.log")))
    ref = {}
    for line in open(log_samples):
        s = json.loads(line)
        ref[s["index"]] = s
    diff_text, diff_verdict, examples = 0, 0, []
    for i, s in samples.items():
        r = ref.get(i)
        if r is None:
            diff_text += 1
            diff_verdict += 1
            continue
        got = s["resps"][0][0] if s.get("resps") else None
        ok = bool(s.get("exact_match"))
        if got != r["completion"]:
            diff_text += 1
            if len(examples) < 3:
                examples.append({"index": i, "lm_eval": got, "kvlm_eval": r["completion"]})
        if ok != bool(r["correct"]):
            diff_verdict += 1
    acc = json.load(open(js))["accuracy"]
    return {"kvlm_eval_accuracy": acc, "items": len(samples), "completions_differ": diff_text,
            "verdicts_differ": diff_verdict, "examples": examples}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvlm", default=default_kvlm(), help="kvlm binary (default: $KVLM, else build-gpu/, build/, build-cpu/)")
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "kvlm-tiny"), help="model directory")
    ap.add_argument("--data-dir", help="task JSONL files (default: <model>/eval)")
    ap.add_argument("--out", required=True, help="output folder (table.md, results.json, raw.tar.gz)")
    ap.add_argument("--work", help="keep the unpacked raw outputs here (default: a temporary folder, removed)")
    ap.add_argument("--modes", default="all",
                    help="comma-separated keys, or 'all': bfloat16, float16, fp8_e4m3, fp8_calibrated, fp8_e5m2, "
                         "fp8_per_token_head, int8_per_token_head, fp8_skip_first_last")
    ap.add_argument("--tasks", default="arithmetic,recall_1k", help="comma-separated: " + ", ".join(TASK_FILES))
    ap.add_argument("--api", choices=["completions", "chat"], default="completions",
                    help="local-completions with the rendered prompt (default) or local-chat-completions")
    ap.add_argument("--token-ids", action="store_true",
                    help="completions only: lm_eval tokenizes with transformers' AutoTokenizer of --model and "
                         "sends token ids (default: text, tokenized by kvlm)")
    ap.add_argument("--limit", type=int, default=0, help="items per task (0: all)")
    ap.add_argument("--device", default="auto", help="kvlm --device (auto, cpu, cuda)")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="kvlm serve --kv-cache-memory ('' for its default)")
    ap.add_argument("--num-concurrent", type=int, default=16, help="requests lm_eval keeps in flight")
    ap.add_argument("--max-retries", type=int, default=3)
    ap.add_argument("--request-timeout", type=int, default=600, help="seconds per request")
    ap.add_argument("--start-timeout", type=int, default=300, help="seconds to wait for /health")
    ap.add_argument("--lm-eval-timeout", type=int, default=3600, help="seconds per lm_eval run")
    ap.add_argument("--max-gen-toks", type=int, default=256, help="must match the task YAMLs (used by --compare)")
    ap.add_argument("--calibration-samples", type=int, default=32)
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also run `kvlm eval task` per mode and count differing items (default: on)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `kvlm serve` argument (repeatable)")
    args = ap.parse_args()

    args.kvlm = os.path.abspath(args.kvlm)
    args.model = os.path.abspath(args.model)
    args.data_dir = os.path.abspath(args.data_dir or os.path.join(args.model, "eval"))
    problems = []
    if not os.access(args.kvlm, os.X_OK):
        problems.append(f"kvlm binary not found or not executable: {args.kvlm} (build it, or pass --kvlm)")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        problems.append(f"no config.json in --model {args.model}")
    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in TASK_FILES:
            problems.append(f"unknown task '{t}' (known: {', '.join(TASK_FILES)})")
        elif not os.path.exists(os.path.join(args.data_dir, TASK_FILES[t])):
            problems.append(f"missing data file {os.path.join(args.data_dir, TASK_FILES[t])}")
    try:
        import lm_eval  # noqa: F401
        from importlib.metadata import version
        lm_eval_version = version("lm_eval")
    except Exception as e:  # noqa: BLE001
        problems.append(f"lm_eval is not importable by {sys.executable}: {e} (run through tools/lm_eval/run.sh)")
        lm_eval_version = None
    num_layers = json.load(open(os.path.join(args.model, "config.json")))["num_hidden_layers"] \
        if os.path.exists(os.path.join(args.model, "config.json")) else 1
    all_modes = mode_table(num_layers)
    keys = [m[0] for m in all_modes]
    wanted = keys if args.modes == "all" else [m for m in args.modes.split(",") if m]
    for m in wanted:
        if m not in keys:
            problems.append(f"unknown mode '{m}' (known: {', '.join(keys)})")
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        sys.exit(2)
    modes = [m for m in all_modes if m[0] in wanted]

    os.makedirs(args.out, exist_ok=True)
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="kvlm-lm-eval-")
    os.makedirs(work, exist_ok=True)
    log(f"kvlm {args.kvlm}; model {args.model}; lm_eval {lm_eval_version} ({sys.executable}); "
        f"api {args.api}{' (token ids)' if args.token_ids and args.api == 'completions' else ''}; tasks {','.join(tasks)}; limit {args.limit or 'all'}; work {work}")

    calibrated = None
    rows = []
    t_all = time.time()
    for key, label, flags, use_cal in modes:
        mdir = os.path.join(work, key)
        os.makedirs(mdir, exist_ok=True)
        row = {"mode": key, "label": label, "serve_flags": flags, "ok": False}
        t0 = time.time()
        try:
            model_dir = args.model
            if use_cal:
                if calibrated is None:
                    calibrated = os.path.join(work, "calibrated-model")
                    shutil.rmtree(calibrated, ignore_errors=True)
                    cmd = [args.kvlm, "-q", "calibrate", "--model", args.model, "--out", calibrated,
                           "--device", args.device, "--num-samples", str(args.calibration_samples), "--max-length", "512"]
                    heldout = os.path.join(args.data_dir, "heldout.txt")
                    if os.path.exists(heldout):
                        cmd += ["--dataset", heldout]
                    log("kvlm calibrate -> " + calibrated)
                    if run_logged(cmd, os.path.join(work, "calibrate.log")) != 0:
                        calibrated = None
                        raise Failure("kvlm calibrate failed:\n" + tail(os.path.join(work, "calibrate.log")))
                model_dir = calibrated
            row["model_dir"] = model_dir
            serve = [args.kvlm, "serve", "--model", model_dir, "--served-model-name", SERVED_NAME,
                     "--host", "127.0.0.1", "--port", "0", "--device", args.device, *flags]
            if args.kv_cache_memory:
                serve += ["--kv-cache-memory", args.kv_cache_memory]
            serve += args.serve_arg
            log(f"{key}: kvlm serve {' '.join(flags)}")
            with Server(serve, os.path.join(mdir, "serve.log"), args.start_timeout) as srv:
                row["server_kv"] = srv.kv_line + ("; warned: scale 1.0" if srv.scale_warning else "")
                if use_cal and srv.scale_warning:
                    raise Failure("the calibrated model directory was served without its scales (the server warned "
                                  "about scale 1.0):\n" + tail(os.path.join(mdir, "serve.log")))
                log(f"{key}: ready at {srv.base} (KV cache {srv.kv_line}); lm_eval ...")
                res, res_path, rejected = run_lm_eval(args, srv.base, tasks, os.path.join(mdir, "lm_eval"),
                                                      os.path.join(mdir, "lm_eval.log"))
                if not srv.alive():
                    raise Failure("kvlm serve died during the run:\n" + tail(os.path.join(mdir, "serve.log")))
            row["lm_eval_results"] = res
            if rejected:
                row["rejected_requests"] = rejected[:5]
            row["scores"] = {}
            for t in tasks:
                name = lm_eval_tasks([t], args.api)[0]
                r = res["results"].get(name)
                if r is None or "exact_match,extract" not in r:
                    raise Failure(f"lm_eval results have no exact_match for {name}")
                ns = res.get("n-samples", {}).get(name, {})
                row["scores"][t] = {"exact_match": r["exact_match,extract"],
                                    "stderr": r.get("exact_match_stderr,extract"),
                                    "n": ns.get("effective", r.get("sample_len"))}
                if args.compare:
                    row["scores"][t]["compare"] = compare_with_kvlm_eval(
                        args, model_dir, flags, t, samples_of(res_path, name), mdir)
            row["ok"] = True
        except Failure as e:
            row["error"] = str(e)
            print(f"error: mode {key}: {e}", file=sys.stderr, flush=True)
        row["seconds"] = round(time.time() - t0, 1)
        if row["ok"]:
            summary = "; ".join(
                f"{t} {100 * s['exact_match']:.1f}% (n={s['n']})"
                + (f", kvlm eval {100 * s['compare']['kvlm_eval_accuracy']:.1f}%, "
                   f"{s['compare']['completions_differ']} completions / {s['compare']['verdicts_differ']} verdicts differ"
                   if "compare" in s else "")
                for t, s in row["scores"].items())
            log(f"{key}: {summary} [{row['seconds']} s]")
        rows.append(row)

    # table.md
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    api_model = "local-chat-completions" if args.api == "chat" else "local-completions"
    if args.api == "completions":
        api_model += " (token-id prompts, transformers tokenizer)" if args.token_ids else " (text prompts)"
    lines = [
        f"# lm-evaluation-harness through `kvlm serve`, per KV cache mode",
        "",
        f"lm_eval {lm_eval_version}, `--model` {api_model} against `kvlm serve --device {args.device}` "
        f"({os.path.relpath(args.kvlm, ROOT) if args.kvlm.startswith(ROOT) else args.kvlm}), model "
        f"`{os.path.relpath(args.model, ROOT) if args.model.startswith(ROOT) else args.model}`, "
        f"tasks from `{os.path.relpath(args.data_dir, ROOT) if args.data_dir.startswith(ROOT) else args.data_dir}` "
        f"(tools/lm_eval/tasks: greedy, max_gen_toks {args.max_gen_toks}, exact match of the item's regex answer), "
        f"{'first ' + str(args.limit) + ' items per task' if args.limit else 'all items'}; "
        f"{datetime.date.today()}, commit {commit}, {platform.node()}.",
        "",
    ]
    head = "| KV cache | server KV line |"
    sep = "|---|---|"
    for t in tasks:
        head += f" {t} exact match % ± stderr | n |"
        sep += "---:|---:|"
        if args.compare:
            head += f" {t}: `kvlm eval task` % / items differing |"
            sep += "---:|"
    lines += [head, sep]
    for r in rows:
        line = f"| {r['label']} | {r.get('server_kv', '')} |"
        if not r["ok"]:
            err = [ln.strip() for ln in r["error"].splitlines() if ln.strip()]
            why = (err[0] + (" " + err[-1] if len(err) > 1 else ""))[:300].replace("|", "\\|")
            line += f" FAILED: {why} |" + " |" * (len(tasks) * (3 if args.compare else 2) - 1)
        else:
            for t in tasks:
                s = r["scores"][t]
                se = "n/a" if s["stderr"] in (None, "N/A") else f"{100 * s['stderr']:.1f}"
                line += f" {100 * s['exact_match']:.1f} ± {se} | {s['n']} |"
                if args.compare:
                    c = s["compare"]
                    line += (f" {100 * c['kvlm_eval_accuracy']:.1f} / {c['completions_differ']} completions, "
                             f"{c['verdicts_differ']} verdicts |")
        lines.append(line)
    lines.append("")
    lines.append(f"Total {time.time() - t_all:.0f} s. Raw lm_eval JSON per mode: results.json; samples and logs: raw.tar.gz.")
    lines.append("")
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"lm_eval_version": lm_eval_version, "api": args.api, "model": args.model, "kvlm": args.kvlm,
                   "device": args.device, "tasks": tasks, "limit": args.limit, "commit": commit,
                   "date": datetime.datetime.now().isoformat(timespec="seconds"), "modes": rows}, f, indent=1)
    with tarfile.open(os.path.join(args.out, "raw.tar.gz"), "w:gz") as tf:
        for name in sorted(os.listdir(work)):
            if name == "calibrated-model":
                continue
            tf.add(os.path.join(work, name), arcname=os.path.join("raw", name))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    failed = [r["mode"] for r in rows if not r["ok"]]
    log(f"wrote {os.path.join(args.out, 'table.md')}, results.json, raw.tar.gz")
    if failed:
        print(f"error: {len(failed)} of {len(rows)} modes failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
