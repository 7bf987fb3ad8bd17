#!/usr/bin/env python3
"""Write a random-weight checkpoint of a real model's shape, for benchmarks (bench/decode_bench).

    python3 tools/make_random_model.py --shape qwen3-8b --out /dev/shm/qwen3-8b-random
    python3 tools/make_random_model.py --shape qwen3-8b-dflash --out /dev/shm/qwen3-8b-dflash-random
    python3 tools/make_random_model.py --shape llama3-70b --layers 40 --out /dev/shm/llama3-70b-40l
    python3 tools/make_random_model.py --shape qwen3-8b --fp8-block --out /dev/shm/qwen3-8b-fp8-block
    python3 tools/make_random_model.py --shape qwen3-30b-a3b --out /dev/shm/qwen3-30b-a3b-random
    python3 tools/make_random_model.py --shape gpt-oss-20b --out /dev/shm/gpt-oss-20b-random
    python3 tools/make_random_model.py --shape qwen3.5-default --out /dev/shm/qwen3.5-random

Writes config.json (the shape's Hugging Face config) and model-0000N-of-0000M.safetensors
shards with a model.safetensors.index.json, in bfloat16: linear weights ~ N(0, 0.02^2), norm
weights 1. Weights are drawn on the GPU when one is present (seconds), else on the CPU. The
output is ~16 GB for qwen3-8b: write it on the GPU machine (a RAM disk such as /dev/shm is
fastest) and never commit it. The tensors' values do not matter to a timing; the shapes,
dtype and names do. --fp8-block writes the decoder's linear weights as the block-wise FP8 of
Qwen3-*-FP8 / DeepSeek-V3 instead (float8_e4m3fn codes and a float32 weight_scale_inv per 128 x
128 block, quantization_config {quant_method fp8, weight_block_size [128, 128], activation_scheme
dynamic}; embedding, norms and lm_head stay bfloat16).
"""

import argparse
import json
import os
import sys
import time

SHAPES = {
    # Qwen/Qwen3-8B config.json (architecture fields only)
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 36,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}
# meta-llama/Meta-Llama-3-70B config.json (architecture fields only): 141 GB in bfloat16, more
# than a RAM disk of the two-GPU machine holds; --layers writes fewer of its (identical) layers.
SHAPES["llama3-70b"] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
# The DFlash drafter of Qwen3-8B (z-lab/Qwen3-8B-DFlash-b16's config.json, architecture fields).
SHAPES["qwen3-8b-dflash"] = dict(
    SHAPES["qwen3-8b"],
    architectures=["DFlashDraftModel"],
    num_hidden_layers=5,
    max_window_layers=5,
    block_size=16,
    num_target_layers=36,
    dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
)
# Qwen/Qwen3-30B-A3B config.json (architecture fields only): 128 experts of width 768, top 8,
# every layer sparse; ~61 GB in bfloat16.
SHAPES["qwen3-30b-a3b"] = dict(
    SHAPES["qwen3-8b"],
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_window_layers=48,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
# openai/gpt-oss-20b config.json (architecture fields only), its experts in bfloat16 (the
# release's MXFP4 dequantized, as unsloth/gpt-oss-20b-BF16 ships them): ~42 GB.
SHAPES["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "eos_token_id": 200002,
    "torch_dtype": "bfloat16",
}

# transformers' default Qwen3_5TextConfig (5.24), the issue's reference shape: 32 layers, three
# Gated DeltaNet layers before each full-attention one (24 + 8), hidden 4096: ~18 GB.
SHAPES["qwen3.5-default"] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(32)],
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "eos_token_id": 248044,
    "torch_dtype": "bfloat16",
}


def attention_tensors(cfg, layer, p):
    """A layer's token mixer: softmax attention, or a hybrid's Gated DeltaNet layer."""
    h, d, nh, kvh = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if cfg.get("layer_types", [None] * (layer + 1))[layer] == "linear_attention":
        kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        hv = cfg["linear_num_value_heads"]
        vd = hv * cfg["linear_value_head_dim"]
        q = p + "linear_attn."
        return [(q + "in_proj_qkv.weight", (2 * kd + vd, h), "linear"), (q + "in_proj_z.weight", (vd, h), "linear"),
                (q + "in_proj_b.weight", (hv, h), "linear"), (q + "in_proj_a.weight", (hv, h), "linear"),
                (q + "conv1d.weight", (2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]), "linear"),
                (q + "dt_bias", (hv,), "norm"), (q + "A_log", (hv,), "bias"),
                (q + "norm.weight", (cfg["linear_value_head_dim"],), "norm"),
                (q + "out_proj.weight", (h, vd), "linear")]
    gated = cfg["model_type"] == "qwen3_5_text"  # q_proj holds each head's query and gate
    return [(p + "self_attn.q_proj.weight", ((2 if gated else 1) * nh * d, h), "linear"),
            (p + "self_attn.k_proj.weight", (kvh * d, h), "linear"),
            (p + "self_attn.v_proj.weight", (kvh * d, h), "linear"),
            (p + "self_attn.o_proj.weight", (h, nh * d), "linear")]


def mlp_tensors(cfg, p):
    """A layer's MLP: dense, Qwen3-MoE's per-expert tensors or GPT-OSS's fused ones."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    if cfg["model_type"] == "qwen3_moe":
        e, w = cfg["num_experts"], cfg["moe_intermediate_size"]
        out = [(p + "mlp.gate.weight", (e, h), "linear")]
        for x in range(e):
            out += [(p + f"mlp.experts.{x}.gate_proj.weight", (w, h), "linear"),
                    (p + f"mlp.experts.{x}.up_proj.weight", (w, h), "linear"),
                    (p + f"mlp.experts.{x}.down_proj.weight", (h, w), "linear")]
        return out
    if cfg["model_type"] == "gpt_oss":
        e = cfg["num_local_experts"]
        return [(p + "mlp.router.weight", (e, h), "linear"), (p + "mlp.router.bias", (e,), "bias"),
                (p + "mlp.experts.gate_up_proj", (e, h, 2 * i), "linear"),
                (p + "mlp.experts.gate_up_proj_bias", (e, 2 * i), "bias"),
                (p + "mlp.experts.down_proj", (e, i, h), "linear"),
                (p + "mlp.experts.down_proj_bias", (e, h), "bias")]
    return [(p + "mlp.gate_proj.weight", (i, h), "linear"), (p + "mlp.up_proj.weight", (i, h), "linear"),
            (p + "mlp.down_proj.weight", (h, i), "linear")]


def tensors(cfg):
    """(name, shape, kind) in checkpoint order; kind is 'linear' or 'norm'."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nh, kvh = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    drafter = "dflash_config" in cfg
    if drafter:  # features -> fc -> hidden_norm; the target's embedding and LM head
        n = len(cfg["dflash_config"]["target_layer_ids"])
        out = [("fc.weight", (h, n * h), "linear"), ("hidden_norm.weight", (h,), "norm")]
    else:
        out = [("model.embed_tokens.weight", (v, h), "linear")]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}." if drafter else f"model.layers.{layer}."
        linear = cfg.get("layer_types", [None] * (layer + 1))[layer] == "linear_attention"
        out += ([(p + "input_layernorm.weight", (h,), "norm")] + attention_tensors(cfg, layer, p) +
                [(p + "post_attention_layernorm.weight", (h,), "norm")] + mlp_tensors(cfg, p))
        if cfg.get("attention_bias"):
            out += [(p + f"self_attn.{x}_proj.bias", (n,), "bias")
                    for x, n in (("q", nh * d), ("k", kvh * d), ("v", kvh * d), ("o", h))]
        if cfg["model_type"] == "gpt_oss":
            out.append((p + "self_attn.sinks", (nh,), "bias"))
        if cfg["model_type"] in ("qwen3", "qwen3_moe", "qwen3_5_text") and not linear:
            out += [(p + "self_attn.q_norm.weight", (d,), "norm"), (p + "self_attn.k_norm.weight", (d,), "norm")]
    out.append(("norm.weight" if drafter else "model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"] and not drafter:
        out.append(("lm_head.weight", (v, h), "linear"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, help="write this many decoder layers instead of the shape's")
    ap.add_argument("--fp8-block", action="store_true", help="decoder linear weights as block-wise FP8 (128 x 128)")
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    cfg = dict(SHAPES[args.shape])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = args.layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:args.layers]
    if args.fp8_block:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    specs = tensors(cfg)
    shards, cur, cur_bytes = [], [], 0
    limit = int(args.shard_gb * (1 << 30))
    for name, shape, kind in specs:
        nbytes = 2
        for s in shape:
            nbytes *= s
        if cur and cur_bytes + nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, kind))
        cur_bytes += nbytes
    shards.append(cur)
    t0 = time.time()
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name, shape, kind in shard:
            if kind == "norm":
                t = torch.ones(shape, dtype=torch.bfloat16, device=dev)
            elif kind == "bias":
                t = torch.zeros(shape, dtype=torch.bfloat16, device=dev)
            else:
                t = (torch.randn(shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
            if args.fp8_block and kind == "linear" and ".layers." in name and len(shape) == 2 and "experts" not in name:
                rows, cols = shape
                assert rows % 128 == 0 and cols % 128 == 0, name
                blocks = t.float().abs().reshape(rows // 128, 128, cols // 128, 128).amax(dim=(1, 3)) / 448.0
                blocks = blocks.clamp(min=1e-12)
                full = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
                codes = (t.float() / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                out[name] = codes.cpu()
                out[name + "_scale_inv"] = blocks.cpu()
                weight_map[name] = weight_map[name + "_scale_inv"] = fname
                total += codes.numel() + blocks.numel() * 4
                continue
            out[name] = t.cpu()
            weight_map[name] = fname
            total += t.numel() * 2
        save_file(out, os.path.join(args.out, fname), metadata={"format": "pt"})
        del out
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print(f"wrote {args.out}: {args.shape}, {total / 1e9:.2f} GB in {len(shards)} shards, {time.time() - t0:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
