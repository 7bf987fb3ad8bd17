#!/usr/bin/env python3
"""Reference line for the kernel lab: PyTorch scaled_dot_product_attention on the lab's
decode shapes (Llama-3-8B attention: 32 q heads, 8 kv heads, head 128) with a contiguous
bf16 cache [batch][kv_heads][context][head], GQA through enable_gqa (no K/V expansion).

Same method as bench/attention_lab.cu: CUDA events behind a spin kernel (GPU time only,
not the launch latency), warm-up, median of repeats, rotating
through copies of the cache totalling more than 2x the L2, bytes = K + V + q + out, and
% of the device-to-device copy bandwidth measured in this run. Each backend (cuDNN first)
is tried; the fastest that runs is reported per shape, with its name.

  python3 bench/sdpa_reference.py [--quick] [--prefill]

--prefill adds causal prefill (batch 1, 32 q heads, 8 kv heads, head 128, prompts of 4k and
16k tokens, and a 1k-token chunk whose queries are the last 1k of a 16k context) with
TFLOP/s counted as bench/attention_lab.cu does: 4 * H * D per visible (query, key) pair.
Backends that refuse GQA get K/V expanded to 32 heads beforehand (not timed).
"""
import math
import statistics
import sys

import torch
import torch.nn.functional as F

QH, KVH, D = 32, 8, 128
L2 = 60e6


def timed(fn, reps=25, warm=5):
    ts = []
    for i in range(warm + reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A spin kernel first keeps the stream busy while Python enqueues the call: the events
        # then bracket GPU time alone, as in attention_lab (launch latency not counted).
        torch.cuda._sleep(1_000_000)  # ~0.5 ms
        e0.record()
        fn(i)
        e1.record()
        e1.synchronize()
        if i >= warm:
            ts.append(e0.elapsed_time(e1))
    return statistics.median(ts) * 1e3  # µs


def main():
    quick = "--quick" in sys.argv
    dev = torch.device("cuda")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy_us = timed(lambda i: b.copy_(a), reps=10, warm=3)
    copy_bw = 2 * a.numel() / (copy_us * 1e-6)
    del a, b
    print(f"# sdpa_reference: torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (D2D, read+write)\n")
    print("| backend | batch | context | µs | GB/s | % of copy |")
    print("|---|---|---|---|---|---|")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    batches = [1, 64] if quick else [1, 16, 64, 256]
    contexts = [1024, 4096] if quick else [1024, 4096, 16384, 32768]
    for B in batches:
        for C in contexts:
            kv_bytes = 2 * B * KVH * C * D * 2
            if kv_bytes > 40e9:
                print(f"| - | {B} | {C} | skipped ({kv_bytes / 1e9:.0f} GB) | | |")
                continue
            copies = max(1, min(32, math.ceil(2.2 * L2 / kv_bytes)))
            ks = [torch.randn(B, KVH, C, D, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
            vs = [torch.randn(B, KVH, C, D, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
            qs = [torch.randn(B, QH, 1, D, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
            best = None
            for name, be in backends:
                try:
                    with sdpa_kernel([be]):
                        F.scaled_dot_product_attention(qs[0], ks[0], vs[0], enable_gqa=True)
                        torch.cuda.synchronize()
                        us = timed(lambda i: F.scaled_dot_product_attention(
                            qs[i % copies], ks[i % copies], vs[i % copies], enable_gqa=True))
                    if best is None or us < best[1]:
                        best = (name, us)
                except Exception as e:  # backend does not support this shape / GQA
                    print(f"<!-- {name} {B}x{C}: {type(e).__name__}: {str(e).splitlines()[0][:120]} -->")
            if best is None:
                print(f"| none | {B} | {C} | - | | |")
            else:
                byts = kv_bytes + 2 * B * QH * D * 2
                gbs = byts / (best[1] * 1e-6)
                print(f"| {best[0]} | {B} | {C} | {best[1]:.1f} | {gbs / 1e9:.0f} | {100 * gbs / copy_bw:.0f}% |")
            sys.stdout.flush()
            del ks, vs, qs
            torch.cuda.empty_cache()


def prefill():
    dev = torch.device("cuda")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    print("\n| prefill backend | q_len | context | µs | TFLOP/s |")
    print("|---|---|---|---|---|")
    shapes = [(4096, 4096)] if "--quick" in sys.argv else [(4096, 4096), (16384, 16384), (1024, 16384)]
    for Lq, C in shapes:
        q = torch.randn(1, QH, Lq, D, dtype=torch.bfloat16, device=dev)
        k = torch.randn(1, KVH, C, D, dtype=torch.bfloat16, device=dev)
        v = torch.randn(1, KVH, C, D, dtype=torch.bfloat16, device=dev)
        ke, ve = k.repeat_interleave(QH // KVH, dim=1), v.repeat_interleave(QH // KVH, dim=1)
        # Query i sits at position C - Lq + i: a bottom-right aligned causal mask. For Lq == C
        # that is is_causal=True; otherwise an explicit boolean mask.
        mask = None
        if Lq != C:
            mask = torch.ones(Lq, C, dtype=torch.bool, device=dev).tril(diagonal=C - Lq)
        pairs = sum(C - Lq + i + 1 for i in range(Lq))
        flops = 4.0 * pairs * QH * D
        for name, be in backends:
            for gqa in (True, False):
                kk, vv = (k, v) if gqa else (ke, ve)
                try:
                    with sdpa_kernel([be]):
                        fn = lambda i: F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=mask is None,
                                                                      enable_gqa=gqa)
                        fn(0)
                        torch.cuda.synchronize()
                        us = timed(fn, reps=10, warm=3)
                    print(f"| {name}{'' if gqa else ' (K/V expanded)'} | {Lq} | {C} | {us:.0f} | {flops / (us * 1e-6) / 1e12:.1f} |")
                    break
                except Exception as e:
                    print(f"<!-- {name} gqa={gqa} {Lq}/{C}: {type(e).__name__}: {str(e).splitlines()[0][:120]} -->")
            sys.stdout.flush()
        del q, k, v, ke, ve
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if "--prefill-only" not in sys.argv:
        main()
    if "--prefill" in sys.argv or "--prefill-only" in sys.argv:
        prefill()
