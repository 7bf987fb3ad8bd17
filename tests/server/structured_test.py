"""Structured outputs end to end, with the official `openai` client and `jsonschema`: 200
schema-constrained completions sampled at temperature 1 from the bundled model, every one of
which must parse and validate; regex, choice and GBNF constraints; streaming; the errors a
bad constraint gets; and unconstrained requests running beside constrained ones unchanged.

usage: python structured_test.py KVLM_BINARY MODEL_DIR
"""
import json
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serverlib import Server  # noqa: E402

KVLM, MODEL = sys.argv[1], sys.argv[2]

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "[a-z0-9.]{1,12}@[a-z]{1,10}\\.(com|org|net)"},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    "inventory": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
                        "count": {"type": "integer", "minimum": -5, "maximum": 999},
                        "color": {"enum": ["red", "green", "blue", None]},
                    },
                    "required": ["sku", "count"],
                },
            },
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["items"],
    },
    "tree": {
        "$defs": {
            "leaf": {"type": "object", "properties": {"label": {"const": "leaf"}, "w": {"type": "integer", "minimum": 1}},
                     "required": ["label"]},
            "node": {
                "type": "object",
                "properties": {
                    "label": {"const": "n"},
                    "kids": {"type": "array", "maxItems": 2, "items": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]}},
                },
                "required": ["label"],
            },
        },
        "anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}],
    },
    "event": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "day": {"type": "string", "format": "date"},
            "score": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "temp": {"type": "number", "minimum": -40.5, "maximum": 50},
            "addr": {"type": "string", "format": "ipv6"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["id", "day", "score"],
    },
}
PER_SCHEMA = 50
MAX_TOKENS = 1500

srv = Server(KVLM, MODEL, "--max-num-seqs", "16", "--served-model-name", "tiny")
client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=600)
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def one(args):
    name, i = args
    schema = SCHEMAS[name]
    if i % 2 == 0:  # chat with response_format, as OpenAI's clients send it
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Write a {name} as JSON."}], temperature=1.0,
            max_tokens=MAX_TOKENS, seed=1000 + i,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    else:  # completions with vLLM's field
        r = client.completions.create(model="tiny", prompt=f"A {name}:", temperature=1.0, max_tokens=MAX_TOKENS,
                                      seed=2000 + i, extra_body={"structured_outputs": {"json": schema}})
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        return name, reason, None, r.usage.completion_tokens
    except (ValueError, jsonschema.ValidationError) as e:
        return name, reason, f"{type(e).__name__}: {str(e)[:200]} in {text[:300]!r}", r.usage.completion_tokens


# --- 200 schema-constrained completions, random sampling, 16 at a time --------------------
work = [(name, i) for name in SCHEMAS for i in range(PER_SCHEMA)]
with ThreadPoolExecutor(16) as pool:
    results = list(pool.map(one, work))
valid = sum(1 for _, reason, err, _ in results if err is None and reason == "stop")
tokens = sum(t for *_, t in results)
for name, reason, err, _ in results:
    check(err is None, f"{name}: invalid output: {err}")
    check(reason == "stop", f"{name}: finish_reason {reason} (max_tokens {MAX_TOKENS} cut it)")
print(f"schema-constrained completions: {valid}/{len(results)} valid, {tokens} tokens", flush=True)

# --- regex, choice, grammar ----------------------------------------------------------------
for seed in range(20):
    r = client.completions.create(model="tiny", prompt="Code:", temperature=1.0, max_tokens=40, seed=seed,
                                  extra_body={"guided_regex": r"[A-Z]{2}-\d{2,4}( ok| fail)?"})
    t = r.choices[0].text
    check(re.fullmatch(r"[A-Z]{2}-\d{2,4}( ok| fail)?", t) is not None, f"guided_regex gave {t!r}")
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Pick one."}], temperature=1.0,
                                       max_tokens=10, seed=seed, extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    t = r.choices[0].message.content
    check(t in ("alpha", "beta", "gamma delta"), f"guided_choice gave {t!r}")
    r = client.completions.create(model="tiny", prompt="Sum:", temperature=1.0, max_tokens=60, seed=seed,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= num (" + " num){1,3} " = ?"\n'
                                                                                'num ::= [1-9] [0-9]?\n'}})
    t = r.choices[0].text
    check(re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){1,3} = \?", t) is not None, f"grammar gave {t!r}")
print("regex / choice / grammar: checked", flush=True)

# --- streaming: the deltas concatenate to valid JSON ---------------------------------------
stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}], stream=True,
                                        temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                                        response_format={"type": "json_schema",
                                                         "json_schema": {"name": "p", "schema": SCHEMAS["person"]}})
text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
jsonschema.validate(json.loads(text), SCHEMAS["person"])
# json_object bounds nothing: a string may run until max_tokens. What finishes is an object.
for seed in range(10):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "an object"}], temperature=1.0,
                                       seed=seed, max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        check(isinstance(json.loads(r.choices[0].message.content), dict), "json_object: not an object")

# --- unconstrained requests beside constrained ones are unchanged --------------------------
plain = dict(model="tiny", prompt="12+35=", temperature=0, max_tokens=12)
alone = client.completions.create(**plain).choices[0].text
with ThreadPoolExecutor(8) as pool:
    futs = [pool.submit(one, ("person", 100 + i)) for i in range(6)]
    beside = [pool.submit(lambda: client.completions.create(**plain).choices[0].text) for _ in range(4)]
    check(all(f.result() == alone for f in beside), "an unconstrained request changed beside constrained ones")
    check(all(f.result()[2] is None for f in futs), "constrained requests failed beside unconstrained ones")

# --- bad constraints are 400s naming the field ---------------------------------------------
for body, param in [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_json": {"type": "number", "multipleOf": 0.5}}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= root \"a\""}}, "structured_outputs.grammar"),
    ({"guided_regex": "b", "guided_choice": ["a"]}, "guided_choice"),
]:
    status, text = srv.post("/v1/completions", {"prompt": "x", "max_tokens": 5, **body})
    check(status == 400 and json.loads(text)["error"]["param"] == param, f"{body} -> {status} {text[:200]}")
try:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}})
    check(False, "a schema with 'not' was accepted")
except openai.BadRequestError as e:
    check("not" in str(e), f"the error does not name the keyword: {e}")

srv.stop()
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
