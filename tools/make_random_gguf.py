#!/usr/bin/env python3
"""Writes a GGUF file of random quantized weights, for benchmarks of the shapes people run on
machines with no network: a Llama-architecture Qwen3-8B-sized Q4_K_M by default, or with
--experts a Qwen3-MoE (arch qwen3moe, as llama.cpp's converter writes it: per-head q/k norms,
a float32 router ffn_gate_inp and the experts stacked in ffn_{gate,up,down}_exps), or with
--shape gpt-oss-20b a GPT-OSS (arch gpt-oss: MXFP4 experts stacked the same way with float32
biases, a biased router, q/k/v/o biases, attn_sinks, post_attention_norm, YaRN, sliding 128).

    make_random_gguf.py OUT.gguf [--layers 36 --hidden 4096 --heads 32 --kv-heads 8 --ffn 12288
                                  --vocab 151936] [--mix q4_k_m | q4_0 | q8_0 | q6_k]
    make_random_gguf.py OUT.gguf --shape qwen3-30b-a3b     (48 layers, hidden 2048, 32 q / 4 KV
                                  heads of 128, 128 experts, top 8, expert width 768)
    make_random_gguf.py OUT.gguf --shape gpt-oss-20b       (24 layers, hidden 2880, 64 q / 8 KV
                                  heads of 64, 32 experts, top 4, expert width 2880; Q8_0
                                  outside the experts, as --mix q8_0)

--mix q4_k_m follows llama.cpp's recipe for that name: Q4_K everywhere, Q6_K for the output
matrix and for attn_v and ffn_down (ffn_down_exps too) in the layers llama.cpp gives more bits
(the first and last eighth, and every third layer between). Other mixes use one type for every matrix. Codes are
random bytes; each block's fp16 scales are set so that values come out around 0.01-0.1, as a
trained model's weights do (the same sizes as tests/support/ggml_blocks.h). Norms are 1; the
router is normal with standard deviation 0.05, so tokens choose different experts. The
vocabulary is token names t0, t1, ... as a byte-level BPE without merges, which cannot spell
text: benchmarks run on token ids (llama.cpp's llama-bench loads the files too). Needs only
numpy.
"""
import argparse
import struct
import sys

import numpy as np

# ggml type: (id, values per block, bytes per block, [(byte offset of an fp16 scale, size)])
TYPES = {
    "q4_0": (2, 32, 18, [(0, 6e-3)]),
    "q8_0": (8, 32, 34, [(0, 4e-4)]),
    "q4_k": (12, 256, 144, [(0, 1e-4), (2, 1e-4)]),
    "q6_k": (14, 256, 210, [(208, 1.5e-5)]),
    "mxfp4": (39, 32, 17, []),  # an E8M0 exponent byte, then 16 bytes of E2M1 codes
}
F32 = 0
ALIGN = 32


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv_u32(key, v):
    return gguf_string(key) + struct.pack("<II", 4, v)


def kv_f32(key, v):
    return gguf_string(key) + struct.pack("<If", 6, v)


def kv_str(key, v):
    return gguf_string(key) + struct.pack("<I", 8) + gguf_string(v)


def kv_str_array(key, items):
    out = gguf_string(key) + struct.pack("<IIQ", 9, 8, len(items))
    return out + b"".join(gguf_string(s) for s in items)


def random_blocks(kind, n_values, rng):
    tid, per, nbytes, scales = TYPES[kind]
    blocks = n_values // per
    data = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    for off, size in scales:
        d = (size * rng.uniform(0.5, 1.5, size=blocks)).astype(np.float16)
        data[:, off:off + 2] = d.view(np.uint8).reshape(blocks, 2)
    if kind == "q6_k":  # int8 sub-block scales: keep them positive and moderate
        data[:, 192:208] = rng.integers(8, 64, size=(blocks, 16), dtype=np.uint8)
    if kind == "mxfp4":  # scales 2^-8..2^-4 x codes up to 6: values up to ~0.4
        data[:, 0] = rng.integers(119, 124, size=blocks, dtype=np.uint8)
    return tid, data.tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=12288)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--context", type=int, default=40960)
    ap.add_argument("--head-dim", type=int, default=0, help="default: hidden / heads")
    ap.add_argument("--experts", type=int, default=0, help="a qwen3moe model of this many experts per layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-ffn", type=int, default=768)
    ap.add_argument("--shape", choices=["qwen3-30b-a3b", "gpt-oss-20b"], help="set the dimensions of a real model")
    ap.add_argument("--mix", choices=["q4_k_m", "q4_0", "q8_0", "q6_k"], default="q4_k_m")
    ap.add_argument("--gpt-oss", action="store_true", help="a gpt-oss model of --experts experts (MXFP4) per layer")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.shape == "qwen3-30b-a3b":
        a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.ffn = 48, 2048, 32, 4, 128, 6144
        a.experts, a.top_k, a.expert_ffn, a.context = 128, 8, 768, 40960
    gpt_oss = a.shape == "gpt-oss-20b" or a.gpt_oss
    if a.shape == "gpt-oss-20b":
        a.layers, a.hidden, a.heads, a.kv_heads, a.head_dim, a.ffn = 24, 2880, 64, 8, 64, 2880
        a.experts, a.top_k, a.expert_ffn, a.context, a.vocab, a.mix = 32, 4, 2880, 131072, 201088, "q8_0"
    hd = a.head_dim or a.hidden // a.heads
    if (not a.head_dim and a.hidden % a.heads) or hd % 2:
        sys.exit("--hidden must be --heads heads of an even size (or give --head-dim)")
    moe = a.experts > 0
    if gpt_oss and not moe:
        sys.exit("--gpt-oss needs --experts")
    if gpt_oss:
        a.mix = "q8_0"
    if moe and not 1 <= a.top_k <= a.experts:
        sys.exit("--top-k must be 1..--experts")
    arch = "gpt-oss" if gpt_oss else "qwen3moe" if moe else "llama"
    rng = np.random.default_rng(a.seed)
    n = a.layers

    def more_bits(i):  # llama.cpp's use_more_bits
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def kind(name, layer):
        if a.mix != "q4_k_m":
            return a.mix
        if name == "output":
            return "q6_k"
        if name in ("attn_v", "ffn_down", "ffn_down_exps") and more_bits(layer):
            return "q6_k"
        return "q4_k"

    # (name, ggml dims: cols first, kind or None for fp32 ones)
    tensors = [("token_embd.weight", (a.hidden, a.vocab), kind("token_embd", -1)),
               ("output_norm.weight", (a.hidden,), None), ("output.weight", (a.hidden, a.vocab), kind("output", -1))]
    for i in range(n):
        b = f"blk.{i}."
        if gpt_oss:
            E, I = a.experts, a.expert_ffn
            tensors += [(b + "attn_norm.weight", (a.hidden,), None), (b + "post_attention_norm.weight", (a.hidden,), None),
                        (b + "attn_q.weight", (a.hidden, a.heads * hd), "q8_0"), (b + "attn_q.bias", (a.heads * hd,), "zero"),
                        (b + "attn_k.weight", (a.hidden, a.kv_heads * hd), "q8_0"), (b + "attn_k.bias", (a.kv_heads * hd,), "zero"),
                        (b + "attn_v.weight", (a.hidden, a.kv_heads * hd), "q8_0"), (b + "attn_v.bias", (a.kv_heads * hd,), "zero"),
                        (b + "attn_output.weight", (a.heads * hd, a.hidden), "q8_0"), (b + "attn_output.bias", (a.hidden,), "zero"),
                        (b + "attn_sinks.weight", (a.heads,), "zero"),
                        (b + "ffn_gate_inp.weight", (a.hidden, E), "router"), (b + "ffn_gate_inp.bias", (E,), "zero")]
            for part, dims in (("gate", (a.hidden, I, E)), ("up", (a.hidden, I, E)), ("down", (I, a.hidden, E))):
                tensors += [(b + f"ffn_{part}_exps.weight", dims, "mxfp4"), (b + f"ffn_{part}_exps.bias", dims[1:], "zero")]
            continue
        tensors += [(b + "attn_norm.weight", (a.hidden,), None),
                    (b + "attn_q.weight", (a.hidden, a.heads * hd), kind("attn_q", i)),
                    (b + "attn_k.weight", (a.hidden, a.kv_heads * hd), kind("attn_k", i)),
                    (b + "attn_v.weight", (a.hidden, a.kv_heads * hd), kind("attn_v", i)),
                    (b + "attn_output.weight", (a.heads * hd, a.hidden), kind("attn_output", i)),
                    (b + "ffn_norm.weight", (a.hidden,), None)]
        if not moe:
            tensors += [(b + "ffn_gate.weight", (a.hidden, a.ffn), kind("ffn_gate", i)),
                        (b + "ffn_up.weight", (a.hidden, a.ffn), kind("ffn_up", i)),
                        (b + "ffn_down.weight", (a.ffn, a.hidden), kind("ffn_down", i))]
            continue
        E, I = a.experts, a.expert_ffn
        tensors += [(b + "attn_q_norm.weight", (hd,), None), (b + "attn_k_norm.weight", (hd,), None),
                    (b + "ffn_gate_inp.weight", (a.hidden, E), "router"),
                    (b + "ffn_gate_exps.weight", (a.hidden, I, E), kind("ffn_gate_exps", i)),
                    (b + "ffn_up_exps.weight", (a.hidden, I, E), kind("ffn_up_exps", i)),
                    (b + "ffn_down_exps.weight", (I, a.hidden, E), kind("ffn_down_exps", i))]
    meta = [kv_str("general.architecture", arch), kv_str("general.name", f"random {a.mix}"),
            kv_u32(f"{arch}.block_count", n), kv_u32(f"{arch}.context_length", a.context),
            kv_u32(f"{arch}.embedding_length", a.hidden), kv_u32(f"{arch}.feed_forward_length", a.ffn),
            kv_u32(f"{arch}.attention.head_count", a.heads), kv_u32(f"{arch}.attention.head_count_kv", a.kv_heads),
            kv_f32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6), kv_f32(f"{arch}.rope.freq_base", 1e6),
            # a byte-level BPE vocabulary of names without merges: llama.cpp loads it (it needs a
            # tokenizer model and, for BPE, a merges key), and nothing here tokenizes text
            kv_str("tokenizer.ggml.model", "gpt2"), kv_str("tokenizer.ggml.pre", "default"),
            kv_str_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(a.vocab)]),
            kv_str_array("tokenizer.ggml.merges", []),
            kv_u32("tokenizer.ggml.bos_token_id", 1), kv_u32("tokenizer.ggml.eos_token_id", 2)]
    if a.head_dim:
        meta += [kv_u32(f"{arch}.attention.key_length", hd), kv_u32(f"{arch}.attention.value_length", hd)]
    if moe:
        meta += [kv_u32(f"{arch}.expert_count", a.experts), kv_u32(f"{arch}.expert_used_count", a.top_k),
                 kv_u32(f"{arch}.expert_feed_forward_length", a.expert_ffn)]
    if gpt_oss:
        meta += [kv_u32(f"{arch}.attention.sliding_window", 128), kv_str(f"{arch}.rope.scaling.type", "yarn"),
                 kv_f32(f"{arch}.rope.scaling.factor", 32.0), kv_u32(f"{arch}.rope.scaling.original_context_length", 4096)]
    infos, offset, sizes = [], 0, []
    for name, dims, k in tensors:
        count = int(np.prod(dims))
        if k is None or k == "router" or k == "zero":
            tid, size = F32, 4 * count
        else:
            tid, per, nbytes, _ = TYPES[k]
            if dims[0] % per:
                sys.exit(f"{name}: a row of {dims[0]} is not whole {k} blocks")
            size = count // per * nbytes
        infos.append(gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) +
                     struct.pack("<IQ", tid, offset))
        sizes.append(size)
        offset += (size + ALIGN - 1) // ALIGN * ALIGN
    with open(a.out, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)))
        f.write(b"".join(meta) + b"".join(infos))
        f.write(b"\0" * (-f.tell() % ALIGN))
        for (name, dims, k), size in zip(tensors, sizes):
            if k is None:
                f.write(np.ones(int(np.prod(dims)), dtype=np.float32).tobytes())
            elif k == "zero":  # biases and sinks
                f.write(np.zeros(int(np.prod(dims)), dtype=np.float32).tobytes())
            elif k == "router":
                f.write((rng.standard_normal(int(np.prod(dims))) * 0.05).astype(np.float32).tobytes())
            else:
                f.write(random_blocks(k, int(np.prod(dims)), rng)[1])
            f.write(b"\0" * (-size % ALIGN))
    print(f"wrote {a.out}: {arch}, {len(tensors)} tensors, {offset / 1e9:.2f} GB of data "
          f"({'MXFP4 experts, ' if gpt_oss else ''}{a.mix})")


if __name__ == "__main__":
    main()
