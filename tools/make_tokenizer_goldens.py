#!/usr/bin/env python3
"""Reference token ids from Hugging Face `tokenizers` for kvlm's tokenizer tests.

Builds a deterministic corpus of several thousand strings (ASCII prose and code,
whitespace runs, digits, CJK, emoji, combining marks, other scripts, special-token
strings, invalid UTF-8 byte strings, long mixed texts) and, for every tokenizer.json under
../shared/data/tokenizers, writes what the Rust `tokenizers` library returns:

  tests/data/tokenizers/corpus.json             [{"text": str} | {"hex": bytes-as-hex}, ...]
  tests/data/tokenizers/expected/NAME.json      {"tokenizers_version", "cases": [
        {"ids": [...], "decoded": str (decode(ids), only when it differs from the input
         text), "plain": [...] (only when encode_special_tokens changes the ids),
         "skip": str (decode with skip_special_tokens, only when it differs from decoded)}]}

Invalid UTF-8 byte strings are decoded with errors="replace" first (the Python API takes
str), which kvlm's encoder must reproduce from the raw bytes.

usage: python3 tools/make_tokenizer_goldens.py [--shared ../shared] [--check] [--bench FILE]
  --check   regenerate in memory and compare with the committed files (exit 1 on any
            difference): the live check CI runs when PyPI is reachable.
  --bench   also time encoding of a 1 MB text (single thread) and print MB/s per tokenizer.
"""
import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(REPO, "tests", "data", "tokenizers")
NAMES = ["qwen3", "qwen2-base", "phi3-mini"]

WORDS = ("the of and to in is was for on are with as I his they be at one have this from or had by hot word but what "
         "some we can out other were all there when up use your how said an each she which do their time if will way "
         "about many then them write would like so these her long make thing see him two has look more day could go "
         "come did number sound no most people my over know water than call first who may down side been now find "
         "any new work part take get place made live where after back little only round man year came show every good "
         "me give our under name very through just form sentence great think say help low line differ turn cause much "
         "mean before move right boy old too same tell does set three want air well also play small end put home read "
         "hand port large spell add even land here must big high such follow act why ask men change went light kind "
         "off need house picture try us again animal point mother world near build self earth father head stand own "
         "page should country found answer school grow study still learn plant cover food sun four between state keep "
         "eye never last let thought city tree cross farm hard start might story saw far sea draw left late run don't "
         "while press close night real life few north it's you're we've I'm they'll she'd HELLO World Python kvlm").split()
CODE_IDS = ["x", "i", "count", "buffer_size", "kvCache", "HTTPServer", "parse_json", "__init__", "self", "ptr", "std::vector",
            "numpy", "np", "tensor", "dtype", "float32", "main", "args", "kwargs", "result", "err", "ctx", "TODO_item"]
CJK = "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出而要于就下得可你年生自会那后能对着事其里所去行过家十用发天如然作方成者多日都三小军二无同么经法当起与好看学进种将还分此心前面又定见只主没公从"
JAPANESE = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソ日本語東京"
KOREAN = "가나다라마바사아자차카타파하한국어서울대학교입니다습니다"
EMOJI = ["🦙", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "❤️", "🧑‍💻", "✨", "🔥", "🙂", "🏳️‍🌈", "👋🏿", "🤖", "🐍", "⭐"]
SCRIPTS = ["Привет, как дела? Всё хорошо.", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
           "Xin chào thế giới", "Ελληνικά γράμματα", "Здравствуй, мир!", "ሰላም ልዑል", "გამარჯობა", "Բարեւ"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>",
            "<|system|>", "<think>", "</think>", "<|vision_start|>", "<tool_call>", "<|fim_prefix|>"]
WS = [" ", "  ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2009", "\u200b", "   \t", "\n\t\t", "\x0b", "\x0c",
      "\u2028", "\u0085"]


def corpus():
    r = random.Random(1234)
    out = []

    def sentence(n=None):
        n = n or r.randint(3, 18)
        w = [r.choice(WORDS) for _ in range(n)]
        if r.random() < 0.5:
            w[0] = w[0].capitalize()
        s = " ".join(w)
        return s + r.choice([".", "!", "?", ",", ";", ":", "", "...", " -", "'s", "'S"])

    for _ in range(600):  # prose and contractions
        out.append({"text": " ".join(sentence() for _ in range(r.randint(1, 3)))})
    for _ in range(400):  # code
        ind = r.choice(["", "    ", "\t", "  ", "        "])
        a, b = r.choice(CODE_IDS), r.choice(CODE_IDS)
        lines = r.choice([
            f"def {a}({b}, n=3):\n{ind}return {b}[n:] + [{r.randint(0, 999)}]\n",
            f"for (int i = 0; i < {r.randint(1, 10**6)}; ++i) {{\n{ind}{a}[i] = {b}->get(i) * 2.5f;\n}}",
            f'{{"{a}": [{r.randint(0, 99)}, {r.random():.4f}, null, true], "{b}": "x\\ny"}}',
            f"$ ./build/kvlm generate --model {a}/ --max-tokens {r.randint(1, 512)} 2>&1 | grep -v '{b}'",
            f"const {a} = async ({b}) => await fetch(`/v1/{b}?q=${{{a}}}`);",
            f"#include <{b}.h>\n#define {a.upper()}_MAX 0x{r.randint(0, 2**32):08X}\n",
            f"SELECT {a}, COUNT(*) FROM {b} WHERE id >= {r.randint(0, 10**5)} GROUP BY {a};",
        ])
        out.append({"text": lines})
    for _ in range(300):  # whitespace runs
        parts = []
        for _ in range(r.randint(1, 6)):
            parts.append(r.choice(WS) * r.randint(1, 4))
            if r.random() < 0.7:
                parts.append(r.choice(WORDS))
        out.append({"text": "".join(parts)})
    for _ in range(300):  # digits
        kind = r.randint(0, 6)
        if kind == 0:
            t = str(r.randint(0, 10 ** r.randint(1, 30)))
        elif kind == 1:
            t = f"{r.uniform(-1e6, 1e6):.{r.randint(0, 8)}f}"
        elif kind == 2:
            t = f"{r.randint(1900, 2100)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d} {r.randint(0, 23)}:{r.randint(0, 59):02d}"
        elif kind == 3:
            t = f"w{r.randint(0, 999):03d} {r.randint(0, 9)}tuijk v{r.randint(1, 9)}.{r.randint(0, 99)}.{r.randint(0, 9)}"
        elif kind == 4:
            t = "".join(chr(0xFF10 + int(c)) for c in str(r.randint(0, 10**6)))  # fullwidth digits
        elif kind == 5:
            t = "".join(chr(0x0660 + int(c)) for c in str(r.randint(0, 10**6))) + " ٣ ³ ½ Ⅻ"
        else:
            t = f"{r.randint(0, 999)}+{r.randint(0, 999)}={r.randint(0, 2000)}, 1e-{r.randint(1, 30)}, 0b{r.randint(0, 255):b}"
        out.append({"text": t})
    for _ in range(300):  # CJK
        src = r.choice([CJK, JAPANESE, KOREAN])
        t = "".join(r.choice(src) for _ in range(r.randint(1, 40)))
        if r.random() < 0.4:
            t += r.choice(["。", "、", "！", "？", " ", "，", "（注）", " and English"])
        out.append({"text": t})
    for _ in range(200):  # emoji
        t = "".join(r.choice(EMOJI) + (r.choice(WORDS) + " " if r.random() < 0.5 else "") for _ in range(r.randint(1, 6)))
        out.append({"text": t})
    for _ in range(200):  # combining marks, NFC/NFD
        base = r.choice("aeiouAEIOUnsczy")
        marks = "".join(chr(r.choice([0x0301, 0x0300, 0x0302, 0x0303, 0x0308, 0x030C, 0x0327, 0x0323])) for _ in range(r.randint(1, 3)))
        t = f"{r.choice(WORDS)} {base}{marks}{r.choice(WORDS)} é e\u0301 Å A\u030a \u1100\u1161\u11a8 ñ n\u0303"
        out.append({"text": t[: r.randint(5, len(t))]})
    for _ in range(200):  # other scripts
        out.append({"text": r.choice(SCRIPTS) + (" " + sentence() if r.random() < 0.3 else "")})
    for _ in range(200):  # special-token strings in text
        a = r.choice(SPECIALS)
        t = r.choice([f"{a}user\nhello{r.choice(SPECIALS)}", f"x {a} y", f"{a}{a}", f"  {a}\n\n{sentence()}", f"<{a}>",
                      f"{a[:-1]}", f"text{a}text", f"{sentence()} {a}"])
        out.append({"text": t})
    for _ in range(150):  # invalid UTF-8
        good = sentence(4).encode()
        bad = r.choice([b"\x80", b"\xff", b"\xc3", b"\xe2\x82", b"\xf0\x9f\xa6", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf5\x80\x80\x80",
                        bytes([r.randint(0x80, 0xff) for _ in range(r.randint(1, 5))]), b"\xe0\x80\x80", b"\xf4\x90\x80\x80"])
        pos = r.randint(0, len(good))
        out.append({"hex": (good[:pos] + bad + good[pos:]).hex()})
    for _ in range(30):  # long mixed texts
        t = ""
        while len(t) < r.randint(1000, 4000):
            t += r.choice([sentence(), "\n\n", "    " + r.choice(CODE_IDS) + "()\n", r.choice(SCRIPTS), r.choice(EMOJI),
                           "".join(r.choice(CJK) for _ in range(10)), str(r.randint(0, 10**9)), r.choice(SPECIALS)])
        out.append({"text": t})
    out += [{"text": s} for s in ["", " ", "  ", "a", "\n", "'s", "'S", "don't", "I'M", "   leading", "trailing   ", "\u200b"]]
    return out


def text_of(case):
    return bytes.fromhex(case["hex"]).decode("utf-8", errors="replace") if "hex" in case else case["text"]


def expected(tok, cases):
    from tokenizers import Tokenizer  # noqa
    res = []
    for c in cases:
        s = text_of(c)
        tok.encode_special_tokens = False
        ids = tok.encode(s).ids
        tok.encode_special_tokens = True
        plain = tok.encode(s).ids
        tok.encode_special_tokens = False
        e = {"ids": ids}
        decoded = tok.decode(ids, skip_special_tokens=False)
        if decoded != s:
            e["decoded"] = decoded
        if plain != ids:
            e["plain"] = plain
        skip = tok.decode(ids, skip_special_tokens=True)
        if skip != decoded:
            e["skip"] = skip
        res.append(e)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(REPO, "..", "shared"))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", metavar="FILE")
    args = ap.parse_args()
    import tokenizers
    from tokenizers import Tokenizer

    cases = corpus()
    files = {"corpus.json": cases}
    for name in NAMES:
        tok = Tokenizer.from_file(os.path.join(args.shared, "data", "tokenizers", name, "tokenizer.json"))
        files[os.path.join("expected", name + ".json")] = {"tokenizer": name, "tokenizers_version": tokenizers.__version__,
                                                            "cases": expected(tok, cases)}
    bad = 0
    for rel, data in files.items():
        path = os.path.join(OUT, rel)
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        if args.check:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            same = old == data if rel == "corpus.json" else old["cases"] == data["cases"]
            print(("same   " if same else "DIFFERS"), rel)
            bad += not same
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            print("wrote", path, len(text), "bytes")
    print(f"{len(cases)} strings, tokenizers {tokenizers.__version__}")
    if args.bench:
        with open(args.bench, encoding="utf-8", newline="") as f:
            text = f.read()
        for name in NAMES:
            tok = Tokenizer.from_file(os.path.join(args.shared, "data", "tokenizers", name, "tokenizer.json"))
            tok.encode(text[:1000])
            best = 1e9
            for _ in range(3):
                t0 = time.perf_counter()
                tok.encode(text)
                best = min(best, time.perf_counter() - t0)
            print(f"bench {name}: HF tokenizers {len(text.encode()) / best / 1e6:.2f} MB/s ({len(text.encode())} bytes, best of 3)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
