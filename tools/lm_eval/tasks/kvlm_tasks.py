"""Loaders, prompts and answer extraction for the kvlm lm-eval tasks (see ../README.md).

The data are the bundled model's JSONL task files (models/kvlm-tiny/eval/*.jsonl): one object
per line with "prompt" (an already rendered ChatML prompt), "answer" and "regex". Scoring
follows `kvlm eval task`: the first match of the item's regex in the completion, capture
group 1 if the regex has one (else the whole match), stripped, must equal the stripped answer.
"""
import hashlib
import json
import os
import re

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_DEFAULT_DATA_DIR = os.path.join(_ROOT, "models", "kvlm-tiny", "eval")
_CHATML_USER = re.compile(r"^<\|im_start\|>user\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n$", re.S)
_INVALID = "[invalid]"


def load(file=None, kvlm_data_dir=None, **_):
    """custom_dataset: {"test": Dataset} from <data dir>/<file>.

    The data dir is --metadata kvlm_data_dir=..., else $KVLM_LM_EVAL_DATA_DIR, else the
    repository's models/kvlm-tiny/eval."""
    import datasets
    import pyarrow

    data_dir = kvlm_data_dir or os.environ.get("KVLM_LM_EVAL_DATA_DIR") or _DEFAULT_DATA_DIR
    path = os.path.join(data_dir, file)
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in ("prompt", "answer") if k not in row]
            if missing:
                raise ValueError(f"{path}:{n}: missing field(s) {missing}")
            rows.append({"prompt": row["prompt"], "answer": str(row["answer"]), "regex": row.get("regex") or ""})
    if not rows:
        raise ValueError(f"{path}: no items")
    # An explicit fingerprint (the file's hash): Dataset.from_list would hash the Arrow table
    # with dill, which fails on Python 3.12 with datasets 5.2 / dill 0.4.1 / pyarrow 26
    # ("Can't pickle <class 'MonthDayNano'>").
    with open(path, "rb") as f:
        fingerprint = hashlib.sha256(f.read()).hexdigest()[:32]
    return {"test": datasets.Dataset(pyarrow.Table.from_pylist(rows), split="test", fingerprint=fingerprint)}


def target(doc):
    return doc["answer"].strip()


def chat_user_text(doc):
    """The user turn of the rendered ChatML prompt, for /v1/chat/completions (the server
    renders it again with the model's chat template)."""
    m = _CHATML_USER.match(doc["prompt"])
    if not m:
        raise ValueError("prompt is not a single ChatML user turn followed by the assistant header: "
                         + doc["prompt"][:200])
    return m.group(1)


def _extract(text, regex):
    if not isinstance(text, str):
        return _INVALID
    if not regex:
        return text.strip()
    m = re.search(regex, text)
    if not m:
        return _INVALID
    if m.re.groups >= 1 and m.group(1) is not None:
        return m.group(1).strip()
    return m.group(0).strip()


def extract_answers(resps, docs):
    """custom filter: each response -> the item's regex answer (or "[invalid]")."""
    return [[_extract(r, doc["regex"]) for r in rs] for rs, doc in zip(resps, docs)]
