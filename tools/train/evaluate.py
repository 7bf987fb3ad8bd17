"""Quick evaluation of a trained model with Hugging Face transformers.

Greedy decoding on the JSONL task files (prompt, answer, regex: the regex's group 1 taken
from the completion must equal the answer) and perplexity on heldout.txt. train.py calls
these after saving the model; run on its own to re-score a model directory:

    python3 tools/train/evaluate.py --model OUT/model --eval OUT/eval [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import EOT, IM_END, extract, read_jsonl  # noqa: E402

TASK_FILES = ["arithmetic", "recall_1k", "recall_4k", "recall_8k"]
MAX_NEW_TOKENS = {"arithmetic": 160}   # recall answers are ~17 tokens
DEFAULT_MAX_NEW_TOKENS = 32


@torch.no_grad()
def greedy_completions(model, tok, prompts: list[str], max_new_tokens: int, batch_tokens: int,
                       device: torch.device) -> list[str]:
    """Greedy completions of `prompts` (raw text, special tokens parsed), batched with left
    padding so that a batch holds about `batch_tokens` prompt tokens; decoding stops at
    <|im_end|> or <|endoftext|>. `tok` is a `tokenizers.Tokenizer`."""
    eos = [tok.token_to_id(IM_END), tok.token_to_id(EOT)]
    pad = tok.token_to_id(EOT)
    encoded = [e.ids for e in tok.encode_batch(prompts, add_special_tokens=False)]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(prompts)
    i = 0
    while i < len(order):
        longest = len(encoded[order[min(len(order) - 1, i)]])
        n = max(1, batch_tokens // max(1, longest))
        chunk = order[i:i + n]
        width = max(len(encoded[j]) for j in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, j in enumerate(chunk):
            e = encoded[j]
            ids[r, width - len(e):] = torch.tensor(e)
            mask[r, width - len(e):] = 1
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
        for r, j in enumerate(chunk):
            new = gen[r, width:].tolist()
            cut = next((k for k, t in enumerate(new) if t in eos), len(new))
            out[j] = tok.decode(new[:cut], skip_special_tokens=True)
        i += len(chunk)
    return out


def score_tasks(model, tok, eval_dir: str, device: torch.device, batch_tokens: int,
                log=print, limit: int | None = None) -> dict:
    """Exact-match accuracy per task file, with a few sample completions."""
    results = {}
    for name in TASK_FILES:
        path = os.path.join(eval_dir, f"{name}.jsonl")
        if not os.path.exists(path):
            continue
        items = read_jsonl(path)[:limit]
        t = time.time()
        completions = greedy_completions(model, tok, [it["prompt"] for it in items],
                                         MAX_NEW_TOKENS.get(name, DEFAULT_MAX_NEW_TOKENS),
                                         batch_tokens, device)
        correct = [extract(it["regex"], c) == it["answer"] for it, c in zip(items, completions)]
        acc = sum(correct) / max(1, len(items))
        results[name] = {"items": len(items), "correct": sum(correct), "accuracy": acc,
                         "seconds": round(time.time() - t, 1),
                         "samples": [{"answer": it["answer"], "completion": c, "correct": ok}
                                     for it, c, ok in list(zip(items, completions, correct))[:3]]}
        log(f"eval {name}: {sum(correct)}/{len(items)} = {acc:.1%} ({time.time() - t:.1f}s)")
    return results


@torch.no_grad()
def perplexity(model, tok, text: str, ctx: int, device: torch.device) -> dict:
    """Perplexity over `text` in non-overlapping windows of `ctx` tokens (the first token
    of each window is context only)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    nll, count = 0.0, 0
    for start in range(0, len(ids), ctx):
        window = ids[start:start + ctx]
        if len(window) < 2:
            continue
        x = torch.tensor([window], device=device)
        logits = model(input_ids=x, use_cache=False).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
        count += len(window) - 1
    return {"ctx": ctx, "tokens": count, "nll": nll / max(1, count),
            "ppl": math.exp(nll / max(1, count))}


def load(model_dir: str, device: torch.device):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return model, tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--eval", required=True, help="directory with the JSONL files and heldout.txt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-tokens", type=int, default=200_000)
    ap.add_argument("--limit", type=int, default=None, help="items per task (default all)")
    ap.add_argument("--ppl-ctx", type=int, default=2048)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, tok = load(args.model, device)
    res = score_tasks(model, tok, args.eval, device, args.batch_tokens, limit=args.limit)
    held = os.path.join(args.eval, "heldout.txt")
    if os.path.exists(held):
        res["heldout"] = perplexity(model, tok, open(held).read(), args.ppl_ctx, device)
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "samples"} for k, v in res.items()}, indent=2))


if __name__ == "__main__":
    main()
