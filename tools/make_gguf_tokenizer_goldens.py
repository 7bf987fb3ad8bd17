#!/usr/bin/env python3
"""Small GGUF files that hold only a tokenizer, one per way kvlm builds a tokenizer from GGUF
metadata, and what Hugging Face transformers makes of each (`AutoTokenizer.from_pretrained(...,
gguf_file=...)`): tests/data/gguf/tokenizers/NAME.gguf and NAME.json
{"cases": [{"text", "ids", "plain", "decoded", "skip"}], "prompt": [...], "bos", "eos"}.

  spm-llama     SentencePiece vocabulary (tokenizer.ggml.model "llama") with scores and no
                merges: merges recovered from the scores, Metaspace, byte fallback, BOS added
  spm-gemma3    the same for architecture gemma3: all-space tokens respelled with U+2581,
                merges in file order, spaces normalized to U+2581, USER_DEFINED tokens
  bpe-qwen2     byte-level BPE ("gpt2") with merges and `tokenizer.ggml.pre` qwen2 (its split
                regex), a CONTROL token, a USER_DEFINED one and a token spelled outside the
                byte alphabet (respelled)
  bpe-default   byte-level BPE with a pre type transformers does not know (GPT-2's regex)
  bpe-llama3    byte-level BPE as Llama 3 files are (pre llama-bpe, no <|endoftext|> token:
                transformers' GPT2Tokenizer adds it with a new id past the vocabulary)
  spm-phi3      SentencePiece for architecture phi3 (the prefix space from a normalizer, no
                pre-tokenizer), with a token that has U+2581 after another character
  spm-nospecial SentencePiece whose <s> is a NORMAL token and which has no </s> or <unk>
                (LlamaTokenizer's defaults: special, the missing ones with new ids)

tests/unit/test_gguf_tokenizer.cpp checks kvlm against these.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers gguf numpy
    /tmp/hf/bin/python tools/make_gguf_tokenizer_goldens.py
"""
import json
import os

import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "gguf", "tokenizers")
SP = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

TEXTS = ["<|endoftext|>ab", "<s>ab</s><unk>", "<|begin_of_text|>c", "ab c", " ab", "abc abc", "cab", "A", "x y", "  a", "a\tb", "ba ab  ca", "", "hello world", "<s>ab</s>",
         "<think>ab</think>", "ab 123 4567", "a\u00e9b c", "don't stop", "abc\n\nab", "\u00e9\u00e9 ab", "<|im_start|>c"]


def spm_tokens(arch):
    toks = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    toks += [(f"<0x{b:02X}>", 0.0, BYTE) for b in (0x09, 0x0A, 0x41, 0xC3, 0xA9)]
    pieces = [SP, "a", "b", "c", SP + "a", "ab", SP + "ab", "bc", "abc", SP + "abc", SP + "c", "ca", SP + "b", "ba",
              SP + SP, "\u00e9"]
    # scores: shorter merges first for most, one out of order so that score order matters
    scores = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0, -10.0, -11.0, -12.0, -4.5, -13.0, -14.0, -15.0]
    toks += [(p, s, NORMAL) for p, s in zip(pieces, scores)]
    if arch == "phi3":
        toks += [("a" + SP, -3.5, NORMAL), ("b" + SP + "c", -16.0, NORMAL)]
    if arch == "gemma3":
        toks += [("  ", -16.0, USER_DEFINED), ("<think>", 0.0, USER_DEFINED), ("</think>", 0.0, USER_DEFINED),
                 ("<start_of_turn>", 0.0, CONTROL)]
    return toks


def write_spm(name, arch, nospecial=False):
    path = os.path.join(OUT, name + ".gguf")
    w = gguf.GGUFWriter(path, arch=arch)
    toks = spm_tokens(arch)
    if nospecial:  # <s> typed NORMAL; no </s>, no <unk>
        toks = [("<s>", 0.0, NORMAL) if t == "<s>" else (t, sc, k) for t, sc, k in toks if t not in ("</s>", "<unk>")]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _, _ in toks])
    w.add_token_scores([s for _, s, _ in toks])
    w.add_token_types([k for _, _, k in toks])
    if not nospecial:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_bpe(name, pre, llama3=False):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    bl = bytes_to_unicode()
    G = bl[ord(" ")]
    path = os.path.join(OUT, name + ".gguf")
    w = gguf.GGUFWriter(path, arch="qwen2")
    base = sorted(set(bl.values()))
    merges = [("a", "b"), (G, "a"), (G + "a", "b"), ("c", "a"), ("1", "2"), ("3", "4"), ("12", "3"), (G, "c"),
              ("d", "o"), ("n", "'"), ("o", "n"), ("do", "n"), (bl[0xC3], bl[0xA9])]
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<think>", "</think>"] if llama3 else \
        ["<|endoftext|>", "<|im_start|>", "<think>", "</think>"]
    toks = specials + base
    for a, b in merges:
        if a + b not in toks:
            toks.append(a + b)
    toks.append("a b")  # written with a real space: outside the byte alphabet, respelled
    types = [CONTROL, CONTROL, USER_DEFINED, USER_DEFINED] + [NORMAL] * (len(toks) - 4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main():
    from transformers import AutoTokenizer
    os.makedirs(OUT, exist_ok=True)
    files = {"spm-llama": write_spm("spm-llama", "llama"), "spm-gemma3": write_spm("spm-gemma3", "gemma3"),
             "bpe-qwen2": write_bpe("bpe-qwen2", "qwen2"), "bpe-default": write_bpe("bpe-default", "some-new-pre"),
             "bpe-llama3": write_bpe("bpe-llama3", "llama-bpe", llama3=True),
             "spm-nospecial": write_spm("spm-nospecial", "llama", nospecial=True),
             "spm-phi3": write_spm("spm-phi3", "phi3")}
    for name, path in files.items():
        tok = AutoTokenizer.from_pretrained(OUT, gguf_file=os.path.basename(path))
        bt = tok.backend_tokenizer
        cases = []
        for t in TEXTS:
            bt.encode_special_tokens = False
            ids = bt.encode(t).ids
            bt.encode_special_tokens = True
            plain = bt.encode(t).ids
            bt.encode_special_tokens = False
            cases.append({"text": t, "ids": ids, "plain": plain, "decoded": bt.decode(ids, skip_special_tokens=False),
                          "skip": bt.decode(ids, skip_special_tokens=True), "prompt": tok(t).input_ids})
        with open(os.path.join(OUT, name + ".json"), "w", encoding="utf-8") as f:
            json.dump({"cases": cases, "bos": tok.bos_token, "eos": tok.eos_token}, f, ensure_ascii=False, indent=0)
        print(name, [c["ids"] for c in cases[:6]])


if __name__ == "__main__":
    main()
