#!/usr/bin/env python3
"""Make the embedding goldens: a tiny decoder embedding model laid out as Qwen3-Embedding ships
(config.json says Qwen3ForCausalLM, the tensors are a bare Qwen3Model's -- `embed_tokens.weight`,
`layers.N....`, `norm.weight`, no `model.` prefix and no lm_head --, sentence-transformers'
modules.json with a last-token Pooling module and Normalize), and what transformers computes
for it: the final hidden states (after the final RMSNorm) of each input, pooled by the last
token and by the mean over tokens, L2-normalized, and the last-token vector cut to the first
16 dimensions and normalized again (Matryoshka `dimensions`).

Writes, under --out DIR:

  model/config.json, model/model.safetensors, model/modules.json, model/1_Pooling/config.json
  expected.json   inputs (token ids) and, per input, "last", "mean" and "last16" vectors

Runs on the CPU in float32 (the bf16 weights read back as transformers reads them),
attn_implementation="eager", one thread, fixed seeds.

Usage (needs torch, transformers, safetensors):
    python3 tools/make_embedding_goldens.py --out DIR
"""

import argparse
import json
import math
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_goldens import VOCAB, base_config  # noqa: E402

SEED = 21000
LENGTHS = [1, 5, 17, 40]


def config():
    cfg = base_config("Qwen3ForCausalLM", "qwen3", "bfloat16", head_dim=32, tie_word_embeddings=True,
                      rope_theta=1000000.0, attention_bias=False, use_sliding_window=False)
    # Matryoshka: the model's leading dimensions are an embedding of their own, so a request's
    # `dimensions` may cut the vector (vLLM reads the same field).
    cfg["is_matryoshka"] = True
    return cfg


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorms: 1 + 0.1 N(0, 1)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name == "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear weights: N(0, 1 / fan_in)
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = os.path.abspath(args.out)
    mdir = os.path.join(out, "model")
    os.makedirs(os.path.join(mdir, "1_Pooling"), exist_ok=True)
    cfg = config()
    write_json(os.path.join(mdir, "config.json"), cfg)
    write_json(os.path.join(mdir, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json(os.path.join(mdir, "1_Pooling", "config.json"), {
        "word_embedding_dimension": cfg["hidden_size"],
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True,
        "include_prompt": True,
    })

    # Build the bare Qwen3Model, randomize, save in bf16 under its own (unprefixed) names.
    hf_cfg = transformers.AutoConfig.from_pretrained(mdir)
    base = AutoModel.from_config(hf_cfg, dtype=torch.float32)
    randomize(base, SEED)
    tensors = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in base.named_parameters()}
    save_file(tensors, os.path.join(mdir, "model.safetensors"), metadata={"format": "pt"})

    # Read back as transformers does (a bare checkpoint loads into AutoModel directly).
    model = AutoModel.from_pretrained(mdir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    g = torch.Generator().manual_seed(SEED + 1)
    inputs = [[1] + torch.randint(3, VOCAB, (n - 1,), generator=g).tolist() for n in LENGTHS]
    results = []
    with torch.no_grad():
        for ids in inputs:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [T][hidden], final-normed
            last = torch.nn.functional.normalize(h[-1], dim=-1)
            mean = torch.nn.functional.normalize(h.mean(dim=0), dim=-1)
            last16 = torch.nn.functional.normalize(h[-1][:16], dim=-1)
            results.append({"ids": ids, "last": last.tolist(), "mean": mean.tolist(), "last16": last16.tolist(),
                            "hidden_norm_last": float(h[-1].norm())})
    write_json(os.path.join(out, "expected.json"), {
        "model": "qwen3-embed",
        "tensor_names": sorted(tensors)[:3] + ["..."],
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "pooling": "last token (modules.json), normalized; mean and last16 for the engine's other modes",
        "inputs": results,
    })
    print("wrote", out, "transformers", transformers.__version__, "torch", torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
