#!/usr/bin/env python3
"""Static instruction counts of a kernel's hot loop, from its SASS (no GPU needed).

The decode attention kernels for 1-byte and 4-bit KV are bound by instruction issue, not by
bytes (docs/results/kernel-lab.md), so the instructions one 16-key tile costs are the number
to move, and they can be counted on any machine that compiles the CUDA sources. For every
function whose name (demangled when c++filt is there) matches --kernel, this finds the
innermost loop that holds an instruction of --opcode (default HMMA: the tile loop), and prints
its static instruction count, split into the instructions every iteration runs and those
inside forward branches within the loop (the rarely taken rescale, partial tiles: an upper
bound on what an iteration may add), with the opcode histogram of the every-iteration part.
Given two inputs (before / after), it also prints the change per kernel present in both.
With --taken, it also counts the instructions of one iteration's path, jumping at the
conditional branches named (hex addresses, as printed) and falling through the others: the
number a tile really costs when the common case takes some forward branches (a full tile, no
new maximum) and skips others.

  python3 tools/sass_loop.py --kernel 'attn_mma_kernel<kvlm::cuda::FmtI4, 128' \\
      build-sm90/CMakeFiles/kvlm_core.dir/src/ops/cuda/paged_attention.cu.o [--taken 0x83c0,0x9220]

Inputs are object files or executables (disassembled with cuobjdump -sass; scripts/fetch-cuda-tools
puts cuobjdump in .whl/cuda-tools where it is not installed) or text files of cuobjdump's output.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

FUNC_RE = re.compile(r"^\s*Function\s*:\s*(\S+)")
INS_RE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRA_RE = re.compile(r"\bBRA\s+(?:`?\()?(0x[0-9a-f]+)")


def find_cuobjdump(explicit):
    if explicit:
        return explicit
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".whl", "cuda-tools")
    for root, _, files in os.walk(here):
        if "cuobjdump" in files:
            return os.path.join(root, "cuobjdump")
    return shutil.which("cuobjdump")


def sass_text(path, cuobjdump):
    if path.endswith((".sass", ".txt")):
        return open(path, encoding="utf-8", errors="replace").read()
    if not cuobjdump:
        sys.exit("sass_loop: cuobjdump not found: install the CUDA toolkit's binary utilities, or run "
                 "scripts/fetch-cuda-tools, or pass --cuobjdump PATH")
    r = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"sass_loop: cuobjdump -sass {path} failed: {r.stderr.strip()}")
    return r.stdout


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    r = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    out = r.stdout.split("\n")
    return {n: (out[i] if r.returncode == 0 and i < len(out) and out[i] else n) for i, n in enumerate(names)}


PRED_RE = re.compile(r"^@!?U?P[T0-9]+\s+")


def parse(text):
    """{mangled name: [(address, instruction text without the predicate)]}, in order, and the
    addresses of the predicated (conditional) instructions."""
    funcs, predicated, cur = {}, {}, None
    for line in text.splitlines():
        m = FUNC_RE.match(line)
        if m:
            cur = m.group(1)
            funcs.setdefault(cur, [])
            predicated.setdefault(cur, set())
            continue
        m = INS_RE.match(line)
        if m and cur is not None:
            raw = m.group(2).strip()
            ins = PRED_RE.sub("", raw)
            if ins != raw and not raw.startswith("@PT "):
                predicated[cur].add(int(m.group(1), 16))
            funcs[cur].append((int(m.group(1), 16), ins))
    return funcs, predicated


def opcode(ins):
    return ins.split()[0].split(".")[0] if ins else ""


def hot_loop(ins, want):
    """(first, last) indices of the innermost loop (a backward branch and its target) that holds
    an instruction whose opcode is `want`; None when there is none."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (addr, text) in enumerate(ins):
        m = BRA_RE.search(text) if opcode(text) == "BRA" else None
        if not m:
            continue
        target = int(m.group(1), 16)
        if target > addr or target not in index:
            continue
        lo = index[target]
        if any(opcode(t) == want for _, t in ins[lo:i + 1]) and (best is None or i - lo < best[1] - best[0]):
            best = (lo, i)
    return best


def loop_stats(ins, lo, hi):
    """Counts over ins[lo..hi]: total, every-iteration, inside forward branches, opcode histogram
    of the every-iteration part."""
    cond = [False] * (hi - lo + 1)
    for i in range(lo, hi + 1):
        addr, text = ins[i]
        m = BRA_RE.search(text) if opcode(text) == "BRA" else None
        if not m:
            continue
        target = int(m.group(1), 16)
        if addr < target <= ins[hi][0]:
            for j in range(i + 1, hi + 1):
                if ins[j][0] >= target:
                    break
                cond[j - lo] = True
    every = [ins[i][1] for i in range(lo, hi + 1) if not cond[i - lo]]
    hist = collections.Counter(opcode(t) for t in every)
    return {"total": hi - lo + 1, "every": len(every), "cond": sum(cond), "hist": hist}


def taken_path(ins, lo, hi, conditional, taken):
    """The instructions one iteration runs from the loop's head to its back edge when the
    conditional branches at the addresses in `taken` jump and the others fall through
    (unconditional ones always jump): (count, opcode histogram, [(address, target, taken)]
    for every conditional branch met), or an error string."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    i, n, hist, met = lo, 0, collections.Counter(), []
    while True:
        if n > 4 * (hi - lo + 1):
            return "the path does not reach the back edge (a loop inside the loop?)"
        addr, text = ins[i]
        n += 1
        hist[opcode(text)] += 1
        if i == hi:
            return n, hist, met
        m = BRA_RE.search(text) if opcode(text) == "BRA" else None
        if m:
            target = int(m.group(1), 16)
            jump = True
            if addr in conditional:
                jump = addr in taken
                met.append((addr, target, jump))
            if jump:
                if target not in index or not lo <= index[target] <= hi:
                    return f"the branch at {addr:#x} leaves the loop"
                i = index[target]
                continue
        i += 1


def analyse(path, args, cuobjdump):
    funcs, predicated = parse(sass_text(path, cuobjdump))
    if not funcs:
        sys.exit(f"sass_loop: {path}: no SASS functions found (is it CUDA code compiled for a real architecture?)")
    names = demangle(list(funcs))
    rx = re.compile(args.kernel)
    out = {}
    for mangled, ins in funcs.items():
        name = names[mangled]
        if not (rx.search(name) or rx.search(mangled)):
            continue
        loop = hot_loop(ins, args.opcode)
        out[name] = loop_stats(ins, *loop) if loop else None
        if loop and args.taken is not None:
            out[name]["path"] = taken_path(ins, *loop, predicated[mangled], args.taken)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="object files, executables or cuobjdump -sass text (.sass/.txt); two = before, after")
    ap.add_argument("--kernel", default=".", help="regular expression over the (demangled) function names")
    ap.add_argument("--opcode", default="HMMA", help="an opcode the hot loop holds (default HMMA)")
    ap.add_argument("--top", type=int, default=12, help="opcodes shown per kernel (default 12)")
    ap.add_argument("--cuobjdump", help="path of cuobjdump")
    ap.add_argument("--taken", metavar="ADDR,...",
                    help="also count one iteration's path: the conditional branches at these hex addresses "
                         "jump, the others fall through ('' for none); one input only")
    args = ap.parse_args()
    if len(args.inputs) > 2:
        sys.exit("sass_loop: give one input, or two to compare (before, after)")
    if args.taken is not None:
        if len(args.inputs) != 1:
            sys.exit("sass_loop: --taken needs exactly one input (branch addresses differ between builds)")
        try:
            args.taken = {int(a, 16) for a in args.taken.split(",") if a.strip()}
        except ValueError:
            sys.exit(f"sass_loop: --taken wants hex addresses separated by commas, e.g. 0x8530,0x9170; got {args.taken!r}")
    cuobjdump = find_cuobjdump(args.cuobjdump)
    runs = [analyse(p, args, cuobjdump) for p in args.inputs]
    for path, res in zip(args.inputs, runs):
        print(f"== {path}: {len(res)} function(s) matching {args.kernel!r}")
        if not res:
            continue
        print("| kernel | loop instructions | every iteration | in forward branches | top opcodes (every iteration) |")
        print("|---|---:|---:|---:|---|")
        for name, st in sorted(res.items()):
            if st is None:
                print(f"| {name} | no loop with {args.opcode} | | | |")
                continue
            top = ", ".join(f"{k} {v}" for k, v in st["hist"].most_common(args.top))
            print(f"| {name} | {st['total']} | {st['every']} | {st['cond']} | {top} |")
        for name, st in sorted(res.items()):
            if not st or "path" not in st:
                continue
            if isinstance(st["path"], str):
                print(f"path of {name}: {st['path']}")
                continue
            n, hist, met = st["path"]
            top = ", ".join(f"{k} {v}" for k, v in hist.most_common(args.top))
            branches = ", ".join(f"{a:#x}->{t:#x} {'taken' if j else 'not taken'}" for a, t, j in met)
            print(f"path of {name}: {n} instructions per iteration ({top}); conditional branches: {branches or 'none'}")
    if len(runs) == 2:
        both = sorted(set(runs[0]) & set(runs[1]))
        print(f"\n== change, {args.inputs[0]} -> {args.inputs[1]} (every-iteration instructions)")
        for name in both:
            a, b = runs[0][name], runs[1][name]
            if not a or not b:
                continue
            ops = sorted(set(a["hist"]) | set(b["hist"]))
            moved = ", ".join(f"{o} {b['hist'][o] - a['hist'][o]:+d}" for o in ops if b["hist"][o] != a["hist"][o])
            print(f"{name}: {a['every']} -> {b['every']} ({b['every'] - a['every']:+d}){': ' + moved if moved else ''}")


if __name__ == "__main__":
    main()
