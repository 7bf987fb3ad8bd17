#!/usr/bin/env python3
"""Writes a Hugging Face directory of random AWQ weights (AutoAWQ's GEMM layout, 4-bit, groups of
--group) in a Qwen3 model's shape (Qwen3-8B by default), for benchmarks on machines with no
network: every q/k/v/o and gate/up/down projection packed as AWQ packs it (qweight int32
[in][out/8] in AWQ's nibble order, qzeros [in/g][out/8], fp16 scales [in/g][out]), with
codes and zero points random and scales around 2e-3, so that values come out around 0.01-0.03
as a trained model's do; embeddings and the LM head (which AWQ leaves unquantized) random bf16,
norms 1. No tokenizer (decode benchmarks need none). Needs only numpy.

With --experts E a Qwen3-MoE model instead (Qwen3MoeForCausalLM): every layer's MLP is E experts
of width --expert-ffn, top --top-k, each expert's gate/up/down projections AWQ-packed as
AutoAWQ quantizes Qwen3-30B-A3B, the router (mlp.gate) left in bf16 as AWQ leaves it. Experts
cycle through a pool of 8 random ones (a benchmark reads each copy from its own address; it
saves generating 15 GB of random numbers), and the file is written tensor by tensor.

    make_random_awq.py OUT_DIR [--layers 36 --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128
                                --ffn 12288 --vocab 151936 --group 128]
    make_random_awq.py OUT_DIR --layers 48 --hidden 2048 --heads 32 --kv-heads 4 --experts 128
                                --expert-ffn 768 --top-k 8          # Qwen3-30B-A3B's shape
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def write_safetensors_streamed(path, tensors):
    """As make_int4_checkpoints.write_safetensors, one tensor at a time (no copy of the whole file)."""
    header, off = {}, 0
    for name, (dtype, arr) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    for name, default in (("layers", 36), ("hidden", 4096), ("heads", 32), ("kv-heads", 8), ("head-dim", 128),
                          ("ffn", 12288), ("vocab", 151936), ("group", 128), ("experts", 0), ("expert-ffn", 768),
                          ("top-k", 8)):
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    h, hd, g = a.hidden, a.head_dim, a.group

    def bf16(shape, scale):
        v = (rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32)
        return ("BF16", (v >> 16).astype(np.uint16))

    def awq(prefix, out, n_in):
        return {prefix + ".qweight": ("I32", rng.integers(0, 2**32, (n_in, out // 8), dtype=np.uint32).view(np.int32)),
                prefix + ".qzeros": ("I32", rng.integers(0, 2**32, (n_in // g, out // 8), dtype=np.uint32).view(np.int32)),
                prefix + ".scales": ("F16", (rng.random((n_in // g, out), dtype=np.float32) * 2e-3 + 1e-3)
                                     .astype(np.float16))}

    i2 = a.expert_ffn
    pool = [{n: {k[len("m"):]: v for k, v in awq("m", out, n_in).items()}
             for n, out, n_in in (("gate_proj", i2, h), ("up_proj", i2, h), ("down_proj", h, i2))}
            for _ in range(8 if a.experts else 0)]
    t = {"model.embed_tokens.weight": bf16((a.vocab, h), 0.02), "lm_head.weight": bf16((a.vocab, h), 0.02),
         "model.norm.weight": ("BF16", np.full(h, 0x3F80, np.uint16))}
    for i in range(a.layers):
        p = f"model.layers.{i}."
        for n, size in (("input_layernorm", h), ("post_attention_layernorm", h), ("self_attn.q_norm", hd),
                        ("self_attn.k_norm", hd)):
            t[p + n + ".weight"] = ("BF16", np.full(size, 0x3F80, np.uint16))
        for n, out, n_in in (("self_attn.q_proj", a.heads * hd, h), ("self_attn.k_proj", a.kv_heads * hd, h),
                             ("self_attn.v_proj", a.kv_heads * hd, h), ("self_attn.o_proj", h, a.heads * hd)):
            t.update(awq(p + n, out, n_in))
        if not a.experts:
            for n, out, n_in in (("mlp.gate_proj", a.ffn, h), ("mlp.up_proj", a.ffn, h), ("mlp.down_proj", h, a.ffn)):
                t.update(awq(p + n, out, n_in))
            continue
        t[p + "mlp.gate.weight"] = bf16((a.experts, h), 0.02)
        for e in range(a.experts):
            x = f"{p}mlp.experts.{e}."
            for n, parts in pool[e % len(pool)].items():
                for k, v in parts.items():
                    t[x + n + k] = v
    os.makedirs(a.out, exist_ok=True)
    write_safetensors_streamed(os.path.join(a.out, "model.safetensors"), t)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": h,
              "intermediate_size": a.ffn, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
              "num_key_value_heads": a.kv_heads, "head_dim": hd, "vocab_size": a.vocab, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": min(151643, a.vocab - 2),
              "eos_token_id": min(151645, a.vocab - 1),
              "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": ["gate"] if a.experts else None}}
    if a.experts:
        config.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": a.experts,
                       "num_experts_per_tok": a.top_k, "moe_intermediate_size": i2, "norm_topk_prob": True,
                       "decoder_sparse_step": 1, "mlp_only_layers": []})
    json.dump(config, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
