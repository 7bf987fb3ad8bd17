#!/usr/bin/env python3
"""Trains a DFlash block drafter for a target model (default: the bundled kvlm-tiny) and
writes it as a DFlashDraftModel directory kvlm loads with
--speculative-config '{"method":"dflash","model":DIR,"num_speculative_tokens":K}'.

The recipe is the DFlash paper's (arXiv 2602.06036), scaled to a tiny target:
  * data: the target's own greedy continuations (it is frozen; the drafter learns to predict
    what the target would say) of prompts from tools/train/corpus.py — arithmetic word
    problems, chat turns and prose — with a seed other than the target's training corpus;
  * per sequence, random anchor positions a; each anchor starts a block [token a, mask x
    (B - 1)] at positions a .. a + B - 1 whose queries attend, non-causally, to the context
    K/V of positions < a (projected from the target's hidden states at target_layer_ids
    through fc and hidden_norm, no input norm) and to the whole block;
  * cross-entropy on slots 1 .. B - 1 against the target's tokens, slot k weighted
    exp(-(k - 1) / gamma) (early slots matter most: a draft is accepted up to its first miss);
  * the target's embedding and LM head are shared and frozen; AdamW.
The drafter's equations are kvlm's model/arch/dflash.cpp (and the DFlash reference code's
DFlashDraftModel): rotate-half RoPE at real positions, Qwen3 q/k RMSNorm, SiLU MLP.

Runs on the GPU machine (PyTorch, transformers; no network), within --seconds of training:
    python3 tools/train_dflash.py --out models/kvlm-tiny-dflash [--seconds 240]
--init DIR continues from a drafter this script wrote (same shape; its data are regenerated
from the same seed, its optimizer state starts afresh with a short warm-up).
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "train"))
import corpus  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope(x, pos, theta):
    """Rotate-half RoPE; x [T, heads, d], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :], torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, nh, kvh, d, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
        self.nh, self.kvh, self.d, self.theta = nh, kvh, d, c["rope_theta"]
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, kvh * d, bias=False)
        self.v_proj = nn.Linear(H, kvh * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, c["rms_norm_eps"])
        self.k_norm = RMSNorm(d, c["rms_norm_eps"])
        self.input_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"])
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)

    def forward(self, x, ctx, qpos, kpos, mask):
        Q, C = x.shape[0], ctx.shape[0]
        h = self.input_layernorm(x)
        q = rope(self.q_norm(self.q_proj(h).view(Q, self.nh, self.d)), qpos, self.theta)
        kb = rope(self.k_norm(self.k_proj(h).view(Q, self.kvh, self.d)), qpos, self.theta)
        kc = rope(self.k_norm(self.k_proj(ctx).view(C, self.kvh, self.d)), kpos, self.theta)
        k = torch.cat([kc, kb], 0)
        v = torch.cat([self.v_proj(ctx).view(C, self.kvh, self.d), self.v_proj(h).view(Q, self.kvh, self.d)], 0)
        g = self.nh // self.kvh
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask[None, None])
        x = x + self.o_proj(a[0].transpose(0, 1).reshape(Q, self.nh * self.d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Drafter(nn.Module):
    def __init__(self, c):
        super().__init__()
        n = len(c["dflash_config"]["target_layer_ids"])
        self.fc = nn.Linear(n * c["hidden_size"], c["hidden_size"], bias=False)
        self.hidden_norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, block_emb, feats, qpos, kpos, mask):
        ctx = self.hidden_norm(self.fc(feats))
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, qpos, kpos, mask)
        return self.norm(x)

    def state_for_checkpoint(self):
        out = {}
        for k, v in self.state_dict().items():
            k = k.replace(".q_proj", ".self_attn.q_proj").replace(".k_proj", ".self_attn.k_proj")
            k = k.replace(".v_proj", ".self_attn.v_proj").replace(".o_proj", ".self_attn.o_proj")
            k = k.replace(".q_norm", ".self_attn.q_norm").replace(".k_norm", ".self_attn.k_norm")
            k = k.replace(".gate_proj", ".mlp.gate_proj").replace(".up_proj", ".mlp.up_proj").replace(".down_proj", ".mlp.down_proj")
            out[k] = v.detach().to(torch.bfloat16).contiguous().cpu()
        return out


def prompts(rng, n):
    """(prompt text, max new tokens) from the corpus generators: the target's own tasks."""
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            p = corpus.arithmetic_problem(rng)
            out.append((corpus.render_chat(corpus.arithmetic_messages(p)[:1], add_generation_prompt=True), 96))
        elif kind < 0.75:
            msgs = corpus.chat_messages(rng)
            out.append((corpus.render_chat(msgs[:-1], add_generation_prompt=True), 64))
        else:
            text = corpus.prose_text(rng, 1)
            out.append((text[: rng.randint(80, 400)], 128))
    return out


@torch.no_grad()
def target_sequences(target, tok, items, device, batch=128):
    """The target's greedy continuations: token lists of prompt + response, and prompt lengths."""
    seqs = []
    tok.padding_side = "left"
    for i in range(0, len(items), batch):
        chunk = items[i:i + batch]
        enc = tok([t for t, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        new = max(m for _, m in chunk)
        out = target.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
        width = enc["attention_mask"].shape[1]
        for r in range(len(chunk)):
            plen = int(enc["attention_mask"][r].sum().item())
            ids = out[r].tolist()[width - plen:]
            while len(ids) > plen and ids[-1] == tok.pad_token_id:
                ids.pop()
            if len(ids) > plen + 4:
                seqs.append((ids, plen))
    return seqs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=os.path.join(HERE, "..", "models", "kvlm-tiny"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--target-layers", default="1,3,5")
    ap.add_argument("--prompts", type=int, default=6000)
    ap.add_argument("--anchors", type=int, default=48, help="anchors per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    ap.add_argument("--gamma", type=float, default=4.0)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--init", help="a drafter directory to continue training from")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = "cuda"
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.target)
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    target = AutoModelForCausalLM.from_pretrained(args.target, torch_dtype=torch.bfloat16).to(device).eval()
    tc = target.config
    mask_id = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [int(x) for x in args.target_layers.split(",")]
    rope_theta = getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"]
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": tc.hidden_size,
           "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
           "num_attention_heads": tc.num_attention_heads, "num_key_value_heads": tc.num_key_value_heads,
           "head_dim": tc.head_dim, "vocab_size": tc.vocab_size, "max_position_embeddings": tc.max_position_embeddings,
           "rms_norm_eps": tc.rms_norm_eps, "rope_theta": rope_theta, "hidden_act": "silu", "attention_bias": False,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "block_size": args.block,
           "num_target_layers": tc.num_hidden_layers,
           "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": ids}}
    items = prompts(rng, args.prompts)
    seqs = target_sequences(target, tok, items, device)
    held = seqs[: len(seqs) // 20]
    train = seqs[len(seqs) // 20:]
    print(f"data: {len(seqs)} target continuations ({sum(len(s) for s, _ in seqs)} tokens) in {time.time() - t0:.0f} s",
          flush=True)

    drafter = Drafter(cfg).to(device)
    with torch.no_grad():
        for m in drafter.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
    prior_steps, prior_seconds = 0, 0.0
    if args.init:
        from safetensors.torch import load_file
        with open(os.path.join(args.init, "config.json")) as f:
            init_cfg = json.load(f)
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "block_size", "dflash_config"):
            if init_cfg.get(key) != cfg[key]:
                sys.exit(f"--init {args.init}: {key} is {init_cfg.get(key)}, this run's is {cfg[key]}")
        state = {k.replace(".self_attn", "").replace(".mlp", ""): v.float()
                 for k, v in load_file(os.path.join(args.init, "model.safetensors")).items()}
        drafter.load_state_dict(state)
        log_path = os.path.join(args.init, "train_log.json")
        if os.path.exists(log_path):
            with open(log_path) as f:
                prior = json.load(f)
            prior_steps, prior_seconds = prior.get("total_steps", prior["steps"]), prior.get("total_seconds", prior["seconds"])
        print(f"continuing from {args.init}", flush=True)
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.01)
    B = args.block
    slot_w = torch.tensor([0.0] + [math.exp(-(k - 1) / args.gamma) for k in range(1, B)], device=device)

    def batch_loss(seq, plen, n_anchors, train_mode=True):
        tokens = torch.tensor(seq, device=device)
        L = len(seq)
        with torch.no_grad():
            hs = target(tokens[None], output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1][0] for i in ids], -1).float()
        lo, hi = max(1, plen - 1), L - 2
        if hi < lo:
            return None
        anchors = sorted(rng.sample(range(lo, hi + 1), min(n_anchors, hi - lo + 1)))
        A = len(anchors)
        a = torch.tensor(anchors, device=device)
        off = torch.arange(B, device=device)
        qpos = (a[:, None] + off[None, :]).reshape(-1)
        btok = torch.full((A, B), mask_id, device=device)
        btok[:, 0] = tokens[a]
        labels = torch.where(qpos < L, tokens[qpos.clamp(max=L - 1)], torch.full_like(qpos, -100)).view(A, B)
        labels[:, 0] = -100
        # Block j sees context positions < a_j and its own block, nothing else.
        ctx_vis = torch.arange(L, device=device)[None, :] < a[:, None]            # [A, L]
        blk_vis = torch.eye(A, dtype=torch.bool, device=device)                    # [A, A]
        mask = torch.cat([ctx_vis[:, None, :].expand(A, B, L).reshape(A * B, L),
                          blk_vis[:, None, :, None].expand(A, B, A, B).reshape(A * B, A * B)], 1)
        x = drafter(embed[btok.reshape(-1)].float(), feats, qpos, torch.arange(L, device=device), mask)
        logits = (x @ head.float().T).view(A, B, -1)
        ce = F.cross_entropy(logits.reshape(A * B, -1), labels.reshape(-1), ignore_index=-100, reduction="none").view(A, B)
        valid = (labels >= 0).float()
        w = slot_w[None, :] * valid
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        # Acceptance proxy: the prefix of slots the drafter gets right, per anchor.
        right = (logits.argmax(-1) == labels) | (labels < 0)
        right[:, 0] = True
        accepted = right.int().cumprod(1).sum(1).float() - 1  # slots 1.. until the first miss
        return loss, accepted.mean().item()

    step, start = 0, time.time()
    while time.time() - start < args.seconds:
        lr = args.lr * min(1.0, (step + 1) / 100) * max(0.1, 1 - (time.time() - start) / args.seconds)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        opt.zero_grad(set_to_none=True)
        tot, acc, n = 0.0, 0.0, 0
        for s, plen in rng.sample(train, args.batch):
            r = batch_loss(s, plen, args.anchors)
            if r is None:
                continue
            (r[0] / args.batch).backward()
            tot += r[0].item()
            acc += r[1]
            n += 1
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"step {step} t={time.time() - start:.0f}s loss {tot / max(n, 1):.3f} accepted/anchor {acc / max(n, 1):.2f}",
                  flush=True)
        step += 1
    drafter.eval()
    with torch.no_grad():
        accs = [batch_loss(s, p, args.anchors)[1] for s, p in held[:200] if len(s) > p + 4]
    print(f"held-out: mean accepted draft tokens per anchor {sum(accs) / len(accs):.2f} of {B - 1} "
          f"(teacher-forced estimate; tau ~ 1 + this)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    save_file(drafter.state_for_checkpoint(), os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    log = {"steps": step, "seconds": time.time() - start, "sequences": len(seqs), "args": vars(args),
           "held_out_accepted_per_anchor": sum(accs) / len(accs),
           "total_steps": prior_steps + step, "total_seconds": prior_seconds + time.time() - start}
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=2)
    print(f"wrote {args.out} after {step} steps", flush=True)


if __name__ == "__main__":
    main()
