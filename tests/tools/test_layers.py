#!/usr/bin/env python3
"""The modules under src/ depend one way: a file may include headers of its own module and of
the modules before it in LAYERS, never of one after it (docs/architecture.md, "Layers")."""
import os
import re
import sys

LAYERS = ["core", "config", "kv", "io", "text", "attention", "ops", "sampling", "model", "engine", "offline", "server",
          "app"]


def main():
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")
    rank = {m: i for i, m in enumerate(LAYERS)}
    bad = []
    for root, _, files in os.walk(src):
        for f in files:
            path = os.path.join(root, f)
            module = os.path.relpath(path, src).split(os.sep)[0]
            if module not in rank:
                bad.append(f"{os.path.relpath(path, src)}: module '{module}' is not in LAYERS")
                continue
            with open(path, encoding="utf-8", errors="replace") as fh:
                for n, line in enumerate(fh, 1):
                    m = re.match(r'\s*#\s*include\s+"([a-z_]+)/', line)
                    if m and m.group(1) in rank and rank[m.group(1)] > rank[module]:
                        bad.append(f"{os.path.relpath(path, src)}:{n}: {module}/ includes {m.group(1)}/ "
                                   f"(a later layer)")
    for b in bad:
        print(b)
    print(f"layers: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
