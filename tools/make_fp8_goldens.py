#!/usr/bin/env python3
"""FP8-weight checkpoints in the three layouts deployed models use, and their goldens.

From golden models made by make_goldens.py (tests/golden/models/<src>), writes under --out:

  models/<src>-fp8-<kind>/        the checkpoint: the linear weights (q/k/v/o/gate/up/down_proj)
                                  as float8_e4m3fn with their scale tensors, every other tensor
                                  (embeddings, norms, biases, lm_head) as in the source, and the
                                  config fields the real tools write
  expected/<src>-fp8-<kind>.json / .logits.safetensors
                                  what transformers computes on the DEQUANTIZED weights
                                  (code * scale in float32, the same product kvlm forms),
                                  exactly as make_goldens.py writes goldens

The kinds, each laid out as its tool lays it out:

  ct        llm-compressor compressed-tensors "FP8_DYNAMIC": quant_method compressed-tensors,
            format float-quantized, config_groups.group_0 weights {num_bits 8, type float,
            strategy channel, symmetric, dynamic false} and input_activations {num_bits 8, type
            float, strategy token, dynamic true}, ignore [lm_head]; tensors <m>.weight F8_E4M3
            [out, in] and <m>.weight_scale in the model dtype [out, 1] (amax / 448 per row).
  modelopt  NVIDIA ModelOpt FP8 (an export with hf_quant_config.json and no quantization_config
            in config.json): quantization {quant_algo FP8, kv_cache_quant_algo null,
            exclude_modules [lm_head]}; tensors <m>.weight F8_E4M3, <m>.weight_scale F32 [] (amax
            / 448 of the tensor) and <m>.input_scale F32 [] (amax / 448 of the layer's input over
            the golden prompt).
  block     block-wise fp8 (Qwen3-*-FP8, DeepSeek-V3): quant_method fp8, fmt e4m3,
            activation_scheme dynamic, weight_block_size [128, 128]; tensors <m>.weight F8_E4M3
            and <m>.weight_scale_inv F32 [ceil(out / 128), ceil(in / 128)] (amax / 448 per
            block; the weight is code * weight_scale_inv despite the name).

Codes are round-to-nearest-even of w / scale after clamping to +-448 (torch's float8_e4m3fn
cast). The golden prompt is the source's; the script checks that greedy decoding of the
dequantized model still has a top-2 margin >= 1e-3 and otherwise tries other prompts.

Usage (torch, transformers, safetensors):
    python3 tools/make_fp8_goldens.py --out DIR [--golden tests/golden]
"""

import argparse
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_goldens as mg  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0
# (source golden model, kind): sharded + untied, tied + q/k/v biases, q/k norms + mixed layers.
VARIANTS = [("llama-gqa", "ct"), ("qwen2-bias", "modelopt"), ("qwen3-mixed", "block")]
BLOCK = 128


def is_linear(name):
    return name.endswith(".weight") and any(f".{m}." in name for m in LINEAR)


def to_fp8(w, scale):
    """Codes of w / scale (scale broadcast), clamped to the e4m3 range, rounded to nearest even."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def quantize(kind, w, dtype):
    """-> (codes, {suffix: scale tensor}, dequantized float32 weight)."""
    w = w.float()
    if kind == "ct":
        s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(dtype)  # stored in the model dtype
        q = to_fp8(w, s.float())
        return q, {"weight_scale": s}, q.float() * s.float()
    if kind == "modelopt":
        s = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).float().reshape(())
        q = to_fp8(w, s)
        return q, {"weight_scale": s}, q.float() * s
    rows, cols = w.shape
    br, bc = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    pad = torch.zeros(br * BLOCK, bc * BLOCK)
    pad[:rows, :cols] = w.abs()
    s = (pad.reshape(br, BLOCK, bc, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).float()
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    q = to_fp8(w, full)
    return q, {"weight_scale_inv": s}, q.float() * full


def input_scales(model, prompt):
    """amax / 448 of each linear layer's input over one forward of the prompt (ModelOpt's calibration)."""
    amax, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.split(".")[-1] in LINEAR:
            def hook(m, inp, out, name=name):
                amax[name] = max(amax.get(name, 0.0), float(inp[0].abs().max()))
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt]), use_cache=False)
    for h in hooks:
        h.remove()
    return {n: torch.tensor(max(a, 1e-6) / FP8_MAX, dtype=torch.float32) for n, a in amax.items()}


def source_tensors(sdir):
    index = os.path.join(sdir, "model.safetensors.index.json")
    if os.path.exists(index):
        wm = json.load(open(index))["weight_map"]
        out, shard_of = {}, {}
        for f in sorted(set(wm.values())):
            for n, t in load_file(os.path.join(sdir, f)).items():
                out[n] = t
                shard_of[n] = f
        return out, shard_of
    return load_file(os.path.join(sdir, "model.safetensors")), None


def write_checkpoint(ddir, tensors, shard_of):
    if shard_of is None:
        save_file(tensors, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
        return
    files = {}
    for n, t in tensors.items():
        base = n.rsplit(".", 1)[0] + ".weight"
        files.setdefault(shard_of.get(n, shard_of.get(base)), {})[n] = t
    weight_map, total = {}, 0
    for f, group in sorted(files.items()):
        save_file(group, os.path.join(ddir, f), metadata={"format": "pt"})
        for n, t in group.items():
            weight_map[n] = f
            total += t.numel() * t.element_size()
    mg.write_json(os.path.join(ddir, "model.safetensors.index.json"),
                  {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def make_variant(golden, outdir, src, kind):
    name = f"{src}-fp8-{kind}"
    sdir = os.path.join(golden, "models", src)
    ddir = os.path.join(outdir, "models", name)
    if os.path.isdir(ddir):
        shutil.rmtree(ddir)
    os.makedirs(ddir)
    cfg = json.load(open(os.path.join(sdir, "config.json")))
    dtype = mg.DTYPES[cfg["torch_dtype"]]
    src_exp = json.load(open(os.path.join(golden, "expected", f"{src}.json")))
    prompt = src_exp["prompt_ids"]

    tensors, shard_of = source_tensors(sdir)
    model, _ = mg.load_hf(sdir)
    in_scales = input_scales(model, prompt) if kind == "modelopt" else {}
    out, deq = {}, {}
    for n, t in tensors.items():
        if not is_linear(n):
            out[n] = t
            continue
        q, scales, d = quantize(kind, t, dtype)
        out[n] = q
        m = n[: -len(".weight")]
        for suffix, s in scales.items():
            out[f"{m}.{suffix}"] = s
        if kind == "modelopt":
            out[f"{m}.input_scale"] = in_scales[m]
        deq[n] = d
    # The dequantized weights into the float32 model: the golden's model.
    sd = dict(model.named_parameters())
    with torch.no_grad():
        for n, d in deq.items():
            sd[n].copy_(d)

    if kind == "ct":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True, "group_size": None, "observer": None},
                "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    elif kind == "modelopt":
        mg.write_json(os.path.join(ddir, "hf_quant_config.json"), {
            "producer": {"name": "modelopt", "version": "0.31.0"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}})
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}
    mg.write_json(os.path.join(ddir, "config.json"), cfg)
    shutil.copy(os.path.join(sdir, "generation_config.json"), ddir)
    write_checkpoint(ddir, out, shard_of)

    ev = None
    for attempt in range(mg.MAX_TRIES):
        if attempt > 0:
            prompt = mg.make_prompt(5000 + attempt, len(src_exp["prompt_ids"]), cfg["vocab_size"])
        ev = mg.evaluate(model, prompt)
        if ev["margin"] >= mg.MIN_MARGIN and ev["consistent"]:
            break
        print(f"   REJECT {name}: prompt try {attempt}: margin {ev['margin']:.5f} consistent={ev['consistent']}")
    else:
        raise RuntimeError(f"{name}: no prompt with margin >= {mg.MIN_MARGIN}")
    nparams = sum(p.numel() for p in model.parameters())
    wmax = max(float((deq[n] - tensors[n].float()).abs().max()) for n in deq)
    extra = {"num_params": nparams, "source_golden": src, "fp8_kind": kind,
             "exercises": f"{kind} FP8 weights of {src}; the golden is transformers on the dequantized weights",
             "max_abs_weight_change": wmax, "hf_rms_norm_eps": float(model.config.rms_norm_eps),
             "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False))}
    exp = mg.write_expected(outdir, name, cfg["architectures"][0], f"float8_e4m3fn ({kind})", prompt, ev,
                            model.config, model, extra)
    mg.report(exp, nparams, [f"max |dequantized - source weight| = {wmax:.4g}"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (models/ and expected/)")
    ap.add_argument("--golden", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden"),
                    help="the golden data the sources come from (default: tests/golden)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    for src, kind in VARIANTS:
        make_variant(a.golden, a.out, src, kind)


if __name__ == "__main__":
    main()
