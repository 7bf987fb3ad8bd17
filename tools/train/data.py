"""Training batches built in worker processes, prefetched in step order.

Batch `step` is a pure function of (seed, step, total_steps): each row has its own
`random.Random` seeded from those, so the stream is the same whatever the number of
workers. Workers are forked from the trainer (as torch's DataLoader does on Linux) and never
touch torch or CUDA; each loads its own tokenizer from the JSON string.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import random

import numpy as np

from corpus import Mix, RowBuilder

_builder: RowBuilder | None = None


def _init_worker(tokenizer_json: str, mix: Mix) -> None:
    global _builder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _builder = RowBuilder(Tokenizer.from_str(tokenizer_json), mix)


def make_batch(seed: int, step: int, total_steps: int, rows: int,
               builder: RowBuilder | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [rows, seq_len + 1], kinds uint8 [rows, seq_len + 1]) of batch `step`."""
    b = builder or _builder
    progress = step / max(1, total_steps)
    ids = np.empty((rows, b.mix.seq_len + 1), dtype=np.int32)
    kinds = np.empty((rows, b.mix.seq_len + 1), dtype=np.uint8)
    for r in range(rows):
        row_ids, row_kinds = b.row(random.Random(f"train-{seed}-{step}-{r}"), progress)
        ids[r] = row_ids
        kinds[r] = row_kinds
    return ids, kinds


def _task(args):
    return make_batch(*args)


class BatchStream:
    """Yields batches 0, 1, ..., total_steps - 1 in order, keeping `prefetch` in flight."""

    def __init__(self, tokenizer_json: str, mix: Mix, rows: int, seed: int, workers: int,
                 prefetch: int):
        self.rows, self.seed, self.prefetch = rows, seed, prefetch
        self.pool = mp.get_context("fork").Pool(workers, initializer=_init_worker,
                                                initargs=(tokenizer_json, mix))
        self.pending: collections.deque = collections.deque()
        self.total_steps = 0
        self.next_submit = 0

    def start(self, total_steps: int) -> None:
        self.total_steps = total_steps
        while self.next_submit < min(total_steps, self.prefetch):
            self._submit()

    def _submit(self) -> None:
        args = (self.seed, self.next_submit, self.total_steps, self.rows)
        self.pending.append((self.next_submit, self.pool.apply_async(_task, (args,))))
        self.next_submit += 1

    def get(self, step: int, timeout: float = 300.0) -> tuple[np.ndarray, np.ndarray]:
        got, result = self.pending.popleft()
        if got != step:
            raise RuntimeError(f"batch stream out of order: wanted {step}, have {got}")
        if self.next_submit < self.total_steps:
            self._submit()
        return result.get(timeout=timeout)

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()
