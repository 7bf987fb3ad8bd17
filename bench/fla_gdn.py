#!/usr/bin/env python3
"""flash-linear-attention's Gated DeltaNet kernels on bench/gdn_lab's shapes, for the side-by-side
table of docs/results/hybrid.md: one layer of Qwen3.5 / Qwen3-Next (16 key heads, 32 value heads
of 128, conv kernel 4), bf16 activations, fp32 states.

  prefill  S x n rows, varlen (cu_seqlens), from zero states: the chunked delta rule alone
           (chunk_gated_delta_rule, q/k L2-normalized in the kernel, final state out), and the
           token mixer as transformers and vLLM run it (causal_conv1d with SiLU, the rule,
           rms_norm_gated): gdn_lab times our mixer, conv to gated norm
  decode   S sequences x 1 row continuing a state: fused_recurrent_gated_delta_rule

Median of CUDA-event times after warm-ups (Triton autotuning), a 256 MiB buffer written before
each call (L2 flushed, as gdn_lab does). The gates g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b) are computed outside the timed region (our kernels compute them inside).

  python3 bench/fla_gdn.py [--prefill 1x16384,4x4096] [--decode 1,64,256]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from fla.modules.causal_conv1d.ops import causal_conv1d
from fla.modules.norm.fused_norm_gate import rms_norm_gated
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

HK, HV, D, CONV = 16, 32, 128, 4


def timed(fn, flush, runs):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ms = []
    for i in range(runs):
        flush.fill_(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def inputs(S, n, gen):
    T = S * n
    dev = "cuda"
    q = torch.randn(1, T, HK, D, device=dev, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, T, HK, D, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, T, HV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    a_log = torch.log(1 + 15 * torch.rand(HV, device=dev, generator=gen))
    dt_bias = 0.5 * torch.randn(HV, device=dev, generator=gen)
    a = torch.randn(1, T, HV, device=dev, generator=gen)
    g = -torch.exp(a_log) * F.softplus(a + dt_bias)
    beta = torch.sigmoid(torch.randn(1, T, HV, device=dev, generator=gen)).to(torch.bfloat16)
    cu = torch.arange(0, T + 1, n, device=dev, dtype=torch.int32)
    return q, k, v, g, beta, cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", default="1x16384,4x4096,16x1024")
    ap.add_argument("--decode", default="1,64,256")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    print(f"fla_gdn on {torch.cuda.get_device_name()}: one Gated DeltaNet layer ({HK} k heads, {HV} v heads of {D}, "
          f"conv {CONV}), bf16 activations, fp32 state")
    print(f"\n{'prefill':<10} {'rule ms':>10} {'rule tok/s':>12} {'mixer ms':>10} {'mixer tok/s':>12}")
    for shape in args.prefill.split(","):
        S, n = map(int, shape.split("x"))
        T = S * n
        q, k, v, g, beta, cu = inputs(S, n, gen)
        h0 = torch.zeros(S, HV, D, D, device="cuda", dtype=torch.float32)
        scale = D ** -0.5

        def rule(q=q, k=k, v=v):
            return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())

        cd = 2 * HK * D + HV * D
        x = torch.randn(1, T, cd, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(cd, CONV, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.5
        z = torch.randn(T * HV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        nw = torch.ones(D, device="cuda", dtype=torch.float32)

        def mixer():
            y, _ = causal_conv1d(x, w, activation="silu", cu_seqlens=cu.long(), output_final_state=True)
            qq, kk, vv = torch.split(y, [HK * D, HK * D, HV * D], dim=-1)
            o, _ = rule(qq.reshape(1, T, HK, D), kk.reshape(1, T, HK, D), vv.reshape(1, T, HV, D))
            return rms_norm_gated(o.reshape(T * HV, D), z, nw, None, activation="swish", eps=1e-6)

        r = timed(rule, flush, 10)
        m = timed(mixer, flush, 10)
        print(f"{shape:<10} {r:>10.3f} {T / (r * 1e-3):>12.0f} {m:>10.3f} {T / (m * 1e-3):>12.0f}")
    print(f"\n{'decode':<10} {'us':>10} {'GB/s':>10}")
    for shape in args.decode.split(","):
        S = int(shape)
        q, k, v, g, beta, _ = inputs(1, S, gen)
        q, k, v = (t.reshape(S, 1, *t.shape[2:]) for t in (q, k, v))
        g, beta = g.reshape(S, 1, HV), beta.reshape(S, 1, HV)
        h0 = torch.randn(S, HV, D, D, device="cuda", dtype=torch.float32, generator=gen) * 0.1

        def step():
            return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, scale=D ** -0.5, initial_state=h0,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)

        t = timed(step, flush, 20)
        gbs = 2 * h0.numel() * 4 / (t * 1e-3) / 1e9
        print(f"{shape:<10} {t * 1e3:>10.1f} {gbs:>10.0f}")


if __name__ == "__main__":
    main()
