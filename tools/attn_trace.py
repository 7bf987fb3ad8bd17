#!/usr/bin/env python3
"""Summarise per-CTA timelines of the decode attention kernel (attention_lab --trace DIR).

Each file holds, per CTA in launch order, four little-endian uint64: start, first tile in
shared memory (warp 0; 0 when it had none), end (globaltimer ns) and the SM. Printed per file:
the span; CTA durations (also by start quartile); the fill (start to first tile); when SMs
finish; how many CTAs are resident over time (40 samples); slot utilisation (CTA-time /
(resident slots x span)), i.e. the fraction of the call the grid kept every slot busy; and the
time the same CTA-time would take with every slot busy to the end, which is what waves and
tails cost.

  python3 tools/attn_trace.py --slots 396 trace-fp8_e4m3-64x4096.bin ...
"""
import argparse
import struct
import sys


def median(xs):
    s = sorted(xs)
    return s[len(s) // 2]


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(path, slots):
    raw = open(path, "rb").read()
    if not raw or len(raw) % 32:
        sys.exit(f"{path}: {len(raw)} bytes is not a whole number of 32-byte CTA records")
    ctas = [struct.unpack_from("<4Q", raw, 32 * i) for i in range(len(raw) // 32)]
    t_min = min(c[0] for c in ctas)
    start = [(c[0] - t_min) / 1e3 for c in ctas]
    end = [(c[2] - t_min) / 1e3 for c in ctas]
    fill = [(c[1] - c[0]) / 1e3 for c in ctas if c[1]] or [0.0]
    dur = [e - s for s, e in zip(start, end)]
    span = max(end)
    sms = sorted({c[3] for c in ctas})
    sm_end = [max(e for e, c in zip(end, ctas) if c[3] == sm) for sm in sms]
    busy = sum(dur)
    resident = [sum(1 for s, e in zip(start, end) if s <= t < e) for t in (span * k / 40 for k in range(40))]
    print(f"{path}: {len(ctas)} CTAs on {len(sms)} SMs, span {span:.1f} us")
    print(f"  CTA duration median {median(dur):.1f} us (min {min(dur):.1f}, max {max(dur):.1f}); "
          f"fill median {median(fill):.2f} us (p90 {pct(fill, 0.9):.2f})")
    print(f"  SMs finish between {min(sm_end):.1f} and {max(sm_end):.1f} us (median {median(sm_end):.1f})")
    order = sorted(range(len(ctas)), key=lambda i: start[i])
    q = max(1, len(order) // 4)
    quart = [median([dur[i] for i in order[k * q:(k + 1) * q]]) for k in range(4)]
    print("  CTA duration median by start quartile (last: the tail's CTAs): " + ", ".join(f"{x:.1f}" for x in quart))
    print(f"  resident CTAs over the span: {resident}")
    if slots:
        print(f"  slot utilisation {busy / (slots * span):.1%}; all {slots} slots busy to the end: "
              f"{busy / slots:.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=0, help="resident CTA slots of the GPU (SMs x CTAs per SM)")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    for f in a.files:
        summarise(f, a.slots)


if __name__ == "__main__":
    main()
