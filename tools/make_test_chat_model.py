#!/usr/bin/env python3
"""A tiny random-weight chat model with a genuine byte-level BPE tokenizer, for CLI and
server tests that need text in and text out (tests/models/tiny-chat).

- tokenizer: byte-level BPE trained with Hugging Face `tokenizers` on the tokenizer test
  corpus (tests/data/tokenizers/corpus.json), 1024 tokens, with Qwen2's pre-tokenizer
  regex and NFC, and the special tokens <|endoftext|>, <|im_start|>, <|im_end|>;
- chat template: Qwen2.5-7B-Instruct's (tests/data/chat-templates), ChatML;
- model: Qwen3ForCausalLM, hidden 64, 2 layers, 4 q / 2 kv heads, head_dim 32, bf16,
  random weights from a fixed seed (its text is gibberish: it exists to exercise the
  plumbing; the project's trained model is issue 6's).

usage: python3 tools/make_test_chat_model.py  (needs tokenizers, torch, safetensors)
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(REPO, "tests", "models", "tiny-chat")


def main():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers, Regex

    corpus = json.load(open(os.path.join(REPO, "tests", "data", "tokenizers", "corpus.json")))
    texts = [c["text"] for c in corpus if "text" in c]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    pattern = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in specials}

    template = open(os.path.join(REPO, "tests", "data", "chat-templates", "Qwen-Qwen2.5-7B-Instruct.jinja")).read()
    json.dump({"add_bos_token": False, "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "chat_template": template, "model_max_length": 2048, "tokenizer_class": "Qwen2Tokenizer"},
              open(os.path.join(OUT, "tokenizer_config.json"), "w"), indent=2)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "vocab_size": vocab, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "rope_scaling": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
              "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    json.dump(config, open(os.path.join(OUT, "config.json"), "w"), indent=2)
    json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": False},
              open(os.path.join(OUT, "generation_config.json"), "w"), indent=2)

    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    h, inter, d = 64, 128, 32

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(vocab, h, std=0.5), "model.norm.weight": (1 + rnd(h, std=0.1).float()).bfloat16()}
    for i in range(2):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + rnd(h, std=0.1).float()).bfloat16()
        w[p + "post_attention_layernorm.weight"] = (1 + rnd(h, std=0.1).float()).bfloat16()
        w[p + "self_attn.q_proj.weight"] = rnd(4 * d, h, std=h ** -0.5)
        w[p + "self_attn.k_proj.weight"] = rnd(2 * d, h, std=h ** -0.5)
        w[p + "self_attn.v_proj.weight"] = rnd(2 * d, h, std=h ** -0.5)
        w[p + "self_attn.o_proj.weight"] = rnd(h, 4 * d, std=(4 * d) ** -0.5)
        w[p + "self_attn.q_norm.weight"] = (1 + rnd(d, std=0.1).float()).bfloat16()
        w[p + "self_attn.k_norm.weight"] = (1 + rnd(d, std=0.1).float()).bfloat16()
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h, std=h ** -0.5)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h, std=h ** -0.5)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter, std=inter ** -0.5)
    save_file(w, os.path.join(OUT, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, "README.md"), "w") as f:
        f.write("# tiny-chat (test model)\n\nA random-weight Qwen3-architecture model (hidden 64, 2 layers, vocab "
                f"{vocab}) with a byte-level BPE tokenizer trained on kvlm's tokenizer test corpus and Qwen2.5's "
                "chat template, made by `tools/make_test_chat_model.py`. Its output is gibberish by design: it "
                "exists so CLI and server tests can run text in, text out on the CPU in seconds.\n")
    print("wrote", OUT, "vocab", vocab, ids)


if __name__ == "__main__":
    main()
