#!/usr/bin/env python3
"""tools/sass_loop.py on synthetic cuobjdump text whose loop counts are known by hand: the
innermost loop holding the opcode is found (not an outer loop, not a loop without it), forward
branches inside it are counted apart, one iteration's path follows the branches named taken,
two inputs give the change, and input with no SASS is refused with a message, not a traceback."""
import os
import subprocess
import sys
import tempfile

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "sass_loop.py")


def sass(name, body):
    lines = [f"\t\tFunction : {name}", "\t.headerflags @\"EF_CUDA_SM90\""]
    for i, ins in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x000000000000 */")
        lines.append("                                                  /* 0x000000000000 */")
    return "\n".join(lines) + "\n"


def kernel(extra_lop3):
    # 0: prologue; 1-13: outer loop (back edge at 13 -> 1); 2-11: inner loop with HMMA (back
    # edge at 11 -> 2); 5-7 skipped by the forward branch at 4 (to 0x80 = instruction 8);
    # 14-16: a later loop without HMMA.
    body = ["MOV R1, c[0x0][0x28]",
            "IADD3 R2, R2, 0x1, RZ",
            "LDS.128 R4, [R3]",
            "HMMA.16816.F32 R8, R4, R12, R8",
            "@!P0 BRA 0x80",
            "FMUL R8, R8, R20",
            "FMUL R9, R9, R20",
            "FMUL R10, R10, R20",
            "LOP3.LUT R5, R5, 0xf000f, R6, 0xea, !PT",
            "LOP3.LUT R5, R5, 0xf000f, R6, 0xea, !PT" if extra_lop3 else "PRMT R5, R5, 0x5410, R6",
            "ISETP.GE.AND P0, PT, R2, R7, PT",
            "@!P0 BRA 0x20",
            "IADD3 R3, R3, 0x10, RZ",
            "@P1 BRA 0x10",
            "FADD R1, R1, R2",
            "ISETP.GE.AND P2, PT, R1, R7, PT",
            "@!P2 BRA 0xe0",
            "EXIT"]
    return sass("_Z6kernelv", body) + sass("_Z5otherv", ["MOV R1, R2", "EXIT"])


def run(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)


def main():
    with tempfile.TemporaryDirectory() as d:
        a, b = os.path.join(d, "a.sass"), os.path.join(d, "b.sass")
        open(a, "w").write(kernel(False))
        open(b, "w").write(kernel(True))
        r = run("--kernel", "kernel", a)
        assert r.returncode == 0, r.stderr
        # The inner loop: instructions 2..11 = 10, of which 5, 6, 7 inside the forward branch.
        row = [l for l in r.stdout.splitlines() if l.startswith("| kernel()")]
        assert row == ["| kernel() | 10 | 7 | 3 | BRA 2, LDS 1, HMMA 1, LOP3 1, PRMT 1, ISETP 1 |"], r.stdout
        assert "other" not in r.stdout, r.stdout
        r = run("--kernel", "kernel", a, b)
        assert r.returncode == 0, r.stderr
        assert "kernel(): 7 -> 7 (+0): LOP3 +1, PRMT -1" in r.stdout, r.stdout
        # One iteration's path: the forward branch at 0x40 taken skips 5-7 (7 instructions),
        # not taken runs all 10; the back edge is unconditional within the loop's count.
        r = run("--kernel", "kernel", a, "--taken", "0x40")
        assert r.returncode == 0, r.stderr
        assert "path of kernel(): 7 instructions per iteration" in r.stdout and "0x40->0x80 taken" in r.stdout, r.stdout
        r = run("--kernel", "kernel", a, "--taken", "")
        assert "path of kernel(): 10 instructions per iteration" in r.stdout and "0x40->0x80 not taken" in r.stdout, r.stdout
        r = run("--kernel", "kernel", a, b, "--taken", "0x40")
        assert r.returncode != 0 and "exactly one input" in r.stderr, r.stderr
        r = run("--kernel", "kernel", a, "--taken", "zz")
        assert r.returncode != 0 and "hex addresses" in r.stderr and "Traceback" not in r.stderr, r.stderr
        # A function whose loops hold no HMMA.
        r = run("--kernel", "other", a)
        assert r.returncode == 0 and "| other() | no loop with HMMA |" in r.stdout, r.stdout + r.stderr
        # Not SASS at all.
        bad = os.path.join(d, "bad.txt")
        open(bad, "w").write("hello\n")
        r = run(bad)
        assert r.returncode != 0 and "no SASS functions found" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = run(a, b, a)
        assert r.returncode != 0 and "give one input, or two" in r.stderr, r.stderr
    print("sass_loop: ok")


if __name__ == "__main__":
    main()
