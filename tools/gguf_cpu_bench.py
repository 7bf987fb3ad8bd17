#!/usr/bin/env python3
"""Batch-1 generation speed of GGUF models on the CPU: kvlm against Hugging Face transformers
(the same file through `from_pretrained(..., gguf_file=...)`, float32, torch's CPU threads) and
against llama.cpp's own `llama-bench` on the same file, where a llama.cpp build is given.

For each model and engine: load time, peak resident memory (kvlm's from /usr/bin/time), prompt
tokens/s over a 128-token prompt and decode tokens/s over 128 generated tokens (greedy, EOS
ignored), best of --repeat runs. kvlm runs twice: as it loads by default (the quantized
matrices kept in their blocks: int8 activations for decode, fp32 tiles for prompts; ops/cpu/
quant_matmul.h) and with --dequantize-weights (everything float32, the old path).
transformers computes in float32 on dequantized weights; llama.cpp on its blocks. A file whose
vocabulary cannot spell the text (tools/make_random_gguf.py's) is prompted with token ids.

usage: python3 tools/gguf_cpu_bench.py --kvlm build/kvlm GGUF... [--python VENV/bin/python]
                                        [--llama-bench PATH] [--repeat 3] [--threads 2]
Prints one markdown table.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

PROMPT = ("The harbour town of Elsby wakes before the sun. Fishing boats slip out past the stone lighthouse while "
          "the bakery on Quay Street lights its ovens. Mara, who keeps the lighthouse, writes the weather in a green "
          "notebook every morning at five. On Mondays the ferry brings letters, flour and the newspaper from the "
          "mainland. The school has eleven pupils and one teacher, who also plays the organ on Sundays. In spring the "
          "hills behind the town turn yellow with gorse, and the sheep are moved to the upper fields. One morning")

HF = r'''
import json, sys, time, os
import torch
t0 = time.time()
from transformers import AutoModelForCausalLM, AutoTokenizer
path, n_prompt, n_gen, repeat, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
d, f = os.path.dirname(path), os.path.basename(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
load = time.time() - t0
ids = tok(sys.argv[6]).input_ids[:n_prompt]
x = torch.tensor([ids])
best_p, best_d = 0, 0
with torch.no_grad():
    for _ in range(repeat):
        t = time.time(); model(x, use_cache=True); tp = time.time() - t
        t = time.time()
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_gen, min_new_tokens=n_gen,
                             do_sample=False, pad_token_id=0)
        tg = time.time() - t
        # generate() = one prefill + n_gen - 1 decode steps
        best_p = max(best_p, len(ids) / tp)
        best_d = max(best_d, (n_gen - 1) / max(tg - tp, 1e-9))
import resource
print(json.dumps({"load": load, "prompt_tps": best_p, "decode_tps": best_d,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "prompt_tokens": len(ids)}))
'''


def kvlm_run(kvlm, model, ids, n_gen, threads, extra):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        p = subprocess.run(["/usr/bin/time", "-f", "%M %e", "-o", tf.name, kvlm, "-q", "generate", "--model", model,
                            "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", str(n_gen), "--ignore-eos",
                            "--temperature", "0", "--json", "--prefill-chunk", "512", *extra],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0:
            sys.exit(f"kvlm failed: {p.stderr}")
        rss_kb, wall = tf.read().split()
    j = json.loads(p.stdout)
    return j, float(rss_kb) / 1024, float(wall)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--kvlm", required=True)
    ap.add_argument("--python", help="a Python with torch + transformers + gguf (transformers' row)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (llama.cpp's row)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    args = ap.parse_args()
    rows = []
    for model in args.models:
        name = os.path.basename(model)
        tok = subprocess.run([args.kvlm, "-q", "tokenize", "--tokenizer", model, "--text", PROMPT * 4, "--json",
                              "--add-special-tokens"], capture_output=True, text=True)
        ids = json.loads(tok.stdout)["ids"][:args.prompt_tokens] if tok.returncode == 0 else []
        if len(ids) < args.prompt_tokens:  # a vocabulary that cannot spell the text (tools/make_random_gguf.py's)
            print(f"{name}: the tokenizer gives {len(ids)} tokens ({tok.stderr.strip()}); prompting with token ids "
                  "1000..", file=sys.stderr)
            ids = list(range(1000, 1000 + args.prompt_tokens))
        for label, extra in (("kvlm (blocks kept)", []), ("kvlm --dequantize-weights (float32)", ["--dequantize-weights"])):
            best = None
            for _ in range(args.repeat):
                j, rss, wall = kvlm_run(args.kvlm, model, ids, args.gen_tokens, args.threads, extra)
                t = j["timing"]
                load = wall - t["prefill_seconds"] - t["decode_seconds"]
                cur = (len(ids) / t["prefill_seconds"], t["decode_tokens_per_second"], load, rss)
                best = cur if best is None else (max(best[0], cur[0]), max(best[1], cur[1]), min(best[2], cur[2]),
                                                 max(best[3], cur[3]))
            rows.append((name, label, *best))
            print(f"{name}: {label} {best}", file=sys.stderr, flush=True)
        if args.python:
            p = subprocess.run([args.python, "-c", HF, model, str(args.prompt_tokens), str(args.gen_tokens),
                                str(args.repeat), str(args.threads), PROMPT * 4], capture_output=True, text=True)
            if p.returncode == 0:
                h = json.loads(p.stdout.strip().splitlines()[-1])
                rows.append((name, "transformers (fp32, torch CPU)", h["prompt_tps"], h["decode_tps"], h["load"], h["rss_mb"]))
                print(f"{name}: transformers {h}", file=sys.stderr, flush=True)
            else:
                print(f"{name}: transformers failed: {p.stderr[-2000:]}", file=sys.stderr)
        if args.llama_bench:
            p = subprocess.run([args.llama_bench, "-m", model, "-p", str(args.prompt_tokens), "-n", str(args.gen_tokens),
                                "-t", str(args.threads), "-r", str(args.repeat), "-o", "json"], capture_output=True, text=True)
            if p.returncode == 0:
                res = json.loads(p.stdout)
                pp = next(r["avg_ts"] for r in res if r["n_prompt"] > 0)
                tg = next(r["avg_ts"] for r in res if r["n_gen"] > 0)
                rows.append((name, f"llama.cpp llama-bench ({res[0].get('build_commit', '?')}, quantized blocks)", pp, tg,
                             None, None))
                print(f"{name}: llama.cpp pp {pp:.1f} tg {tg:.1f}", file=sys.stderr, flush=True)
            else:
                print(f"{name}: llama-bench failed: {p.stderr[-2000:]}", file=sys.stderr)
    print(f"| model | engine | prompt tok/s ({args.prompt_tokens} tokens) | decode tok/s ({args.gen_tokens} tokens) | "
          "load s | peak RSS MB |")
    print("|---|---|---:|---:|---:|---:|")
    for name, eng, pp, tg, load, rss in rows:
        f = lambda v, fmt: "—" if v is None else fmt.format(v)
        print(f"| {name} | {eng} | {pp:.1f} | {tg:.1f} | {f(load, '{:.2f}')} | {f(rss, '{:.0f}')} |")


if __name__ == "__main__":
    main()
