"""The model's tokenizer: byte-level BPE trained with Hugging Face `tokenizers` on the corpus.

Pipeline (the shape of Qwen2/Qwen3's tokenizer.json, which kvlm's C++ tokenizer reads):
NFC normalizer; pre-tokenizer = Split on Qwen2's regex (so every digit is its own token,
which keeps arithmetic learnable) then ByteLevel without its own regex; BPE over the
GPT-2 byte alphabet; ByteLevel decoder. Special tokens <|endoftext|>, <|im_start|>,
<|im_end|> take ids 0, 1, 2.
"""
from __future__ import annotations

import json
import os

from corpus import CHAT_TEMPLATE, EOT, IM_END, SPECIAL_TOKENS

PRETOKENIZER_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Trains and returns a `tokenizers.Tokenizer` (deterministic for the same texts)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZER_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise RuntimeError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def write_tokenizer_files(tok, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json (ChatML template inline, no BOS)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": EOT,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {"content": s, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for s in SPECIAL_TOKENS},
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
