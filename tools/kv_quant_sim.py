#!/usr/bin/env python3
"""What each KV format costs a real model, simulated in Hugging Face transformers, independently
of kvlm: K (after k_norm where the model has one, else k_proj's output — before RoPE) and V
(v_proj's output) are fake-quantized per (token, KV head) vector by forward hooks, with or
without a randomized Hadamard rotation of each vector before quantizing (undone after), and
the mean KL divergence of the next-token distributions against the unquantized run is taken
over the second half of one window. K alone, V alone and both, so that it shows which one
costs; INT8 / FP8 E4M3 / INT4 (symmetric, absmax scale) / INT4 with a zero point (int4z: 16
levels from the row's min to its max).

    python3 tools/kv_quant_sim.py --gguf FILE.gguf [--text models/kvlm-tiny/eval/heldout.txt] [--ctx 1024]
    python3 tools/kv_quant_sim.py --gguf FILE.gguf --keep 0:0,4:0,0:64,4:64 [--modes int4z,int8]

--keep SINK:RECENT,... runs a second experiment instead: K and V quantized after RoPE (as kvlm
stores them), Hadamard-rotated, inside the attention itself (a registered transformers attention
function), except the first SINK keys and, for each query, the RECENT most recent keys up to and
including its own position, which stay exact: what `--kv-cache-keep-sink` / `--kv-cache-keep-recent`
would buy. One KLD per (setting, mode).

--weights fp8 measures kvlm's `--quantization fp8` the same way instead: every linear weight of
the decoder layers (not the embedding or the LM head) fake-quantized to FP8 E4M3 with one scale
per output channel (absmax / 448, round to nearest even), the KV cache left alone. One KLD.

Needs torch, transformers, gguf (as tools/make_gguf_real_goldens.py). Runs on the CPU in about
a minute per model. docs/results/accuracy-real.md compares it with kvlm's own measurement.
"""
import argparse
import os

import torch


def kvlm_signs(n: int) -> torch.Tensor:
    # core/hadamard.h's hadamard_sign_negative, bit for bit: the top bit of splitmix64(i + 1)
    m = (1 << 64) - 1
    out = []
    for i in range(n):
        z = ((i + 1) * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return torch.tensor(out)


SIGNS = "0"  # --rotation-signs: "kvlm" or a torch seed


def hadamard(n: int, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if SIGNS == "kvlm":  # y @ (H diag(s) / sqrt(n))^T: kvlm's R y for each row vector y
        return (h @ torch.diag(kvlm_signs(n)) / n ** 0.5).T
    g = torch.Generator().manual_seed(int(SIGNS.removeprefix("layer")) + seed)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return h / n ** 0.5 * signs[None, :]  # orthogonal: columns of a Hadamard matrix with random signs


def fake_quant(x: torch.Tensor, head_dim: int, mode: str, rot: torch.Tensor | None) -> torch.Tensor:
    # K and V arrive as [batch, tokens, heads * head_dim] or [batch, heads, tokens, head_dim]:
    # either way the last head_dim values of a row are one (token, KV head) vector.
    y = x.float().reshape(-1, head_dim)
    if rot is not None:
        y = y @ rot
    amax = y.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    if mode == "int8":
        s = amax / 127
        q = torch.clamp(torch.round(y / s), -127, 127) * s
    elif mode == "int4":
        s = amax / 7
        q = torch.clamp(torch.round(y / s), -7, 7) * s
    elif mode == "int4z":  # asymmetric: 16 levels over [min, max] with a zero point
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        s = ((hi - lo) / 15).clamp_min(1e-30)
        q = torch.clamp(torch.round((y - lo) / s), 0, 15) * s + lo
    else:
        s = amax / 448
        q = (y / s).to(torch.float8_e4m3fn).float() * s
    if rot is not None:
        q = q @ rot.T
    return q.reshape(x.shape).to(x.dtype)


def keep_experiment(model, ids, base, hd, modes, settings):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv

    per_layer = SIGNS.startswith("layer")  # "layerK": seed K + the layer's index
    rots = {}
    state = {}

    def mixed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        sink, recent, mode = state["sink"], state["recent"], state["mode"]
        li = getattr(module, "layer_idx", 0) if per_layer else 0
        if li not in rots:
            rots[li] = hadamard(hd, li)
        rot = rots[li]
        groups = query.shape[1] // key.shape[1]
        kq = fake_quant(key, hd, mode, rot)  # [B, kvh, T, d]: every row a (token, head) vector
        vq = fake_quant(value, hd, mode, rot)
        k, v, kq, vq = (repeat_kv(t, groups) for t in (key, value, kq, vq))
        scale = scaling if scaling is not None else hd ** -0.5
        tq, tk = query.shape[2], k.shape[2]
        qpos = torch.arange(tk - tq, tk)[:, None]
        kpos = torch.arange(tk)[None, :]
        exact = (kpos < sink) | ((kpos > qpos - recent) & (kpos <= qpos))
        s = torch.where(exact, query @ k.transpose(-1, -2), query @ kq.transpose(-1, -2)) * scale
        # Causal, and the layer's sliding window, whatever mask the model built (None for sdpa).
        visible = kpos <= qpos
        window = kw.get("sliding_window") or getattr(module, "sliding_window", None)
        if window:
            visible = visible & (kpos > qpos - window)
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.softmax(s.float(), -1).to(query.dtype)
        out = (p * exact) @ v + (p * ~exact) @ vq
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kv_keep_sim", mixed)
    old = model.config._attn_implementation
    model.set_attn_implementation("kv_keep_sim")
    print("| sink:recent | " + " | ".join(f"{m}, rotated" for m in modes) + " |")
    print("|---|" + "---:|" * len(modes))
    half = ids.shape[1] // 2
    for sink, recent in settings:
        row = []
        for mode in modes:
            state.update(sink=sink, recent=recent, mode=mode)
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits.float(), -1)
            row.append(float((base.exp() * (base - lp)).sum(-1)[0, half:].mean()))
        print(f"| {sink}:{recent} | " + " | ".join(f"{v:.2e}" for v in row) + " |", flush=True)
    model.set_attn_implementation(old)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "models", "kvlm-tiny", "eval",
                                                   "heldout.txt"))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--modes", default="int8,fp8,int4")
    ap.add_argument("--keep", default="", help="SINK:RECENT,... (see above)")
    ap.add_argument("--weights", default="", choices=["", "fp8"], help="fp8: the weights experiment (see above)")
    ap.add_argument("--rotation-signs", default="0",
                    help="the rotation's +-1 signs: 'kvlm' (core/hadamard.h's), a torch seed (default 0), or "
                         "'layerK' (--keep only: seed K + the layer's index, other signs in every layer)")
    args = ap.parse_args()
    global SIGNS
    SIGNS = args.rotation_signs
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(os.path.abspath(args.gguf)), os.path.basename(args.gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    ids = tok(open(args.text).read()[: args.ctx * 8], return_tensors="pt").input_ids[:, : args.ctx]
    hd = model.config.head_dim
    rot = hadamard(hd, 0)
    with torch.no_grad():
        base = torch.log_softmax(model(ids).logits.float(), -1)
    if args.weights:
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in layer.modules():
                    if isinstance(lin, torch.nn.Linear):
                        w = lin.weight.float()
                        s = (w.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-30)
                        lin.weight.copy_(((w / s).to(torch.float8_e4m3fn).float() * s).to(lin.weight.dtype))
            lp = torch.log_softmax(model(ids).logits.float(), -1)
        half = ids.shape[1] // 2
        kld = float((base.exp() * (base - lp)).sum(-1)[0, half:].mean())
        print(f"| {f} | FP8 E4M3 linear weights, per output channel | mean KLD {kld:.2e} |")
        return
    if args.keep:
        settings = [tuple(int(x) for x in kv.split(":")) for kv in args.keep.split(",")]
        keep_experiment(model, ids, base, hd, args.modes.split(","), settings)
        return

    def run(mode, which, rotate):
        hooks = []
        for layer in model.model.layers:
            a = layer.self_attn
            k_site = a.k_norm if hasattr(a, "k_norm") else a.k_proj
            r = rot if rotate else None
            if "K" in which:
                hooks.append(k_site.register_forward_hook(lambda m, i, o, r=r: fake_quant(o, hd, mode, r)))
            if "V" in which:
                hooks.append(a.v_proj.register_forward_hook(lambda m, i, o, r=r: fake_quant(o, hd, mode, r)))
        try:
            with torch.no_grad():
                lp = torch.log_softmax(model(ids).logits.float(), -1)
        finally:
            for h in hooks:
                h.remove()
        half = ids.shape[1] // 2
        return float((base.exp() * (base - lp)).sum(-1)[0, half:].mean())

    print(f"| {f} | K only | V only | K and V | K and V, Hadamard-rotated |")
    print("|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        row = [run(mode, "K", False), run(mode, "V", False), run(mode, "KV", False), run(mode, "KV", True)]
        print(f"| {mode} per token-head | " + " | ".join(f"{v:.2e}" for v in row) + " |", flush=True)


if __name__ == "__main__":
    main()
