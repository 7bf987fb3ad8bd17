#!/usr/bin/env python3
"""Checks the 4-bit checkpoints of tools/make_int4_checkpoints.py and make_mxfp4_checkpoint.py with
the quantizers' own code, against their twins:
- compressed-tensors (ct_*): every module's weight_packed and weight_zero_point unpacked by
  compressed-tensors' unpack_from_int32, dequantized as its compressor does ((q - z) * scale in
  the scales' dtype, columns grouped by weight_g_idx where present);
- MXFP4 (mxfp4): every expert tensor's _blocks and _scales through transformers'
  convert_moe_packed_tensors (transformers/integrations/mxfp4.py), as it loads gpt-oss with
  Mxfp4Config(dequantize=True).
Each must equal the twin's weight exactly.

    verify_4bit_checkpoints.py DATA_DIR [--helpers PATH]

DATA_DIR holds the checkpoints and their *_twin/ (tests/data/int4). Needs torch, safetensors
and transformers, and compressed-tensors installed or its
compressors/pack_quantized/helpers.py at --helpers.
"""
import argparse
import importlib.util
import json
import os
import sys

import torch
from safetensors.torch import load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--helpers")
    a = ap.parse_args()
    if a.helpers:
        spec = importlib.util.spec_from_file_location("ct_helpers", a.helpers)
        h = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(h)
        unpack = h.unpack_from_int32
    else:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32 as unpack
    bad = 0
    if os.path.isdir(os.path.join(a.data, "mxfp4")):
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
        q = load_file(os.path.join(a.data, "mxfp4", "model.safetensors"))
        t = load_file(os.path.join(a.data, "mxfp4_twin", "model.safetensors"))
        n = 0
        for k in sorted(q):
            if k.endswith("_blocks"):
                b = k[: -len("_blocks")]
                deq = convert_moe_packed_tensors(q[k], q[b + "_scales"]).cpu()
                if not torch.equal(deq, t[b].to(deq.dtype)):
                    print(f"mxfp4: {b} differs from its twin")
                    bad += 1
                n += 1
        print(f"mxfp4: {n} expert tensors {'checked' if n else 'FOUND NONE'}")
        bad += n == 0
    for v in sorted(d for d in os.listdir(a.data) if d.startswith("ct_") and not d.endswith("_twin")):
        q = load_file(os.path.join(a.data, v, "model.safetensors"))
        t = load_file(os.path.join(a.data, v + "_twin", "model.safetensors"))
        w = json.load(open(os.path.join(a.data, v, "config.json")))["quantization_config"]
        w = w["config_groups"]["group_0"]["weights"]
        n = 0
        for k in sorted(q):
            if not k.endswith(".weight_packed"):
                continue
            b = k[: -len(".weight_packed")]
            out, cols = q[b + ".weight_shape"].tolist()
            scale = q[b + ".weight_scale"]
            codes = unpack(q[k], 4, torch.Size([out, cols]))
            zp = None
            if b + ".weight_zero_point" in q:
                zp = unpack(q[b + ".weight_zero_point"], 4, torch.Size([out, scale.shape[-1]]), packed_dim=0)
            group = w["group_size"] if w["strategy"] == "group" else cols
            g_idx = q.get(b + ".weight_g_idx", torch.arange(cols) // group).long()
            x = codes.to(scale.dtype)
            if zp is not None:
                x = x - zp[:, g_idx].to(scale.dtype)
            deq = x * scale[:, g_idx]
            twin = t[b + ".weight"]
            if not torch.equal(deq, twin.to(deq.dtype)):
                print(f"{v}: {b} differs from its twin (max {(deq.float() - twin.float()).abs().max().item()})")
                bad += 1
            n += 1
        print(f"{v}: {n} modules {'checked' if n else 'FOUND NONE'}")
        bad += n == 0
    print("OK" if bad == 0 else f"{bad} failures")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
