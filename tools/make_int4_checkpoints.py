#!/usr/bin/env python3
"""Writes 4-bit AWQ, GPTQ and compressed-tensors checkpoints of a small safetensors model, laid
out as AutoAWQ, AutoGPTQ / GPTQModel and llm-compressor write them, each beside a twin holding
exactly the weights they encode, so that a loader's tokens on each can be compared with its
twin's (io/int4_checkpoint.h).

    make_int4_checkpoints.py SRC_DIR OUT_DIR [--group 32]

writes OUT_DIR/{awq, gptq, gptq_v2, ct_w4a16, ct_asym_actorder, ct_channel}/, each with a
NAME_twin/ beside it. Every q/k/v/o and gate/up/down
projection is quantized per group of --group input columns (asymmetric: a scale and a zero
point per group and output row; GPTQ also with desc_act, input rows assigned to groups in a
shuffled order through g_idx, and GPTQ's symmetric zero point 8 on the MLP); the twin holds
(q - z) * scale in float32, which is exact (fp16 scales times integers), so a loader that
reads the layouts right gives the twin's logits bit for bit. Norms, embeddings and the LM head
are copied as they are. Needs numpy only.

compressed-tensors (pack-quantized, W4A16) codes are signed (-8..7) and stored + 8; its scales
are bfloat16 as llm-compressor writes them for a bf16 model, here rounded to 4 significant bits
so that (q - z) * scale is exact in bfloat16 too (transformers dequantizes in the scales' dtype),
and its twins are bfloat16: ct_w4a16 is the common recipe (symmetric, groups of --group),
ct_asym_actorder has zero points and actorder "group" (a shuffled weight_g_idx, as
llm-compressor wrote it before dropping that option), ct_channel one scale and zero point per
output row.

  AWQ (GEMM):  qweight int32 [in][out/8], nibble i of column c = output 8c + (0,2,4,6,1,3,5,7)[i];
               qzeros int32 [in/g][out/8] the same; scales fp16 [in/g][out]
  GPTQ:        qweight int32 [in/8][out], nibble j of row r = input 8r + j; qzeros int32
               [groups][out/8], nibble j = output 8c + j, holding z - 1 (checkpoint_format gptq)
               or z (gptq_v2); scales fp16 [groups][out]; g_idx int32 [in]
  compressed-tensors: weight_packed int32 [out][in/8], nibble j of word c = input 8c + j, code + 8;
               weight_scale bf16 [out][groups]; weight_zero_point int32 [out/8][groups], packed
               along the output, z + 8 (absent when symmetric); weight_shape int64 [2];
               weight_g_idx int32 [in] (actorder group)
"""
import argparse
import json
import os
import shutil
import struct

import numpy as np

DT = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "BF16": np.uint16, "I64": np.int64, "U8": np.uint8}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=DT[t["dtype"]]).reshape(t["shape"])
        out[name] = (t["dtype"], arr)
    return out


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def to_f32(dtype, arr):
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def quantize_groups(w, group, g_idx, scale_zero, lo_code, hi_code):
    """w [out][in] in groups of input columns (g_idx [in], default i / group): scale_zero(wg)
    gives each group's scales and zero points per output row; returns codes [out][in] in
    lo_code..hi_code, scales and zeros [groups][out], g_idx and the exact dequantized weight."""
    out, n_in = w.shape
    groups = n_in // group
    if g_idx is None:
        g_idx = np.arange(n_in) // group
    scales = np.zeros((groups, out), np.float32)
    zeros = np.zeros((groups, out), np.int64)
    codes = np.zeros((out, n_in), np.int64)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        s, z = scale_zero(w[:, cols])
        scales[g], zeros[g] = s, z
        codes[:, cols] = np.clip(np.round(w[:, cols] / s[:, None]) + z[:, None], lo_code, hi_code)
    deq = (codes - zeros[g_idx].T) * scales[g_idx].T  # [out][in], exact
    return codes, zeros, scales, g_idx.astype(np.int32), deq.astype(np.float32)


def quantize(w, group, sym, rng, g_idx=None, min_zero=0):
    """AWQ / GPTQ: w [out][in] -> codes 0..15 [out][in], zeros and fp16 scales [groups][out],
    g_idx [in], the dequantized weight."""
    def scale_zero(wg):
        if sym:
            s = (np.abs(wg).max(axis=1) / 7.5).astype(np.float16)
            z = np.full(wg.shape[0], 8)
        else:
            lo, hi = wg.min(axis=1), wg.max(axis=1)
            s = ((hi - lo) / 15).astype(np.float16)
            s[s == 0] = np.float16(1e-3)
            z = np.clip(np.round(-lo / s.astype(np.float32)), min_zero, 15).astype(np.int64)
        s[s == 0] = np.float16(1e-3)
        return s.astype(np.float32), z

    codes, zeros, scales, g_idx, deq = quantize_groups(w, group, g_idx, scale_zero, 0, 15)
    return codes, zeros, scales.astype(np.float16), g_idx, deq


def round_bits(x, bits):
    """x rounded to `bits` significant bits (exactly representable in bfloat16 for bits <= 8)."""
    m, e = np.frexp(x.astype(np.float32))
    return np.ldexp(np.round(m * (1 << bits)) / (1 << bits), e).astype(np.float32)


def quantize_ct(w, group, sym, g_idx=None):
    """llm-compressor's min-max observer: w [out][in] -> signed codes -8..7 [out][in], signed
    zero points and scales [out][groups] (scales with 4 significant bits), the dequantized weight."""
    def scale_zero(wg):
        lo, hi = np.minimum(wg.min(axis=1), 0), np.maximum(wg.max(axis=1), 0)
        if sym:
            s = round_bits(np.maximum(-lo, hi) / 7.5, 4)
            s[s == 0] = 2.0 ** -10
            return s, np.zeros(wg.shape[0], np.int64)
        s = round_bits((hi - lo) / 15, 4)
        s[s == 0] = 2.0 ** -10
        return s, np.clip(np.round(-8 - lo / s), -8, 7).astype(np.int64)

    codes, zeros, scales, g_idx, deq = quantize_groups(w, group or w.shape[1], g_idx, scale_zero, -8, 7)
    return codes, zeros.T, scales.T, g_idx, deq


def to_bf16(x):
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    assert not (bits & 0xFFFF).any(), "not exactly representable in bfloat16"
    return (bits >> 16).astype(np.uint16)


def pack_columns(v, order):
    """[rows][cols] nibbles -> int32 [rows][cols / 8], nibble i of word c = column 8c + order[i]."""
    rows, cols = v.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for i, c in enumerate(order):
        out |= (v[:, c::8].astype(np.uint32) & 0xF) << np.uint32(4 * i)
    return out.view(np.int32)


def pack_rows(v):
    """[rows][cols] nibbles -> int32 [rows / 8][cols], nibble j of word r = row 8r + j."""
    rows, cols = v.shape
    out = np.zeros((rows // 8, cols), np.uint32)
    for j in range(8):
        out |= (v[j::8].astype(np.uint32) & 0xF) << np.uint32(4 * j)
    return out.view(np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--group", type=int, default=32)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    files = sorted(f for f in os.listdir(a.src) if f.endswith(".safetensors"))
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(os.path.join(a.src, f)))
    config = json.load(open(os.path.join(a.src, "config.json")))
    variants = {
        "awq": {"quant_method": "awq", "bits": 4, "group_size": a.group, "zero_point": True, "version": "gemm"},
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": a.group, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq"},
        "gptq_v2": {"quant_method": "gptq", "bits": 4, "group_size": a.group, "desc_act": False, "sym": False,
                    "checkpoint_format": "gptq_v2"},
    }
    ct_group = {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                "format": "pack-quantized"}
    ct_weights = {"num_bits": 4, "type": "int", "dynamic": False, "observer": "minmax", "observer_kwargs": {},
                  "block_structure": None}

    def ct_config(sym, strategy, actorder):
        w = dict(ct_weights, symmetric=sym, strategy=strategy, actorder=actorder,
                 group_size=a.group if strategy == "group" else None)
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": dict(ct_group, weights=w)}, "ignore": ["lm_head"],
                "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
                "global_compression_ratio": None, "version": "0.12.2"}

    variants["ct_w4a16"] = ct_config(True, "group", None)
    variants["ct_asym_actorder"] = ct_config(False, "group", "group")
    variants["ct_channel"] = ct_config(False, "channel", None)
    twins = {}
    for name, qc in variants.items():
        out = {}
        twin = {}
        for tname, (dtype, arr) in tensors.items():
            base = tname[:-len(".weight")]
            if not (tname.endswith(".weight") and base.split(".")[-1] in PROJ):
                out[tname] = twin[tname] = (dtype, arr)
                continue
            w = to_f32(dtype, arr)
            n_in = w.shape[1]
            mlp = base.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")
            if name.startswith("ct_"):
                wc = qc["config_groups"]["group_0"]["weights"]
                group = a.group if wc["strategy"] == "group" else 0
                g_idx = rng.permutation(n_in) // a.group if wc["actorder"] == "group" else None
                codes, zeros, scales, g_idx, deq = quantize_ct(w, group, wc["symmetric"], g_idx)
                out[base + ".weight_packed"] = ("I32", pack_columns(codes + 8, range(8)))
                out[base + ".weight_scale"] = ("BF16", to_bf16(scales))
                out[base + ".weight_shape"] = ("I64", np.array(w.shape, np.int64))
                if not wc["symmetric"]:
                    out[base + ".weight_zero_point"] = ("I32", np.ascontiguousarray(pack_columns(zeros.T + 8, range(8)).T))
                if wc["actorder"] == "group":
                    out[base + ".weight_g_idx"] = ("I32", g_idx)
                twin[tname] = ("BF16", to_bf16(deq))
                continue
            if name == "awq":
                codes, zeros, scales, _, deq = quantize(w, a.group, False, rng)
                out[base + ".qweight"] = ("I32", pack_columns(codes.T, AWQ_ORDER))
                out[base + ".qzeros"] = ("I32", pack_columns(zeros, AWQ_ORDER))
                out[base + ".scales"] = ("F16", scales)
            else:
                # desc_act: input rows take groups in a shuffled order; GPTQ's symmetric zero
                # point (8) on the MLP, asymmetric on attention; format gptq stores z - 1, so its
                # zero points stay >= 1 (a stored -1 would decode as 16, as GPTQ's kernels do).
                g_idx = rng.permutation(n_in) // a.group if qc["desc_act"] else None
                codes, zeros, scales, g_idx, deq = quantize(w, a.group, mlp, rng, g_idx,
                                                            min_zero=1 if name == "gptq" else 0)
                out[base + ".qweight"] = ("I32", pack_rows(codes.T))
                out[base + ".qzeros"] = ("I32", pack_columns(zeros - (1 if name == "gptq" else 0), range(8)))
                out[base + ".scales"] = ("F16", scales)
                out[base + ".g_idx"] = ("I32", g_idx)
            twin[tname] = ("F32", deq)
        d = os.path.join(a.out, name)
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), out)
        c = dict(config, quantization_config=qc)
        json.dump(c, open(os.path.join(d, "config.json"), "w"), indent=2)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(a.src, extra)):
                shutil.copy(os.path.join(a.src, extra), d)
        twins[name] = twin
    for name, twin in twins.items():
        d = os.path.join(a.out, name + "_twin")
        os.makedirs(d, exist_ok=True)
        write_safetensors(os.path.join(d, "model.safetensors"), twin)
        json.dump(config, open(os.path.join(d, "config.json"), "w"), indent=2)
        if os.path.exists(os.path.join(a.src, "generation_config.json")):
            shutil.copy(os.path.join(a.src, "generation_config.json"), d)
    print("wrote", ", ".join(sorted(os.listdir(a.out))), "in", a.out)


if __name__ == "__main__":
    main()
