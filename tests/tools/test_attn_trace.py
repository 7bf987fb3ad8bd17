#!/usr/bin/env python3
"""tools/attn_trace.py on synthetic timelines whose summary is known by hand, and on files that
are not whole CTA records (refused with a message, not a traceback)."""
import os
import struct
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "attn_trace.py")


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as d:
        # Two slots (one per SM): two 10 us CTAs, then one of 5 us on SM 0 and one of 10 us on
        # SM 1 whose warp 0 had no tile (first = 0). Span 20 us, CTA-time 35 us: utilisation
        # 35 / (2 x 20) = 87.5%, all slots busy to the end after 17.5 us; fills 1, 1, 1 us.
        ctas = [(1000, 2000, 11000, 0), (1000, 2000, 11000, 1), (11000, 12000, 16000, 0), (11000, 0, 21000, 1)]
        good = os.path.join(d, "trace.bin")
        with open(good, "wb") as f:
            for c in ctas:
                f.write(struct.pack("<4Q", *c))
        r = run("--slots", "2", good)
        assert r.returncode == 0, r.stderr
        for want in ("4 CTAs on 2 SMs, span 20.0 us", "fill median 1.00 us", "between 15.0 and 20.0 us",
                     "slot utilisation 87.5%", "all 2 slots busy to the end: 17.5 us"):
            assert want in r.stdout, f"missing {want!r} in:\n{r.stdout}"
        for name, data in (("empty.bin", b""), ("cut.bin", struct.pack("<4Q", *ctas[0]) + b"\0")):
            bad = os.path.join(d, name)
            with open(bad, "wb") as f:
                f.write(data)
            r = run(bad)
            assert r.returncode != 0 and "not a whole number of 32-byte CTA records" in r.stderr, (r.returncode, r.stderr)
            assert "Traceback" not in r.stderr, r.stderr
    print("attn_trace: ok")


if __name__ == "__main__":
    main()
