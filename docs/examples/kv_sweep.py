"""Sweep every KV-cache precision on one model: perplexity and KL divergence against a bf16
cache, bytes per token, and batched decode speed — and plot them. A notebook in script form:

    python docs/examples/kv_sweep.py [--model models/kvlm-tiny] [--device cuda] [--out sweep.json] [--plot sweep.png]

Needs the kvlm package (`pip install .`, or PYTHONPATH=build/python) and, for the plot,
matplotlib.
"""
import argparse
import json
import os
import tempfile
import time

import kvlm
from kvlm import LLM, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="models/kvlm-tiny")
ap.add_argument("--text", default="models/kvlm-tiny/eval/heldout.txt")
ap.add_argument("--device", default="auto")
ap.add_argument("--ctx", type=int, default=512)
ap.add_argument("--chunks", type=int, default=32)
ap.add_argument("--batch", type=int, default=64, help="sequences decoding at once for the speed column")
ap.add_argument("--out", default="kv_sweep.json")
ap.add_argument("--plot", default="")
ap.add_argument("--replot", default="", help="plot the rows of an earlier --out file instead of measuring")
args = ap.parse_args()

MODES = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"]
text = open(args.text, encoding="utf-8").read()
base = os.path.join(tempfile.mkdtemp(prefix="kv-sweep-"), "bf16.lgp")
rows = json.load(open(args.replot)) if args.replot else []
for mode in [] if args.replot else MODES:
    llm = LLM(model=args.model, kv_cache_dtype=mode, device=args.device, max_model_len=2048, gpu_memory_utilization=0.5)
    plan = kvlm.inspect(args.model, kv_cache_dtype=mode, device=args.device)
    first = mode == "bfloat16"
    ppl = kvlm.eval.perplexity(llm, text, ctx=args.ctx, max_chunks=args.chunks, save_logits=base if first else None,
                          kl_divergence_base=None if first else base)
    # Decode speed: `batch` sequences of a 512-token prompt, 128 new tokens each, greedy.
    tok = llm.get_tokenizer()
    prompt = tok.encode(text[:20000])[:512]
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt[i:] + prompt[:i] for i in range(4)], sp, use_tqdm=False)  # warm-up (graphs, kernels)
    t0 = time.perf_counter()
    outs = llm.generate([prompt[i:] + prompt[:i] for i in range(args.batch)], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"kv_cache_dtype": mode, "bytes_per_token": sum(l["bytes_per_token"] for l in plan), "ppl": ppl["ppl"],
           "kld_mean": ppl.get("kld_mean", 0.0), "kld_p99": ppl.get("kld_p99", 0.0),
           "same_top": ppl.get("same_top", 1.0), "tokens_per_s": gen / dt, "device": llm.info["device"]}
    rows.append(row)
    print(json.dumps(row))
    del llm  # frees its KV pool before the next precision's
if not args.replot:
    json.dump(rows, open(args.out, "w"), indent=1)

if args.plot:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["kv_cache_dtype"].replace("_per_token_head", "/tok-head") for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    ax[0].bar(names, [r["ppl"] for r in rows], color="#4c72b0")
    ax[0].set_title("perplexity (heldout text)")
    ax[0].set_ylim(min(r["ppl"] for r in rows) * 0.98, max(r["ppl"] for r in rows) * 1.01)
    kld = [max(r["kld_mean"], 1e-8) for r in rows[1:]]
    ax[1].bar(names[1:], kld, color="#dd8452")
    ax[1].set_yscale("log")
    ax[1].set_title("mean KL divergence vs bf16 cache")
    ax[2].bar(names, [r["tokens_per_s"] for r in rows], color="#55a868")
    for i, r in enumerate(rows):
        ax[2].text(i, r["tokens_per_s"], f'{r["bytes_per_token"]} B/tok', ha="center", va="bottom", fontsize=8)
    ax[2].set_title(f"decode tokens/s, {args.batch} sequences ({rows[0]['device']})")
    for a in ax:
        a.tick_params(axis="x", rotation=35)
    fig.suptitle(f"{os.path.basename(os.path.normpath(args.model))}: every KV precision through kvlm's Python API")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print("wrote", args.plot)
