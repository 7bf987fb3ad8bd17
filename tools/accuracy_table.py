#!/usr/bin/env python3
"""The accuracy table of every KV precision: docs/results/accuracy.md.

For each model, one baseline run with an fp32 KV cache (--dtype float32) saves its
log-probabilities; every KV mode is then scored against it with `kvlm eval perplexity
--kl-divergence-base` (PPL, delta PPL, mean / p99 KLD, same-top %), and, for the bundled model
that the project trains, `kvlm eval task` measures arithmetic and passkey-recall accuracy
at 1k / 4k / 8k context. The "calibrated" row runs `kvlm calibrate` first.

Models without a tokenizer (the golden random-weight checkpoints, vocabulary 256) are scored
on the bytes of the same held-out text as token ids.

Real pretrained models from GGUF files (`--gguf FILE ...`, with `--no-bundled --golden` to
score only them, into their own --out) are scored on the same text through their own
tokenizer, with windows of --gguf-ctx tokens (longer than Gemma 3's 512-token sliding
window by default), and get a greedy-agreement column: the share of 128-token greedy
continuations of a fixed prompt set (tools/accuracy_prompts.jsonl) identical to the fp32-cache
run's, and the mean share of each continuation's characters before the first difference.
They have no "calibrated" row (`kvlm calibrate` writes safetensors checkpoints).

usage: python3 tools/accuracy_table.py --kvlm build/kvlm [--device cpu|cuda] [--out FILE]
                                       [--task-limit N] [--models DIR ...]
Only the standard library; reproducible from a clean checkout.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modes(num_layers, sliding=False):
    last = num_layers - 1
    extra = [("fp8_per_token_head, sliding-window layers kept", ["--kv-cache-dtype", "fp8_per_token_head",
                                                                "--kv-cache-dtype-skip-layers", "sliding_window"], False)]
    return (extra if sliding else []) + [
        ("bfloat16", ["--kv-cache-dtype", "bfloat16"], False),
        ("float16", ["--kv-cache-dtype", "float16"], False),
        ("fp8_e4m3, scale 1.0", ["--kv-cache-dtype", "fp8_e4m3"], False),
        ("fp8_e4m3, calibrated scales", ["--kv-cache-dtype", "fp8_e4m3"], True),
        ("fp8_e5m2", ["--kv-cache-dtype", "fp8_e5m2"], False),
        ("fp8_per_token_head", ["--kv-cache-dtype", "fp8_per_token_head"], False),
        ("int8_per_token_head", ["--kv-cache-dtype", "int8_per_token_head"], False),
        ("int8_per_token_head, Hadamard-rotated", ["--kv-cache-dtype", "int8_per_token_head",
                                                   "--kv-cache-rotation", "hadamard"], False),
        ("fp8_per_token_head, Hadamard-rotated", ["--kv-cache-dtype", "fp8_per_token_head",
                                                  "--kv-cache-rotation", "hadamard"], False),
        ("int4_per_token_head, not rotated", ["--kv-cache-dtype", "int4_per_token_head",
                                              "--kv-cache-rotation", "none"], False),
        ("int4_per_token_head (Hadamard-rotated: the default)", ["--kv-cache-dtype", "int4_per_token_head"], False),
        (f"fp8_e4m3, layers 0 and {last} kept", ["--kv-cache-dtype", "fp8_e4m3",
                                                  "--kv-cache-dtype-skip-layers", f"0,{last}"], False),
        ("int4_per_token_head, not rotated, exact sink 4 + recent 64",
         ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-rotation", "none",
          "--kv-cache-keep-sink", "4", "--kv-cache-keep-recent", "64"], False),
        ("int4_per_token_head, rotated, exact sink 4 + recent 64",
         ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-keep-sink", "4", "--kv-cache-keep-recent", "64"], False),
        ("int4_per_token_head, rotated, exact sink 4 + recent 256",
         ["--kv-cache-dtype", "int4_per_token_head", "--kv-cache-keep-sink", "4", "--kv-cache-keep-recent", "256"], False),
    ]


def run(cmd, log):
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n{p.stdout}{p.stderr}\n[{time.time() - t0:.1f} s, exit {p.returncode}]\n\n")
    log.flush()
    if p.returncode != 0:
        sys.exit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}")
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvlm", default=os.path.join(ROOT, "build", "kvlm"))
    ap.add_argument("--device", default="cpu", help="device of the perplexity / KLD runs (the fp32 baseline needs cpu)")
    ap.add_argument("--task-device", default=None,
                    help="device of the task columns (default: --device); e.g. cuda for recall at 4k / 8k")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "accuracy.md"))
    ap.add_argument("--bundled", default=os.path.join(ROOT, "models", "kvlm-tiny"),
                    help="the trained model (with eval/ data)")
    ap.add_argument("--golden", nargs="*", default=["llama-gqa", "qwen3-mixed", "mistral-swa"],
                    help="golden random-weight models (tests/golden/models)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-chunks", type=int, default=32)
    ap.add_argument("--task-limit", type=int, default=0, help="items per task (0: all)")
    ap.add_argument("--gguf", nargs="*", default=[], help="real pretrained models as GGUF files")
    ap.add_argument("--gguf-ctx", type=int, default=1024)
    ap.add_argument("--gguf-max-chunks", type=int, default=8)
    ap.add_argument("--commit", default="", help="the commit the measured tree is (default: git HEAD, flagged when the "
                                                   "tree differs from it)")
    ap.add_argument("--no-bundled", action="store_true", help="leave the bundled model out")
    ap.add_argument("--tasks", default="arithmetic,recall_1k,recall_4k,recall_8k",
                    help="task columns to measure, comma separated ('' for none)")
    ap.add_argument("--modes", default="",
                    help="only the rows whose label contains this text (e.g. 'exact' or 'int4'); default: every row")
    args = ap.parse_args()

    kvlm = os.path.abspath(args.kvlm)
    task_device = args.task_device or args.device
    work = tempfile.mkdtemp(prefix="kvlm-accuracy-")
    log = open(os.path.join(work, "commands.log"), "w")
    eval_dir = os.path.join(args.bundled, "eval")
    heldout = os.path.join(eval_dir, "heldout.txt")
    if not os.path.exists(heldout):
        sys.exit(f"{heldout} is missing: the bundled model's eval data")
    byte_ids = os.path.join(work, "heldout.ids")
    with open(heldout, "rb") as f, open(byte_ids, "w") as g:
        g.write(" ".join(str(b) for b in f.read()))

    models = [] if args.no_bundled else [(args.bundled, "trained")]
    models += [(os.path.join(ROOT, "tests", "golden", "models", g), "random") for g in args.golden]
    models += [(os.path.abspath(g), "gguf") for g in args.gguf]
    prompts = os.path.join(ROOT, "tools", "accuracy_prompts.jsonl")
    sections = []
    for model, kind in models:
        trained, gguf = kind == "trained", kind == "gguf"
        name = os.path.basename(model.rstrip("/"))
        if gguf:
            inspect = run([kvlm, "-q", "inspect", "--model", model, "--json"], log)
            layers = [l for l in json.loads(inspect.stdout)["layers"] if l.get("model", "target") == "target"]
            n_layers = len(layers)
            sliding = any(l["attention"] == "sliding" for l in layers)
        else:
            n_layers = json.load(open(os.path.join(model, "config.json")))["num_hidden_layers"]
            sliding = False
        text_args = ["--token-ids", byte_ids] if kind == "random" else ["--text", heldout]
        ctx, chunks = (args.gguf_ctx, args.gguf_max_chunks) if gguf else (args.ctx, args.max_chunks)
        common = ["--ctx", str(ctx), "--max-chunks", str(chunks), "--device", args.device]
        base = os.path.join(work, f"{name}.base.lgp")
        out = os.path.join(work, f"{name}.base.json")
        run([kvlm, "-q", "eval", "perplexity", "--model", model, *text_args, *common, "--dtype", "float32",
             "--save-logits", base, "--json", out], log)
        base_ppl = json.load(open(out))["ppl"]

        def greedy(flags, tag):
            samples = os.path.join(work, f"{name}.{tag}.samples.jsonl")
            run([kvlm, "-q", "eval", "task", "--model", model, "--data", prompts, "--device", args.device,
                 "--max-tokens", "128", *flags, "--log-samples", samples], log)
            return [json.loads(line)["completion"] for line in open(samples)]

        base_greedy = greedy(["--dtype", "float32"], "base") if gguf else None
        calibrated = os.path.join(work, f"{name}-calibrated")
        if not gguf and any(c and args.modes in lbl for lbl, _, c in modes(n_layers)):
            run([kvlm, "-q", "calibrate", "--model", model, "--out", calibrated, "--num-samples", "32",
                 "--max-length", str(args.ctx), "--dataset", heldout if trained else byte_ids], log)
        rows = []
        for label, flags, use_cal in modes(n_layers, sliding and gguf):
            if (use_cal and gguf) or args.modes not in label:
                continue
            m = calibrated if use_cal else model
            out = os.path.join(work, f"{name}.{len(rows)}.json")
            run([kvlm, "-q", "eval", "perplexity", "--model", m, *text_args, *common, *flags,
                 "--kl-divergence-base", base, "--json", out], log)
            r = json.load(open(out))
            row = {"mode": label, "bytes": r["kv_bytes_per_token"], "ppl": r["ppl"], "dppl": r["delta_ppl"],
                   "dppl_ci": r["delta_ppl_ci95"], "kld": r["kld_mean"], "kld99": r["kld_p99"],
                   "top": 100 * r["same_top"]}
            if gguf:
                got = greedy(flags, str(len(rows)))
                same = sum(a == b for a, b in zip(got, base_greedy))
                prefix = []
                for a, b in zip(got, base_greedy):
                    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    prefix.append(k / max(len(a), len(b), 1))
                row["greedy"] = (same, len(got), 100 * sum(prefix) / max(len(prefix), 1))
            if trained:
                for task in [t for t in args.tasks.split(",") if t]:
                    data = os.path.join(eval_dir, f"{task}.jsonl")
                    if not os.path.exists(data):
                        row[task] = None
                        continue
                    tout = os.path.join(work, f"{name}.{len(rows)}.{task}.json")
                    run([kvlm, "-q", "eval", "task", "--model", m, "--data", data, "--device", task_device,
                         "--max-tokens", "128", "--limit", str(args.task_limit), *flags, "--json", tout], log)
                    row[task] = 100 * json.load(open(tout))["accuracy"]
            rows.append(row)
            print(f"{name:14s} {label:34s} ppl {row['ppl']:.4f} kld {row['kld']:.2e}", flush=True)
        sections.append((name, kind, n_layers, base_ppl, rows, ctx, chunks))

    commit = args.commit or subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    if dirty and not args.commit:  # e.g. a copy of the tree whose .git lags behind it
        commit += " with uncommitted changes (pass --commit to name the tree)"
    lines = [
        "# KV precision vs accuracy",
        "",
        f"Produced by `python3 tools/accuracy_table.py --kvlm {os.path.relpath(kvlm, ROOT)} --device {args.device}"
        f"{' --task-device ' + task_device if task_device != args.device else ''}"
        f"{' --task-limit ' + str(args.task_limit) if args.task_limit else ''}"
        f"{' --tasks ' + args.tasks if args.tasks != ap.get_default('tasks') else ''}"
        f"{' --no-bundled' if args.no_bundled else ''}"
        f"{' --modes ' + repr(args.modes) if args.modes else ''}"
        f"{' --golden ' + ' '.join(args.golden) if args.golden != ap.get_default('golden') else (' --golden' if not args.golden else '')}"
        f"{' --gguf ' + ' '.join(os.path.basename(g) for g in args.gguf) if args.gguf else ''}` on {datetime.date.today()}, "
        f"commit {commit}, {platform.node()} ({platform.processor() or platform.machine()}).",
        "",
        f"Perplexity over `{os.path.relpath(heldout, ROOT)}` in windows of {args.ctx} tokens (GGUF models: "
        f"{args.gguf_ctx}; the second half of each scored, at most {args.max_chunks} windows, GGUF models "
        f"{args.gguf_max_chunks}). Every row is compared with the same model run with an fp32 KV "
        "cache (`--dtype float32`): delta PPL (with its 95% confidence interval), mean and p99 per-token KL "
        "divergence, and how often the most likely next token is unchanged. Task columns: exact-match accuracy "
        "of greedy answers (`kvlm eval task`"
        + (f", on {task_device}: computed in bf16 there, so a task column can differ from an fp32 run by near-ties"
           if task_device != args.device else "")
        + "). Random-weight golden models are scored on the text's bytes as "
        "token ids; their PPL is meaningless, their KLD is not.",
        "",
    ]
    for name, kind, n_layers, base_ppl, rows, ctx, chunks in sections:
        trained, gguf = kind == "trained", kind == "gguf"
        what = {"trained": "trained", "random": "random weights",
                "gguf": f"real pretrained weights from GGUF; windows of {ctx} tokens, at most {chunks}"}[kind]
        lines.append(f"## {name} ({n_layers} layers, {what}; fp32-cache PPL {base_ppl:.4f})")
        lines.append("")
        head = "| KV cache | bytes/token | PPL | ΔPPL (95% CI) | mean KLD | p99 KLD | same top % |"
        sep = "|---|---:|---:|---:|---:|---:|---:|"
        if gguf:
            head += " greedy 128 identical | greedy chars before first difference % |"
            sep += "---:|---:|"
        if trained:
            head += " arithmetic % | recall 1k % | recall 4k % | recall 8k % |"
            sep += "---:|---:|---:|---:|"
        lines += [head, sep]
        for r in rows:
            line = (f"| {r['mode']} | {r['bytes']} | {r['ppl']:.4f} | {r['dppl']:+.4f} ± {r['dppl_ci']:.4f} | "
                    f"{r['kld']:.2e} | {r['kld99']:.2e} | {r['top']:.2f} |")
            if gguf:
                same, n, pct = r["greedy"]
                line += f" {same}/{n} | {pct:.1f} |"
            if trained:
                for task in ["arithmetic", "recall_1k", "recall_4k", "recall_8k"]:
                    line += " not run |" if r.get(task) is None else f" {r[task]:.1f} |"
            lines.append(line)
        lines.append("")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    shutil.copy(os.path.join(work, "commands.log"), args.out.replace(".md", ".log"))
    print(f"wrote {args.out} (commands in {args.out.replace('.md', '.log')})")


if __name__ == "__main__":
    main()
