#!/usr/bin/env python3
"""Writes a GGUF file's model as a bf16 Hugging Face directory (config.json, model.safetensors,
tokenizer files), read by transformers' own GGUF loader (dequantized), so that the AWQ / GPTQ /
compressed-tensors tools (make_int4_checkpoints.py) and perplexity runs have a base made from the
only real weights that can be fetched here (docs/results/weights-4bit.md, "Accuracy").

    gguf_to_hf.py DIR FILE.gguf OUT_DIR

Needs torch, transformers (5.x), accelerate and gguf. transformers refuses to save_pretrained a
model it loaded from GGUF, so the state dict and config are written directly (the tied LM head
left out, as the Hub stores it).
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="the directory holding the .gguf file")
    ap.add_argument("gguf", help="the file's name in that directory")
    ap.add_argument("out")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.dir, gguf_file=a.gguf)
    model = AutoModelForCausalLM.from_pretrained(a.dir, gguf_file=a.gguf, dtype=torch.float32)
    os.makedirs(a.out, exist_ok=True)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(a.out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    for k in ("quantization_config", "_name_or_path", "dtype"):
        cfg.pop(k, None)
    cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model.generation_config.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    print(f"wrote {a.out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
