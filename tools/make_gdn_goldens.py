#!/usr/bin/env python3
"""Writes tests/golden/gdn/cases.json: Gated DeltaNet's token-mixer pieces computed by
transformers' own reference functions (transformers.models.qwen3_next.modeling_qwen3_next:
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, causal_conv1d_update (its torch fallback),
Qwen3NextRMSNormGated, and the gate formulas of Qwen3NextGatedDeltaNet.forward), in float32,
on random inputs, for kvlm's CPU reference (src/ops/cpu/linear_attention.h) to be checked
against. Needs torch and transformers (>= 5; `pip install torch transformers`).

    make_gdn_goldens.py [OUT_DIR]   (default tests/golden/gdn)
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_next import modeling_qwen3_next as q3n


def flat(t):
    return [float(f"{x:.9g}") for x in t.detach().reshape(-1).tolist()]


def delta_case(name, gen, tokens, k_heads, v_heads, dk, dv, zero_state=False):
    # Inputs as the layer makes them: q, k, v from the conv, a and b projections, A_log and
    # dt_bias parameters; the gates as Qwen3NextGatedDeltaNet.forward computes them.
    q = torch.randn(1, tokens, k_heads, dk, generator=gen)
    k = torch.randn(1, tokens, k_heads, dk, generator=gen)
    v = torch.randn(1, tokens, v_heads, dv, generator=gen)
    a = torch.randn(1, tokens, v_heads, generator=gen) * 2
    b = torch.randn(1, tokens, v_heads, generator=gen) * 2
    a_log = torch.log(torch.rand(v_heads, generator=gen) * 15 + 1)
    dt_bias = torch.randn(v_heads, generator=gen)
    state = torch.zeros(1, v_heads, dk, dv) if zero_state else torch.randn(1, v_heads, dk, dv, generator=gen) * 0.5
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    ratio = v_heads // k_heads
    qr, kr = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
    out_c, state_c = q3n.torch_chunk_gated_delta_rule(qr, kr, v, g=g, beta=beta, initial_state=state.clone(),
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    out_r, state_r = q3n.torch_recurrent_gated_delta_rule(qr, kr, v, g=g, beta=beta, initial_state=state.clone(),
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    return {"name": name, "tokens": tokens, "k_heads": k_heads, "v_heads": v_heads, "dk": dk, "dv": dv,
            "q": flat(q), "k": flat(k), "v": flat(v), "a": flat(a), "b": flat(b), "a_log": flat(a_log),
            "dt_bias": flat(dt_bias), "state": flat(state), "g": flat(g), "beta": flat(beta),
            "chunked_out": flat(out_c), "chunked_state": flat(state_c),
            "recurrent_out": flat(out_r), "recurrent_state": flat(state_r)}


def conv_case(gen, tokens, channels, kernel):
    x = torch.randn(1, channels, tokens, generator=gen)
    w = torch.randn(channels, kernel, generator=gen) * 0.5
    state = torch.randn(1, channels, kernel, generator=gen)  # transformers keeps `kernel` inputs; the oldest is unused
    new_state = state.clone()
    out = q3n.causal_conv1d_update(x, new_state, w, None, "silu")
    return {"tokens": tokens, "channels": channels, "kernel": kernel, "x": flat(x.transpose(1, 2)), "w": flat(w),
            "state": flat(state[0, :, 1:].transpose(0, 1)), "out": flat(out.transpose(1, 2)),
            "new_state": flat(new_state[0, :, 1:].transpose(0, 1))}


def norm_case(gen, rows, dim):
    x = torch.randn(rows, dim, generator=gen) * 3
    z = torch.randn(rows, dim, generator=gen) * 2
    norm = q3n.Qwen3NextRMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    return {"rows": rows, "dim": dim, "eps": 1e-6, "x": flat(x), "z": flat(z), "w": flat(norm.weight),
            "out": flat(norm(x, z))}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "golden", "gdn")
    gen = torch.Generator().manual_seed(20261129)
    torch.set_default_dtype(torch.float32)
    cases = {
        "transformers_version": transformers.__version__,
        "delta": [
            # three chunks of 64 (the last partial), grouped heads, a state carried in
            delta_case("prefill", gen, 140, 2, 4, 8, 8),
            # a few tokens on one head from a zero state, dk != dv
            delta_case("short", gen, 5, 1, 1, 32, 24, zero_state=True),
            # exactly one chunk
            delta_case("one_chunk", gen, 64, 1, 3, 8, 16),
        ],
        "conv": [conv_case(gen, 9, 12, 4), conv_case(gen, 1, 7, 4)],
        "norm": [norm_case(gen, 6, 16)],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump(cases, f, separators=(",", ":"))
    print("wrote", os.path.join(out_dir, "cases.json"), "with transformers", transformers.__version__)


if __name__ == "__main__":
    main()
