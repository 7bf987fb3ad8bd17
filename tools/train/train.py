"""Trains kvlm's bundled model: a Qwen3-architecture model of at most 12M parameters with
its own byte-level BPE tokenizer, on the procedural corpus of corpus.py, within a wall-clock
budget. See README.md in this folder for the design and the estimates.

    python3 tools/train/train.py --out OUT [--time-budget S] [--deadline UNIX_TIME] [--smoke]

Writes OUT/model (Hugging Face directory, bf16 safetensors, tokenizer, chat template,
generation config, model card), OUT/eval (evaluation sets built with --eval-seed) and
OUT/train_log.json (loss curve, plan, timings, scores). run.sh then adds kv_stats.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import sys
import time
import traceback

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import evaluate  # noqa: E402
from data import BatchStream  # noqa: E402
from text_tokenizer import train_tokenizer, write_tokenizer_files  # noqa: E402

MAX_PARAMS = 12_000_000
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Train kvlm's bundled Qwen3-architecture model.")
    ap.add_argument("--out", required=True, help="output directory (model/, eval/, train_log.json)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, short contexts, small eval sets: a CPU test of the pipeline")
    ap.add_argument("--seed", type=int, default=1234, help="corpus, tokenizer and init seed")
    ap.add_argument("--eval-seed", type=int, default=987654, help="seed of the evaluation sets")
    ap.add_argument("--device", default="auto", help="auto, cuda or cpu")
    # Time: training (setup, compile, benchmark and steps) ends by the earlier of
    # start + time-budget and the deadline; saving and evaluation follow.
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds from the start of train.py to the end of training")
    ap.add_argument("--deadline", type=float, default=None, help="unix time by which training ends")
    ap.add_argument("--steps", type=int, default=None,
                    help="fixed number of optimizer steps (skips planning from the measured step time)")
    # Model
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary target (the corpus saturates below it)")
    ap.add_argument("--rope-theta", type=float, default=100000.0)
    ap.add_argument("--max-positions", type=int, default=9216,
                    help="max_position_embeddings: the 8192 trained positions plus room to generate")
    # Optimisation
    ap.add_argument("--seq-len", type=int, default=None, help="packed row length (tokens)")
    ap.add_argument("--batch-rows", type=int, default=None, help="rows per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=float, default=0.04, help="warmup, as a fraction of the steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="torch.compile the model (auto: on CUDA), falling back to eager on error")
    ap.add_argument("--doc-mask", choices=["on", "off"], default="on",
                    help="attention within documents only (flex_attention on CUDA) instead of across the packed row")
    ap.add_argument("--recall-weight", type=float, default=None,
                    help="loss weight of the recall answers' tokens (default: the corpus mix's)")
    ap.add_argument("--workers", type=int, default=None, help="corpus worker processes")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--eval-batch-tokens", type=int, default=None)
    ap.add_argument("--eval-limit", type=int, default=None,
                    help="score only the first N items of each evaluation set (default all)")
    a = ap.parse_args()

    full = dict(hidden=384, layers=7, heads=6, kv_heads=2, intermediate=1024, seq_len=8192,
                batch_rows=16, time_budget=480.0, log_every=20, eval_batch_tokens=200_000)
    smoke = dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, seq_len=1024,
                 batch_rows=4, time_budget=35.0, log_every=5, eval_batch_tokens=16_384)
    for k, v in (smoke if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.workers is None:
        a.workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    return a


# --------------------------------------------------------------------------------------
# Setup helpers
# --------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_rendering_and_tokens(tok, rb: corpus.RowBuilder, seed: int) -> None:
    """Fail early if the Python ChatML renderer and the Jinja template disagree, or if
    token ids built piece by piece differ from encoding the whole document."""
    import jinja2
    template = jinja2.Environment().from_string(corpus.CHAT_TEMPLATE)
    rng = random.Random(f"check-{seed}")
    for _ in range(50):
        msgs = corpus.chat_messages(rng)
        for gen in (False, True):
            want = template.render(messages=msgs, add_generation_prompt=gen)
            if corpus.render_chat(msgs, gen) != want:
                raise RuntimeError(f"render_chat disagrees with the chat template:\n{want!r}")
    for _ in range(20):
        msgs = corpus.arithmetic_messages(corpus.arithmetic_problem(rng))
        ids, kinds = corpus.chat_ids_kinds(tok, msgs, corpus.KIND_ARITH)
        whole = tok.encode(corpus.render_chat(msgs) + corpus.EOT, add_special_tokens=False).ids
        if ids != whole or len(kinds) != len(ids):
            raise RuntimeError("piecewise ChatML token ids differ from the whole document's")
    for n, keys, questions in ((300, None, 1), (2000, None, 1), (400, 4, 3), (1500, 3, 3)):
        d = corpus.recall_doc(rng, tok, n, n_keys=keys, n_questions=questions)
        whole = tok.encode(d.text(), add_special_tokens=False).ids
        if d.ids() != whole:
            raise RuntimeError("recall document: paragraph-wise token ids differ from the whole document's")
        if len(whole) > n:
            raise RuntimeError(f"recall document of {len(whole)} tokens exceeds its limit {n}")
        if len(d.turns) != min(questions, len(d.vaults)) - 1:
            raise RuntimeError("recall document: wrong number of follow-up questions")
        msgs = [{"role": "user", "content": d.prompt[len(corpus.IM_START + "user\n"):].split(corpus.IM_END)[0]},
                {"role": "assistant", "content": d.answer_text}]
        for q, a in d.followups:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if template.render(messages=msgs, add_generation_prompt=False) != d.text():
            raise RuntimeError("recall document: text differs from the chat template's rendering")
    ids, kinds = rb.row(rng, 1.0)
    vocab = tok.get_vocab_size()
    if len(ids) != rb.mix.seq_len + 1 or len(kinds) != len(ids) or not all(0 <= i < vocab for i in ids):
        raise RuntimeError("a packed row has the wrong length or out-of-vocabulary ids")


TRAIN_ATTENTION = "kvlm_causal"
SPARSE_DOC = 256   # document length of the sparse timing step (document masking)


def causal_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Training attention over packed rows. Inputs [B, H, T, D].

    Registered with transformers' AttentionInterface under a name that has no mask function,
    so transformers builds no mask of its own (not even under torch.compile, where its SDPA
    path would materialise one); Trainer passes its own as {"full_attention": mask}:
    - None: plain causal attention across the whole row: SDPA with is_causal=True and KV
      heads repeated to the query heads, the shape the flash kernel takes;
    - a flex_attention BlockMask (document masking on CUDA): flex_attention;
    - a bool tensor [B, 1, T, T], True = may attend (document masking on CPU): SDPA.
    """
    if query.shape[2] != key.shape[2]:
        raise RuntimeError("training attention expects full self-attention over the row")
    dtype = value.dtype   # bf16 under autocast (q and k come out of the fp32 q/k norms)
    query, key = query.to(dtype), key.to(dtype)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        out = flex_attention_fn()(query, key, value, block_mask=attention_mask, scale=scaling,
                                  enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if attention_mask is None:
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                             is_causal=True)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


_FLEX_COMPILED = None


def flex_attention_fn():
    """flex_attention as such inside a compiled region; compiled on its own otherwise (eager
    flex_attention materialises the whole score matrix)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention
    if torch.compiler.is_compiling():
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def document_ids(inputs: torch.Tensor, eot: int) -> torch.Tensor:
    """[B, T] index of the document each input token belongs to: every document ends with
    <|endoftext|> (which belongs to it), the filler at the end of a row is one more."""
    ends = (inputs == eot).int()
    return torch.cumsum(ends, dim=1) - ends


def document_block_mask(doc: torch.Tensor, block: int = 128):
    """flex_attention BlockMask for causal attention within documents, built directly from
    the document ids (non-decreasing along each row) in O(B * (T / block)^2): a block of
    queries i and of keys j <= i interact iff the last document of j reaches the first of i;
    they are fully visible iff j < i and both lie in one document."""
    from torch.nn.attention.flex_attention import BlockMask
    bsz, t = doc.shape
    n = t // block
    d = doc.view(bsz, n, block)
    first, last = d[:, :, 0], d[:, :, -1]
    idx = torch.arange(n, device=doc.device)
    lower = idx[:, None] >= idx[None, :]                               # [i, j]: j <= i
    touch = lower[None] & (last[:, None, :] >= first[:, :, None])       # [b, i, j]
    full = (idx[:, None] > idx[None, :])[None] & (first[:, None, :] == last[:, :, None])
    partial = touch & ~full

    def blocks(m: torch.Tensor):
        num = m.sum(-1, dtype=torch.int32)
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[:, None].contiguous(), order[:, None].contiguous()

    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(t, t))


def document_dense_mask(doc: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal attention within documents (the CPU path)."""
    t = doc.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def set_attention(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except Exception:  # older transformers 5.x: set the field the attention layers read
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        raise RuntimeError(f"could not set attention implementation {name!r}")


def build_model(args, vocab_size: int, ids: dict, device: torch.device):
    from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
    AttentionInterface.register(TRAIN_ATTENTION, causal_attention)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
        use_sliding_window=False, hidden_act="silu", initializer_range=0.02,
        bos_token_id=None, eos_token_id=ids[corpus.IM_END], pad_token_id=ids[corpus.EOT])
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta != args.rope_theta:
        raise RuntimeError(f"Qwen3Config did not take rope_theta {args.rope_theta} (has {theta})")
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).float().to(device)
    set_attention(model, TRAIN_ATTENTION)
    n_params = sum(p.numel() for p in model.parameters())   # tied embedding counted once
    if n_params > MAX_PARAMS:
        raise SystemExit(f"model has {n_params:,} parameters, over the {MAX_PARAMS:,} limit")
    return model, n_params


def make_optimizer(model, args, device: torch.device):
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **extra)


def lr_at(step: int, total: int, args) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    warm = max(1, int(args.warmup * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def set_compiled(model, on: bool) -> None:
    """Regional compilation: each decoder layer is compiled (they share one graph, so this
    compiles once and quickly); embedding, final norm, LM head and loss stay eager."""
    for layer in model.model.layers:
        if on:
            if getattr(layer, "_kvlm_compiled", None) is None:   # compile once, reuse after
                layer.compile()
                layer._kvlm_compiled = layer._compiled_call_impl
            layer._compiled_call_impl = layer._kvlm_compiled
        else:
            layer._compiled_call_impl = None


class Trainer:
    """One optimizer step on a packed batch; per-kind loss sums stay on the device."""

    def __init__(self, model, args, device: torch.device, compiled: bool, doc_mask: bool = False,
                 recall_weight: float = 1.0, eot: int = 0):
        self.model = model
        self.args = args
        self.device = device
        self.doc_mask = doc_mask
        self.eot = eot
        # Loss weight per target kind: padding 0, recall answers (vault name, key digits)
        # recall_weight, everything else 1.
        w = [1.0] * len(corpus.KIND_NAMES)
        w[corpus.KIND_PAD] = 0.0
        w[corpus.KIND_RECALL] = w[corpus.KIND_KEY] = recall_weight
        self.kind_weight = torch.tensor(w, device=device)
        set_compiled(model, compiled)
        self.forward = model
        self.autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        self.reset_optimizer()
        self.reset_stats()

    def reset_optimizer(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.opt = make_optimizer(self.model, self.args, self.device)

    def reset_stats(self) -> None:
        n = len(corpus.KIND_NAMES)
        self.kind_loss = torch.zeros(n, device=self.device, dtype=torch.float64)
        self.kind_count = torch.zeros(n, device=self.device, dtype=torch.float64)

    def step(self, ids: np.ndarray, kinds: np.ndarray, lr: float) -> None:
        pin = self.device.type == "cuda"
        ids_t = torch.from_numpy(ids)
        kinds_t = torch.from_numpy(kinds)
        if pin:
            ids_t, kinds_t = ids_t.pin_memory(), kinds_t.pin_memory()
        ids_t = ids_t.to(self.device, non_blocking=True).long()
        kinds_t = kinds_t.to(self.device, non_blocking=True)[:, 1:].reshape(-1).long()
        inputs, targets = ids_t[:, :-1], ids_t[:, 1:].reshape(-1)
        targets = targets.masked_fill(kinds_t == corpus.KIND_PAD, -100)
        for g in self.opt.param_groups:
            g["lr"] = lr
        mask = None
        if self.doc_mask:
            doc = document_ids(inputs, self.eot)
            mask = document_block_mask(doc) if self.device.type == "cuda" else document_dense_mask(doc)
        with self.autocast:
            logits = self.forward(input_ids=inputs, use_cache=False,
                                  attention_mask={"full_attention": mask}).logits
        tok_loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets,
                                   ignore_index=-100, reduction="none")
        weight = self.kind_weight[kinds_t]
        loss = (tok_loss * weight).sum() / weight.sum().clamp(min=1e-6)
        loss.backward()
        if self.args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():   # scatter_add, unlike bincount, needs no host sync
            self.kind_loss.scatter_add_(0, kinds_t, tok_loss.detach().double())
            self.kind_count.scatter_add_(0, kinds_t, torch.ones_like(tok_loss, dtype=torch.float64))

    def read_stats(self) -> tuple[float, dict]:
        """(mean loss over non-pad tokens, {kind: mean loss}) since the last read."""
        loss = self.kind_loss.cpu().numpy()
        count = self.kind_count.cpu().numpy()
        self.reset_stats()
        mean = float(loss[1:].sum() / max(1.0, count[1:].sum()))
        per_kind = {corpus.KIND_NAMES[k]: round(float(loss[k] / count[k]), 4)
                    for k in range(1, len(loss)) if count[k] > 0}
        return mean, per_kind


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def benchmark(trainer: Trainer, args, device, vocab: int, warmup: int, timed: int,
              doc_len: int | None = None) -> float:
    """Median seconds per step on random tokens of the training shape (lr 0: no update
    sticks, and the caller restores the initial state anyway). Includes compilation.
    Random tokens hold no <|endoftext|>: one document per row, unless `doc_len` puts one
    every doc_len tokens (the sparse case of document masking)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch_rows, args.seq_len + 1), generator=g).int().numpy()
    if doc_len:
        ids[:, doc_len - 1::doc_len] = trainer.eot
    kinds = np.full(ids.shape, corpus.KIND_TEXT, dtype=np.uint8)
    times = []
    for i in range(warmup + timed):
        t = time.time()
        trainer.step(ids, kinds, 0.0)
        sync(device)
        times.append(time.time() - t)
        if i < warmup:
            log(f"  benchmark warmup step {i + 1}/{warmup}: {times[-1]:.2f}s")
    trainer.reset_stats()
    return float(np.median(times[warmup:]))


def attention_fraction(ids: np.ndarray, eot: int, block: int = 128) -> float:
    """Share of the causal (block x block) attention tiles of one row of input ids that
    document masking computes: tiles of queries i and keys j <= i whose documents meet."""
    ends = (ids == eot).astype(np.int64)
    doc = np.cumsum(ends) - ends
    n = len(ids) // block
    if n == 0:
        return 1.0
    first, last = doc[0:n * block:block], doc[block - 1:n * block:block]
    j_min = np.searchsorted(last, first, side="left")   # last is non-decreasing
    return float((np.arange(n) - j_min + 1).sum() / (n * (n + 1) / 2))


def sample_rows(builder: corpus.RowBuilder, eot: int, points: int = 8, rows: int = 3) -> tuple[float, float]:
    """(mean attention fraction under document masking, mean seconds to build a row on
    this core), over rows drawn through the whole curriculum."""
    fracs, secs = [], []
    for p in range(points):
        for r in range(rows):
            t = time.time()
            ids, _ = builder.row(random.Random(f"plan-{p}-{r}"), (p + 0.5) / points)
            secs.append(time.time() - t)
            fracs.append(attention_fraction(np.asarray(ids[:-1]), eot))
    return float(np.mean(fracs)), float(np.mean(secs))


# --------------------------------------------------------------------------------------
# Saving and the model card
# --------------------------------------------------------------------------------------
def save_model(model, tok, out_dir: str, ids: dict) -> None:
    from transformers import GenerationConfig
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=[ids[corpus.IM_END], ids[corpus.EOT]],
        pad_token_id=ids[corpus.EOT], do_sample=False)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:   # a transformers version without the argument: safetensors is the default
        model.save_pretrained(out_dir)
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        raise RuntimeError(f"save_pretrained wrote no model.safetensors in {out_dir}")


def fmt_pct(res: dict, name: str) -> str:
    r = res.get(name)
    return f"{r['accuracy']:.1%} ({r['correct']}/{r['items']})" if r else "not measured"


def write_card(path: str, L: dict) -> None:
    """The model card (README.md of the model directory), from the training log `L`."""
    c, s, sc = L["model"], L["training"], L.get("scores", {})
    ppl = L.get("heldout_perplexity")
    curve = L["loss_curve"]
    first = curve[0] if curve else None
    last = curve[-1] if curve else None
    samples = L.get("samples", [])
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "---",
        "",
        f"# {L['name']}",
        "",
        f"A {c['parameters'] / 1e6:.1f}M-parameter Qwen3-architecture model (`Qwen3ForCausalLM`, q/k "
        "RMSNorm) trained from scratch by kvlm's `tools/train/run.sh` on a procedurally generated "
        "corpus. It exists to make KV-cache quantization damage measurable on a model the project "
        "controls end to end: it solves short arithmetic word problems and finds pass keys hidden "
        "in up to 8k tokens of text, and those scores move when the KV cache loses precision.",
        "",
        "## Scores (transformers, greedy decoding, bf16 weights"
        + (", bf16 KV cache)" if L["device"]["type"] == "cuda" else ", fp32 compute)"),
        "",
        "| task | exact match |",
        "|---|---|",
        f"| arithmetic word problems (2-4 steps) | {fmt_pct(sc, 'arithmetic')} |",
        f"| pass-key recall, ~1k-token prompts | {fmt_pct(sc, 'recall_1k')} |",
        f"| pass-key recall, ~4k-token prompts | {fmt_pct(sc, 'recall_4k')} |",
        f"| pass-key recall, ~8k-token prompts | {fmt_pct(sc, 'recall_8k')} |",
    ]
    if ppl:
        lines.append(f"| held-out prose perplexity (windows of {ppl['ctx']} tokens) | {ppl['ppl']:.3f} |")
    lines += [
        "",
        f"The evaluation sets were generated with a different seed ({L['eval_seed']}) from the "
        f"training corpus ({L['seed']}); they are in `eval/` of the training output "
        "(prompts already rendered in ChatML, `regex` group 1 is compared with `answer`).",
        "",
        "## Prompt formats",
        "",
        "All three tasks are ChatML conversations (the chat template in tokenizer_config.json; "
        "no BOS token; generation ends at `<|im_end|>`):",
        "",
        "```",
        corpus.render_chat(corpus.arithmetic_messages(corpus.arithmetic_problem(random.Random(3)))).rstrip("\n"),
        "```",
        "",
        "```",
        corpus.render_chat([{"role": "user", "content": corpus.RECALL_HEADER + "(prose, 1k-8k tokens, "
                             "with one to three sentences like: The pass key for the amber vault is "
                             "48213.)\n\nWhat is the pass key for the amber vault?"},
                            {"role": "assistant", "content": "The pass key for the amber vault is 48213."}]).rstrip("\n"),
        "```",
        "",
        "Chat turns: `Repeat the word apple three times.`, `What is 3 plus 4?`, `Reverse the list: a, b, c.`, "
        "`Say hello to Nora.`, `Sort these numbers from smallest to largest: ...`, `Which is larger, 12 or 40?`.",
        "",
    ]
    if samples:
        lines += ["Greedy samples from this checkpoint:", ""]
        for smp in samples:
            reply = smp["assistant"] if len(smp["assistant"]) <= 200 else smp["assistant"][:200] + "..."
            lines += [f"- **user:** {smp['user']}  ", f"  **assistant:** {reply!r}"]
        lines.append("")
    lines += [
        "## How it was made",
        "",
        "- **Corpus** (`tools/train/corpus.py`, seed "
        f"{L['seed']}): generated on the fly, never repeated. Token shares: ~{L['mix']['recall_share']:.0%} recall documents "
        f"(ChatML; {L['mix']['recall_keys'][0]}-{L['mix']['recall_keys'][1]} keys in prose, up to "
        f"{L['mix']['recall_questions']} questions per document as follow-up turns, no vault name twice in a "
        f"row; lengths log-uniform from {L['mix']['recall_min']} tokens up to the current longest, which stays "
        f"at {L['mix']['recall_start_max']} for the first {L['mix']['recall_hold']:.0%} of the steps and then "
        f"grows to {L['mix']['seq_len']} by {L['mix']['recall_ramp']:.0%}), ~33% arithmetic problems with "
        "worked solutions, ~8% chat turns, the rest plain prose. Documents are packed whole into "
        f"rows of {L['mix']['seq_len']} tokens, separated by `<|endoftext|>`"
        + ("; attention stays within each document (block-diagonal causal mask)"
           if L['training'].get('doc_mask') else "; attention runs across the whole row")
        + f"; the loss covers every token, recall answers weighted {L['mix']['recall_weight']:g}x.",
        f"- **Tokenizer**: byte-level BPE trained with Hugging Face `tokenizers` on {L['tokenizer']['train_chars']:,} "
        f"characters of the corpus: {L['tokenizer']['vocab_size']} tokens (the corpus' word list saturates "
        "it), Qwen2's pre-tokenizer regex (digits are single tokens), NFC, special tokens "
        "`<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2).",
        f"- **Architecture**: Qwen3, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} query heads / {c['num_key_value_heads']} KV heads, head_dim "
        f"{c['head_dim']}, MLP {c['intermediate_size']}, vocab {c['vocab_size']}, tied embeddings, "
        f"RoPE theta {c['rope_theta']:g}, max_position_embeddings {c['max_position_embeddings']}; "
        f"{c['parameters']:,} parameters.",
        f"- **Training**: {s['steps']} AdamW steps (betas 0.9/0.95, weight decay {s['weight_decay']}, "
        f"peak lr {s['lr']}, {s['warmup_steps']} warmup steps then cosine to {s['min_lr_ratio']}x) of "
        f"{s['batch_rows']} x {s['seq_len']} tokens: {s['tokens_seen'] / 1e6:.0f}M tokens in "
        f"{s['train_seconds']:.0f}s ({s['tokens_per_second'] / 1e3:.0f}k tokens/s) on "
        f"{L['device']['name']}; fp32 master weights, bf16 autocast, "
        f"{'document-masked attention' if s.get('doc_mask') else 'SDPA attention'}, "
        f"torch.compile {'on' if s['compiled'] else 'off'}. Total wall time {L['wall_seconds']:.0f}s.",
    ]
    if L["plan"].get("stopped_early"):
        lines.append(f"- **Training stopped early**: {L['plan']['stopped_early'].splitlines()[0]}")
    if first and last:
        lines.append(f"- **Loss**: {first['loss']:.3f} at step {first['step']}, {last['loss']:.3f} at "
                     f"step {last['step']} (per kind at the end: "
                     + ", ".join(f"{k} {v:.3f}" for k, v in last.get("kind_loss", {}).items()) + ").")
    lines += [
        "",
        "## Limitations",
        "",
        "It knows nothing beyond its synthetic corpus: a small vocabulary of names, towns and objects, "
        "a few problem templates, one recall phrasing. Its K/V activation statistics are in "
        "`kv_stats.md` of the training output; they need not match those of large pretrained "
        "models, so quantization results on it are a regression signal, not a prediction for "
        "other models.",
        "",
        "## Reproduce",
        "",
        "```sh",
        "bash tools/train/run.sh OUT   # in the kvlm repository, on one GPU, ~10 minutes",
        "```",
        "",
        "The corpus, tokenizer and initialization are fixed by the seed; the number of steps is "
        "planned from the measured step time unless `--steps` is given, and GPU kernels are not "
        "bitwise deterministic.",
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def main() -> int:
    args = parse_args()
    run_start = time.time()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    out_model = os.path.join(args.out, "model")
    out_eval = os.path.join(args.out, "eval")
    os.makedirs(out_model, exist_ok=True)
    seed_everything(args.seed)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    log(f"kvlm train: out={args.out} device={device} ({dev_name}) smoke={args.smoke} seed={args.seed} "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs")

    # Tokenizer --------------------------------------------------------------------------
    texts = corpus.tokenizer_training_texts(random.Random(f"tokenizer-{args.seed}"),
                                            4000 if args.smoke else 16000)
    tok = train_tokenizer(texts, args.vocab)
    write_tokenizer_files(tok, out_model, args.max_positions)
    ids = {s: tok.token_to_id(s) for s in corpus.SPECIAL_TOKENS}
    vocab = tok.get_vocab_size()
    log(f"tokenizer: {vocab} tokens from {sum(map(len, texts)):,} characters")

    mix = corpus.Mix(seq_len=args.seq_len)
    if args.smoke:
        mix = dataclasses.replace(mix, recall_start_max=256, recall_min=128, prose_max_paragraphs=6)
    if args.recall_weight is not None:
        mix = dataclasses.replace(mix, recall_weight=args.recall_weight)
    if args.doc_mask == "on" and device.type == "cuda" and args.seq_len % 128:
        raise SystemExit("--doc-mask on needs --seq-len a multiple of 128 (flex_attention blocks)")
    trainer_kw = dict(doc_mask=args.doc_mask == "on", recall_weight=mix.recall_weight, eot=ids[corpus.EOT])
    check_rendering_and_tokens(tok, corpus.RowBuilder(tok, mix), args.seed)
    log("checks passed: chat template == renderer, piecewise token ids == whole-document ids, row packing")

    # Evaluation sets ----------------------------------------------------------------------
    sizes = corpus.EvalSizes()
    if args.smoke:
        sizes = corpus.EvalSizes(arithmetic=8, heldout_chars=20_000,
                                 recall={"recall_1k": (4, 900, 1024), "recall_4k": (2, 3700, 4096),
                                         "recall_8k": (2, 7300, 8100)})
    eval_summary = corpus.build_eval_sets(out_eval, tok, args.eval_seed, sizes)
    log(f"eval sets: {json.dumps(eval_summary)}")

    # Data workers (forked before CUDA starts) ---------------------------------------------
    stream = BatchStream(tok.to_str(), mix, args.batch_rows, args.seed, args.workers,
                         prefetch=max(8, 2 * args.workers))
    attn_frac, row_seconds = sample_rows(corpus.RowBuilder(tok, mix), ids[corpus.EOT])
    data_tps = args.workers * (args.seq_len + 1) / max(row_seconds, 1e-6)
    log(f"data: {args.workers} workers; one row takes {row_seconds:.3f}s on one core "
        f"(~{data_tps / 1e6:.1f}M tokens/s in all); document masking computes {attn_frac:.0%} of the "
        "causal attention tiles on average over the curriculum")

    # Model ----------------------------------------------------------------------------------
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model, n_params = build_model(args, vocab, ids, device)
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    log(f"model: Qwen3 hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x "
        f"{args.head_dim}, MLP {args.intermediate}, vocab {vocab}: {n_params:,} parameters")

    # Plan: measure the step time (eager, then compiled), keep the faster mode, and fit the
    # number of steps into what is left of the budget. With document masking on CUDA only the
    # compiled mode is tried (flex_attention needs compiling either way); if it fails, the
    # run falls back to plain causal attention across the row, so it still trains. -----------
    end = run_start + args.time_budget
    if args.deadline:
        end = min(end, args.deadline)
    modes = {"on": [True], "off": [False]}.get(args.compile, [False, True] if device.type == "cuda" else [False])
    candidates = [(c, False) for c in modes]
    if trainer_kw["doc_mask"]:
        masked = [(True, True)] if device.type == "cuda" and args.compile != "off" else [(modes[0], True)]
        candidates = masked + [(None, False)] + candidates   # None: "use a masked mode if one worked"
    warmup, timed = (2, 3) if device.type == "cuda" else (1, 2)
    timings: dict[tuple[bool, bool], float] = {}
    sparse_timings: dict[bool, float] = {}
    for compiled, doc_mask in candidates:
        if compiled is None:
            if timings:
                break
            log("WARNING: document masking failed; training with causal attention across the row")
            continue
        while True:
            try:
                trainer = Trainer(model, args, device, compiled=compiled, **{**trainer_kw, "doc_mask": doc_mask})
                timings[compiled, doc_mask] = benchmark(trainer, args, device, vocab, warmup + int(compiled), timed)
                log(f"  {'compiled' if compiled else 'eager'}{', document mask' if doc_mask else ''}: "
                    f"{timings[compiled, doc_mask]:.3f}s/step")
                if doc_mask and device.type == "cuda":
                    sparse_timings[compiled] = benchmark(trainer, args, device, vocab, 1, timed, doc_len=SPARSE_DOC)
                    log(f"    with a document every {SPARSE_DOC} tokens: {sparse_timings[compiled]:.3f}s/step")
                break
            except torch.OutOfMemoryError:
                if args.batch_rows <= 1:
                    raise
                args.batch_rows //= 2
                stream.rows = args.batch_rows
                timings.clear()   # measured with the larger batch
                sparse_timings.clear()
                log(f"out of memory: retrying with {args.batch_rows} rows per step")
            except Exception:
                if not (compiled or doc_mask) or args.compile == "on" and not doc_mask:
                    raise
                log(f"{'torch.compile' if compiled else 'training step'}"
                    f"{' with document masking' if doc_mask else ''} failed:\n" + traceback.format_exc(limit=4))
                break
            finally:
                # Back to the initial weights (in place: a compiled graph keeps its parameters).
                model.load_state_dict(init_state)
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if not timings:
        raise RuntimeError("could not run a training step in any mode")
    use_compile, use_mask = min(timings, key=timings.get)
    step_time = dense_time = timings[use_compile, use_mask]
    if use_mask and use_compile in sparse_timings:
        # The step time is ~linear in the share of attention tiles computed: interpolate
        # between the timed dense and sparse steps at the curriculum's mean share + 0.1.
        t_sparse = sparse_timings[use_compile]
        marks = np.zeros(args.seq_len, dtype=np.int64)
        marks[SPARSE_DOC - 1::SPARSE_DOC] = 1
        f_sparse = attention_fraction(marks, 1)
        f = min(1.0, attn_frac + 0.1)
        step_time = t_sparse + (dense_time - t_sparse) * max(0.0, (f - f_sparse) / (1 - f_sparse))
        step_time = min(dense_time, max(step_time, t_sparse))
    # The corpus workers must keep up (x1.25 for safety).
    data_time = 1.25 * args.batch_rows * (args.seq_len + 1) / data_tps
    if data_time > step_time:
        log(f"the corpus workers limit the step time to {data_time:.3f}s (GPU {step_time:.3f}s)")
        step_time = data_time
    del init_state
    trainer = Trainer(model, args, device, compiled=use_compile,
                      **{**trainer_kw, "doc_mask": use_mask})   # fresh AdamW state
    tokens_per_step = args.batch_rows * args.seq_len
    left = end - time.time()
    if args.steps:
        total_steps = args.steps
    else:
        total_steps = max(1, int((left - max(3.0, 0.03 * left)) / step_time))
    if total_steps < 300:
        log(f"WARNING: only {total_steps} steps fit in the budget; the model may not learn the long recall task")
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    log(f"plan: {step_time:.3f}s/step ({tokens_per_step / step_time / 1e3:.0f}k tokens/s, "
        f"compile {'on' if use_compile else 'off'}, document mask {'on' if use_mask else 'off'}, peak memory {mem:.1f} GiB), {left:.0f}s left "
        f"-> {total_steps} steps, {total_steps * tokens_per_step / 1e6:.0f}M tokens")

    # Train ----------------------------------------------------------------------------------
    stream.start(total_steps)
    curve = []
    train_start = time.time()
    last_log = train_start
    stopped_early = None
    hard_end = end + 10.0
    model.train()
    status = 0
    done = 0
    try:
        for step in range(total_steps):
            ids_np, kinds_np = stream.get(step)
            lr = lr_at(step, total_steps, args)
            trainer.step(ids_np, kinds_np, lr)
            done = step + 1
            if done % args.log_every == 0 or done == total_steps:
                loss, per_kind = trainer.read_stats()
                if not math.isfinite(loss):
                    raise RuntimeError(f"loss is {loss} at step {done}")
                now = time.time()
                elapsed = now - train_start
                curve.append({"step": done, "tokens": done * tokens_per_step, "loss": round(loss, 4),
                              "lr": lr, "elapsed_s": round(elapsed, 1), "kind_loss": per_kind})
                if now - last_log > 10 or done == total_steps or done <= 5 * args.log_every:
                    tps = done * tokens_per_step / max(elapsed, 1e-6)
                    log(f"step {done}/{total_steps} loss {loss:.4f} "
                        + " ".join(f"{k}={v:.3f}" for k, v in per_kind.items())
                        + f" lr {lr:.2e} {tps / 1e3:.0f}k tok/s, {elapsed:.0f}s of ~{end - train_start:.0f}s")
                    last_log = now
                if now > hard_end and done < total_steps:
                    stopped_early = f"stopped at step {done} of {total_steps}: past the time budget"
                    log("WARNING: " + stopped_early)
                    break
        sync(device)
    except Exception:
        # Keep what was trained: save and evaluate it, and exit non-zero.
        status = 1
        stopped_early = f"error after step {done} of {total_steps}:\n{traceback.format_exc()}"
        log("ERROR during training; saving the model as it is:\n" + traceback.format_exc())
    stream.close()
    steps_done = done
    train_seconds = time.time() - train_start
    log(f"training done: {steps_done} steps, {steps_done * tokens_per_step / 1e6:.0f}M tokens, "
        f"{train_seconds:.0f}s")

    # Save -----------------------------------------------------------------------------------
    model.eval()
    set_compiled(model, False)
    set_attention(model, "sdpa")
    save_model(model, tok, out_model, ids)
    log(f"saved {out_model}")
    cfg = model.config
    L = {
        "name": "kvlm-tiny",
        "seed": args.seed, "eval_seed": args.eval_seed,
        "args": vars(args),
        "device": {"type": device.type, "name": dev_name},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "tokenizer": {"vocab_size": vocab, "train_chars": sum(map(len, texts))},
        "model": {"parameters": n_params, "hidden_size": cfg.hidden_size,
                  "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                  "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
                  "rope_theta": args.rope_theta, "max_position_embeddings": cfg.max_position_embeddings},
        "mix": dataclasses.asdict(mix),
        "plan": {"step_seconds": {("compiled" if c else "eager") + (" doc_mask" if m else ""): round(v, 4)
                                  for (c, m), v in timings.items()},
                 "step_seconds_sparse_docs": {("compiled" if c else "eager"): round(v, 4)
                                              for c, v in sparse_timings.items()},
                 "attention_fraction": round(attn_frac, 3), "row_seconds": round(row_seconds, 4),
                 "planned_step_seconds": round(step_time, 4),
                 "planned_steps": total_steps, "deadline_in_s": round(end - T0, 1),
                 "stopped_early": stopped_early},
        "training": {"steps": steps_done, "batch_rows": args.batch_rows, "seq_len": args.seq_len,
                     "tokens_seen": steps_done * tokens_per_step, "train_seconds": round(train_seconds, 1),
                     "tokens_per_second": steps_done * tokens_per_step / max(train_seconds, 1e-6),
                     "lr": args.lr, "min_lr_ratio": args.min_lr_ratio,
                     "warmup_steps": max(1, int(args.warmup * total_steps)),
                     "weight_decay": args.weight_decay, "compiled": use_compile, "doc_mask": use_mask,
                     "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
                     if device.type == "cuda" else None},
        "final_loss": curve[-1]["loss"] if curve else None,
        "loss_curve": curve,
        "eval_sets": eval_summary,
    }
    log_path = os.path.join(args.out, "train_log.json")

    def write_log() -> None:
        L["wall_seconds"] = round(time.time() - T0, 1)
        with open(log_path, "w") as f:
            json.dump(L, f, indent=1)
        write_card(os.path.join(out_model, "README.md"), L)

    write_log()

    # Quick evaluation of the saved checkpoint -------------------------------------------------
    try:
        from transformers import AutoTokenizer
        del trainer, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        emodel, etok = evaluate.load(out_model, device)
        hf_tok = AutoTokenizer.from_pretrained(out_model)
        rendered = hf_tok.apply_chat_template([{"role": "user", "content": "Say hello to Ada."}],
                                              tokenize=False, add_generation_prompt=True)
        if rendered != corpus.render_chat([{"role": "user", "content": "Say hello to Ada."}], True):
            raise RuntimeError(f"AutoTokenizer's chat template renders {rendered!r}")
        if hf_tok(rendered)["input_ids"] != etok.encode(rendered).ids:
            raise RuntimeError("AutoTokenizer and tokenizers give different ids")
        L["scores"] = evaluate.score_tasks(emodel, etok, out_eval, device, args.eval_batch_tokens, log=log,
                                           limit=args.eval_limit)
        L["heldout_perplexity"] = evaluate.perplexity(emodel, etok, open(os.path.join(out_eval, "heldout.txt")).read(),
                                                      min(2048, args.seq_len), device)
        log(f"held-out perplexity: {L['heldout_perplexity']['ppl']:.3f}")
        prompts = ["Say hello to Nora.", "Repeat the word river three times.", "What is 17 plus 25?",
                   "Reverse the list: red, green, blue.",
                   "Ada has 12 apples. She buys 7 more apples. She gives 5 apples to Ben. "
                   "How many apples does Ada have now?"]
        outs = evaluate.greedy_completions(
            emodel, etok, [corpus.render_chat([{"role": "user", "content": p}], True) for p in prompts],
            96, args.eval_batch_tokens, device)
        L["samples"] = [{"user": p, "assistant": o} for p, o in zip(prompts, outs)]
        for smp in L["samples"]:
            log(f"sample: {smp['user']!r} -> {smp['assistant']!r}")
    except Exception:
        status = 1
        L["eval_error"] = traceback.format_exc()
        log("ERROR during evaluation (the model is saved):\n" + L["eval_error"])
    write_log()
    log(f"wrote {log_path} and {os.path.join(out_model, 'README.md')}; wall time {time.time() - T0:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
