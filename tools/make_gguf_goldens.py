#!/usr/bin/env python3
"""Writes tests/data/gguf/blocks.gguf: a GGUF file made by the `gguf` Python package (llama.cpp's
own gguf-py), holding for every block type kvlm reads a small tensor in that type and, next to
it as `NAME.ref`, the float32 values `gguf.quants.dequantize` gives for it, plus metadata of
every value type; and tests/data/gguf/blocks.json, the metadata as the package's GGUFReader
reads it back. tests/unit/test_gguf.cpp checks kvlm's parser and dequantization against both,
bit for bit.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install numpy gguf==0.19.0
    /tmp/v/bin/python tools/make_gguf_goldens.py

Quantized types with a quantizer in gguf-py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) quantize random
normal data; the others (Q2_K-Q6_K) are random bytes with every half-precision scale
field replaced by a finite random value, so every code and scale combination is exercised.
"""
import json
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "gguf")

# The byte offsets of each half-precision scale field inside a block (the rest is codes).
HALF_FIELDS = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def random_blocks(rng, qtype, n_blocks):
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS.get(qtype, []):
        halves = (rng.standard_normal(n_blocks) * 0.02).astype(np.float16)
        raw[:, off:off + 2] = halves.view(np.uint8).reshape(n_blocks, 2)
    return raw


def main():
    rng = np.random.default_rng(20261125)
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "blocks.gguf")
    w = gguf.GGUFWriter(path, arch="llama")
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -7)
    w.add_float32("test.f32", 0.1)
    w.add_float64("test.f64", -2.5e-300)
    w.add_bool("test.bool", True)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_string("test.unicode", "Grüße, 世界 — <|im_start|>")
    w.add_array("test.strings", ["a", "", "merge me", "ü"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25, 3.0e10])
    rows, cols = 3, 512
    for qtype in [T.F32, T.F16, T.BF16] + QUANTIZED + [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        name = qtype.name.lower()
        if qtype == T.F32:
            raw = rng.standard_normal((rows, cols)).astype(np.float32)
            ref = raw
            w.add_tensor(name, raw)
        elif qtype == T.F16:
            raw = rng.standard_normal((rows, cols)).astype(np.float16)
            ref = raw.astype(np.float32)
            w.add_tensor(name, raw)
        elif qtype == T.BF16:
            f = rng.standard_normal((rows, cols)).astype(np.float32)
            raw = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, cols * 2)
            ref = gguf.quants.dequantize(raw, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
        else:
            if qtype in QUANTIZED:
                raw = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
            else:
                raw = random_blocks(rng, qtype, rows * cols // block).reshape(rows, cols // block * nbytes)
            ref = gguf.quants.dequantize(raw, qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
        assert ref.shape == (rows, cols) and np.isfinite(ref).all(), qtype
        w.add_tensor(name + ".ref", np.ascontiguousarray(ref, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    r = gguf.GGUFReader(path)
    meta = {}
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        t = f.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                val = [f.parts[i].tolist()[0] for i in f.data]
            meta[f.name] = {"type": "array", "elem": sub.name.lower(), "value": val}
        elif t == gguf.GGUFValueType.STRING:
            meta[f.name] = {"type": "string", "value": bytes(f.parts[-1]).decode("utf-8")}
        else:
            meta[f.name] = {"type": t.name.lower(), "value": f.parts[-1].tolist()[0]}
    tensors = {t.name: {"type": t.tensor_type.name, "ne": [int(x) for x in t.shape], "offset": int(t.data_offset)}
               for t in r.tensors}
    with open(os.path.join(OUT, "blocks.json"), "w") as fp:
        json.dump({"metadata": meta, "tensors": tensors}, fp, indent=1, ensure_ascii=False)
        fp.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes) and blocks.json: {len(meta)} keys, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
