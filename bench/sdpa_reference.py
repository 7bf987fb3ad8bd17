#!/usr/bin/env python3
"""Reference line for the kernel lab: PyTorch scaled_dot_product_attention on the lab's
decode shapes (Llama-3-8B attention: 32 q heads, 8 kv heads, head 128) with a contiguous
bf16 cache [batch][kv_heads][context][head], GQA through enable_gqa (no K/V expansion).

Same method as bench/attention_lab.cu: CUDA events, warm-up, median of repeats, rotating
through copies of the cache totalling more than 2x the L2, bytes = K + V + q + out, and
% of the device-to-device copy bandwidth measured in this run. Each backend (cuDNN first)
is tried; the fastest that runs is reported per shape, with its name.

  python3 bench/sdpa_reference.py [--quick]
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


if __name__ == "__main__":
    main()
