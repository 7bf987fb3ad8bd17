"""The prefix cache's tiers through `kvlm serve` (--kv-offload-gib, --kv-offload-dir).

A server with a KV pool of a few requests, a small host tier and a disk tier answers prompts
over a shared prefix; stopped with SIGTERM, it leaves its cached pages on disk; a second server
on the same model and directory answers the same prompts with the same text, reading pages back
from disk (its /metrics say so) and computing fewer prompt tokens; a server with another KV
format finds none of them. A damaged page file is ignored with a log line.

usage: python kv_offload_test.py KVLM_BINARY MODEL_DIR
"""
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Checks, Server, metric  # noqa: E402

KVLM, MODEL = sys.argv[1], sys.argv[2]
checks = Checks()
check = checks.check
disk = tempfile.mkdtemp(prefix="kvlm-kv-offload-")
shared = ("Once upon a time a little fox lived at the edge of a quiet forest, and every morning she walked "
          "to the river to look at the sky and count the clouds that passed over the hills. ")
prompts = [shared + tail for tail in ["One day", "The fox said", "Later that week", "It was raining", "Her friend"]]


def serve(*extra):
    return Server(KVLM, MODEL, "--kv-cache-memory", "1MiB", "--max-model-len", "256", "--max-num-seqs", "2",
                  "--kv-offload-gib", "0.002", "--kv-offload-dir", disk, "--kv-offload-disk-gib", "0.05", *extra)


def answers(s):
    out = []
    for p in prompts:
        status, body = s.post("/v1/completions", {"model": os.path.basename(MODEL.rstrip("/")), "prompt": p, "max_tokens": 8, "temperature": 0})
        check(status == 200, f"completion: {status} {body[:200]}")
        out.append(body.split('"text":')[1].split('"')[1] if status == 200 else None)
    return out


first = serve()
want = answers(first)
m1 = first.metrics()
check(metric(m1, "kvlm:kv_offload_disk_capacity_pages") > 0, "the disk tier's capacity in /metrics")
check(first.stop() == 0, "the first server stops cleanly")
pages = glob.glob(os.path.join(disk, "*", "*.kvpage"))
check(len(pages) > 0, "the stopped server left its pages on disk")

second = serve()
got = answers(second)
m2 = second.metrics()
check(got == want, f"the same text after the restart: {got} vs {want}")
read = metric(m2, "kvlm:kv_offload_disk_read_pages_total")
check(read > 0, "the restarted server read pages back from disk")
check(metric(m2, "kvlm:prompt_tokens_total") < metric(m1, "kvlm:prompt_tokens_total"),
      "the restarted server computed fewer prompt tokens")
check(metric(m2, "kvlm:kv_offload_disk_damaged_total") == 0, "no damaged files")
check(second.stop() == 0, "the second server stops cleanly")

# Another KV format: other pages, in a directory of their own; nothing of the first's is read.
other = serve("--kv-cache-dtype", "int8_per_token_head")
answers(other)
m3 = other.metrics()
check(metric(m3, "kvlm:kv_offload_disk_read_pages_total") == 0, "another KV plan read none of the pages")
check(other.stop() == 0, "the int8 server stops cleanly")
check(len(glob.glob(os.path.join(disk, "*"))) == 2, "one directory per model and plan")

# A damaged file (its header overwritten): ignored with a log line at start and removed; the
# text unchanged.
with open(pages[0], "r+b") as f:
    f.write(b"NOTAPAGE")
third = serve()
check(answers(third) == want, "the same text with a damaged page file")
m4 = third.metrics()
check(third.stop() == 0, "the third server stops cleanly")
check(any("disk tier: ignored" in line and "not a kvlm page file" in line for line in third.log),
      "the damaged file was logged: " + "".join(third.log)[-500:])
check(metric(m4, "kvlm:kv_offload_disk_damaged_total") == 1, "the damaged file counted in /metrics")
sys.exit(checks.report())
