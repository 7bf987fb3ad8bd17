"""``kvlm eval`` from Python: perplexity, and KL divergence against a saved run, so that a
notebook can sweep KV precisions (docs/examples/kv_sweep.py)."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from . import LLM

__all__ = ["perplexity"]


def perplexity(llm: LLM, text: str, ctx: int = 512, max_chunks: int = 0, save_logits: Optional[str] = None,
               kl_divergence_base: Optional[str] = None) -> dict:
    """Perplexity of `text` in windows of `ctx` tokens (the second half of each scored), and with
    `kl_divergence_base` (a file an earlier run wrote with `save_logits`, e.g. with a bf16 cache)
    the KL divergence and top-token agreement against it — ``kvlm eval perplexity``'s figures."""
    ids = llm.get_tokenizer().encode(text)
    return json.loads(llm._engine.perplexity(ids, ctx, max_chunks, os.fspath(save_logits or ""),
                                             os.fspath(kl_divergence_base or "")))
