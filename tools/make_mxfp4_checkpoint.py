#!/usr/bin/env python3
"""Writes a GPT-OSS checkpoint's experts in MXFP4, laid out as OpenAI released gpt-oss-20b/120b
(quant_method mxfp4), beside a bfloat16 twin holding exactly the weights they encode, so that a
loader's tokens on each can be compared with its twin's (io/int4_checkpoint.h).

    make_mxfp4_checkpoint.py SRC_DIR OUT_DIR

writes OUT_DIR/mxfp4/ and OUT_DIR/mxfp4_twin/. Each mlp.experts.gate_up_proj [E][in][out] and
down_proj becomes `_blocks` uint8 [E][out][in/32][16] and `_scales` uint8 [E][out][in/32]: per
32 input columns of an output row an E8M0 exponent e (the block's largest magnitude over 6,
rounded up to a power of two: 2^(e - 127)), and per column an E2M1 code (sign, exponent, mantissa:
0, 0.5, 1, 1.5, 2, 3, 4, 6), two to a byte, the even column in the low nibble. The twin's
experts are those codes times their scales, transposed back to [E][in][out] (what transformers'
convert_moe_packed_tensors gives; exact in bfloat16). Everything else is copied. Needs numpy.
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_int4_checkpoints import read_safetensors, to_bf16, to_f32, write_safetensors  # noqa: E402

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def quantize_mxfp4(w):
    """w [E][out][in] -> blocks uint8 [E][out][in/32][16], scales uint8 [E][out][in/32], values."""
    E, out, n_in = w.shape
    g = w.reshape(E, out, n_in // 32, 32)
    amax = np.abs(g).max(axis=-1)
    # the smallest power of two s with amax / s <= 6
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127).astype(np.int64)
    exp = np.clip(exp, -127, 127)
    scale = np.ldexp(np.float32(1), exp)[..., None].astype(np.float32)
    mag = np.abs(g) / scale
    idx = np.abs(mag[..., None] - E2M1).argmin(axis=-1)  # nearest code (ties to the smaller)
    codes = idx | np.where(g < 0, 8, 0)
    values = np.where(g < 0, -E2M1[idx], E2M1[idx]) * scale
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8), values.reshape(E, out, n_in)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    a = ap.parse_args()
    tensors = {}
    for f in sorted(f for f in os.listdir(a.src) if f.endswith(".safetensors")):
        tensors.update(read_safetensors(os.path.join(a.src, f)))
    config = json.load(open(os.path.join(a.src, "config.json")))
    q, twin = {}, {}
    for name, (dtype, arr) in tensors.items():
        if not name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            q[name] = twin[name] = (dtype, arr)
            continue
        w = to_f32(dtype, arr).transpose(0, 2, 1)  # [E][in][out] -> [E][out][in]
        blocks, scales, values = quantize_mxfp4(np.ascontiguousarray(w))
        q[name + "_blocks"] = ("U8", blocks)
        q[name + "_scales"] = ("U8", scales)
        twin[name] = ("BF16", to_bf16(np.ascontiguousarray(values.transpose(0, 2, 1))))
    qc = {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                     "lm_head"]}
    for sub, ts, cfg in (("mxfp4", q, dict(config, quantization_config=qc)), ("mxfp4_twin", twin, config)):
        d = os.path.join(a.out, sub)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), ts)
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
        if os.path.exists(os.path.join(a.src, "generation_config.json")):
            shutil.copy(os.path.join(a.src, "generation_config.json"), d)
    print("wrote mxfp4, mxfp4_twin in", a.out)


if __name__ == "__main__":
    main()
