#!/usr/bin/env python3
"""Renders the chat templates in tests/data/chat-templates/ with Python's jinja2, exactly as
transformers' apply_chat_template renders them, and writes the expected outputs that
tests/golden/test_chat_templates.cpp compares kvlm against byte for byte.

    python3 -m venv /tmp/jvenv && /tmp/jvenv/bin/pip install jinja2
    /tmp/jvenv/bin/python tools/make_template_goldens.py            # writes expected/*.json
    /tmp/jvenv/bin/python tools/make_template_goldens.py --check    # compares, writes nothing

The environment is transformers' (_compile_jinja_template in transformers 4.4x-4.5x,
chat_template_utils.py in 5.x): ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[AssistantTracker, loopcontrols]), tojson replaced by
json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys),
and the globals raise_exception and strftime_now. strftime_now formats a fixed time (NOW)
instead of the clock, so that templates printing today's date are reproducible; the C++ test
passes the same time through ChatTemplateRenderOptions::now.

Each context is what apply_chat_template passes to render(): messages, tools (None when
there are none), documents, add_generation_prompt, the tokenizer's special tokens, plus any
extra template variables; a few cases use a bare context without tools/documents.

Output: expected/<template>.json = {"template", "jinja2_version", "now", "cases": [{"name",
"context", "expected"} or {"name", "context", "error", "error_type"}]}.
"""
import argparse
import copy
import datetime
import json
import pathlib
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "chat-templates"
NOW = datetime.datetime(2024, 7, 26, 10, 30, 0)


class AssistantTracker(jinja2.ext.Extension):
    """transformers' {% generation %} tag; without assistant-mask tracking it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return NOW.strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# --- the templates and their tokenizers' special tokens -------------------------------------

QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MISTRAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GPT_OSS_TOKENS = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}

TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": (QWEN_TOKENS, "qwen2.5"),
    "Qwen-Qwen2.5-0.5B-Instruct.jinja": (QWEN_TOKENS, "qwen2.5"),
    "Qwen-Qwen3-0.6B.jinja": (QWEN_TOKENS, "qwen3"),
    "Qwen-Qwen3-tokenizer_config.jinja": (QWEN_TOKENS, "qwen3"),
    "meta-llama-Llama-3.1-8B-Instruct.jinja": (LLAMA3_TOKENS, "llama3.1"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": (LLAMA3_TOKENS, "llama3.2"),
    "microsoft-Phi-3-mini.jinja": (
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>", "pad_token": "<|endoftext|>"},
        "plain",
    ),
    "mistralai-Mistral-7B-Instruct.jinja": (MISTRAL_TOKENS, "mistral-v1"),
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja": (MISTRAL_TOKENS, "mistral-small"),
    "openai-gpt-oss-120b.jinja": (GPT_OSS_TOKENS, "gpt-oss"),
    "TinyLlama-TinyLlama-1.1B-Chat-v1.0.jinja": (
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>"},
        "plain",
    ),
}

# --- conversations ---------------------------------------------------------------------------

SYS = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "Hello, how are you?"}
A1 = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
U2 = {"role": "user", "content": "What is the capital of France?"}
A2 = {"role": "assistant", "content": "The capital of France is Paris."}
U3 = {"role": "user", "content": "And of Germany?"}
UNICODE = (
    "Héllo wörld — ünïcödé ✓ 中文 日本語 한국어 עברית العربية 😀👍🏽 ÀÉÎÕÜ ß ΣΊΣΥΦΟΣ "
    "\u00a0nbsp\u200bzwsp e\u0301 \u2028sep \U0001f9ea"
)
TRICKY = (
    "{{ not a tag }} {% neither %} {# nor #} \"quotes\" 'apostrophes' back\\slash \\n "
    "<|im_end|> [INST] </s> <think>fake</think> {\"json\": [1, 2]}"
)
MULTILINE = "Line 1\nLine 2\n\n    indented line 4\r\nwindows line\ttab\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search_web",
        "description": "Recherche sur le web — résultats «frais» 🔎",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Text with \"quotes\", a \\ and a\nnewline"},
                "max_results": {"type": "integer", "default": 5, "minimum": 1, "maximum": 20.5},
                "temperature": {"type": "number", "default": 1.0, "epsilon": 1e-05, "big": 12345678901234},
                "safe": {"type": "boolean", "default": True},
                "filters": {"type": "array", "items": {"type": "string"}, "default": []},
                "options": {"type": "object", "properties": {}, "nullable": None},
            },
            "required": ["query"],
        },
        "return": {"type": "string"},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]
U_WEATHER = {"role": "user", "content": "What's the weather like in Paris today?"}
CALL = {
    "id": "call_abc123xyz",
    "type": "function",
    "function": {"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}},
}
CALL2 = {
    "id": "call_def456uvw",
    "type": "function",
    "function": {"name": "search_web", "arguments": {"query": "Paris événements", "max_results": 3, "safe": False}},
}
A_CALL = {"role": "assistant", "content": "", "tool_calls": [CALL]}
A_CALL_NONE = {"role": "assistant", "content": None, "tool_calls": [CALL]}
A_CALL_TEXT = {"role": "assistant", "content": "Let me check that for you.", "tool_calls": [CALL]}
A_CALLS2 = {"role": "assistant", "content": "", "tool_calls": [CALL, CALL2]}
TOOL_RESULT = {
    "role": "tool",
    "tool_call_id": "call_abc123xyz",
    "name": "get_current_weather",
    "content": "{\"temperature\": 22, \"unit\": \"celsius\", \"condition\": \"sunny\"}",
}
TOOL_RESULT2 = {
    "role": "tool",
    "tool_call_id": "call_def456uvw",
    "name": "search_web",
    "content": "Fête de la musique — 21 juin",
}
A_FINAL = {"role": "assistant", "content": "It is 22 °C and sunny in Paris."}


def msgs(*ms):
    return copy.deepcopy(list(ms))


def generic_cases():
    c = [
        ("single_user_generation_prompt", msgs(U1), {"add_generation_prompt": True}),
        ("single_user_no_generation_prompt", msgs(U1), {}),
        ("system_and_user", msgs(SYS, U1), {"add_generation_prompt": True}),
        ("multi_turn", msgs(U1, A1, U2), {"add_generation_prompt": True}),
        ("multi_turn_with_system_ending_with_assistant", msgs(SYS, U1, A1, U2, A2), {}),
        ("long_conversation", msgs(SYS, U1, A1, U2, A2, U3), {"add_generation_prompt": True}),
        ("generation_prompt_after_assistant", msgs(U1, A1), {"add_generation_prompt": True}),
        (
            "unicode_content",
            msgs({"role": "system", "content": "Réponds en français. 🇫🇷"}, {"role": "user", "content": UNICODE},
                 {"role": "assistant", "content": UNICODE[::-1]}, U2),
            {"add_generation_prompt": True},
        ),
        ("empty_user_content", msgs({"role": "user", "content": ""}), {"add_generation_prompt": True}),
        ("empty_system_content", msgs({"role": "system", "content": ""}, U1), {"add_generation_prompt": True}),
        (
            "whitespace_content",
            msgs({"role": "user", "content": "  \n  padded with whitespace\t \n\n"},
                 {"role": "assistant", "content": "\n\n  answer  \n"}, {"role": "user", "content": " \u3000 "}),
            {"add_generation_prompt": True},
        ),
        ("template_syntax_in_content", msgs(SYS, {"role": "user", "content": TRICKY}), {"add_generation_prompt": True}),
        (
            "multiline_content",
            msgs({"role": "user", "content": MULTILINE}, {"role": "assistant", "content": MULTILINE.upper()}, U2),
            {"add_generation_prompt": True},
        ),
        ("system_only", msgs(SYS), {"add_generation_prompt": True}),
        ("no_messages", [], {"add_generation_prompt": True}),
        ("consecutive_user_messages", msgs(U1, U2), {"add_generation_prompt": True}),
        ("assistant_first", msgs(A1, U1), {"add_generation_prompt": True}),
        ("unknown_role", msgs(U1, {"role": "developer", "content": "Be terse."}), {"add_generation_prompt": True}),
        ("user_content_missing", [{"role": "user"}], {"add_generation_prompt": True}),
        ("user_content_none", [{"role": "user", "content": None}], {"add_generation_prompt": True}),
        ("bare_context", msgs(SYS, U1, A1), None),
    ]
    return c


def tool_cases(family):
    weather_chat = msgs(SYS, U_WEATHER, A_CALL, TOOL_RESULT)
    c = [
        ("tools_single_user", msgs(U_WEATHER), {"add_generation_prompt": True, "tools": TOOLS}),
        ("tools_with_system", msgs(SYS, U_WEATHER), {"add_generation_prompt": True, "tools": TOOLS}),
        ("tools_empty_list", msgs(SYS, U_WEATHER), {"add_generation_prompt": True, "tools": []}),
        ("tool_call_and_result", weather_chat, {"add_generation_prompt": True, "tools": TOOLS}),
        ("tool_call_then_answer", msgs(SYS, U_WEATHER, A_CALL, TOOL_RESULT, A_FINAL), {"tools": TOOLS}),
        ("tool_call_content_none", msgs(U_WEATHER, A_CALL_NONE, TOOL_RESULT), {"add_generation_prompt": True, "tools": TOOLS}),
        ("tool_call_with_text", msgs(U_WEATHER, A_CALL_TEXT, TOOL_RESULT), {"add_generation_prompt": True, "tools": TOOLS}),
        (
            "parallel_tool_calls",
            msgs(U_WEATHER, A_CALLS2, TOOL_RESULT, TOOL_RESULT2, A_FINAL, U3),
            {"add_generation_prompt": True, "tools": TOOLS},
        ),
        (
            "tool_call_string_arguments",
            [U_WEATHER, {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_str0000001", "type": "function",
                 "function": {"name": "get_current_weather", "arguments": "{\"location\": \"Paris\"}"}}]},
             TOOL_RESULT],
            {"add_generation_prompt": True, "tools": TOOLS},
        ),
        ("tool_calls_without_tools", msgs(U_WEATHER, A_CALL, TOOL_RESULT), {"add_generation_prompt": True}),
    ]
    if family in ("llama3.1", "llama3.2"):
        c += [
            ("tools_in_system_message", msgs(SYS, U_WEATHER), {"add_generation_prompt": True, "tools": TOOLS,
                                                               "tools_in_user_message": False}),
            ("tools_without_user_message", msgs(SYS), {"add_generation_prompt": True, "tools": TOOLS}),
            ("custom_date_string", msgs(U1), {"add_generation_prompt": True, "date_string": "01 Jan 2025"}),
            ("custom_tools_variable", msgs(U_WEATHER), {"add_generation_prompt": True, "custom_tools": [WEATHER_TOOL]}),
            (
                "tool_result_as_mapping",
                msgs(U_WEATHER, A_CALL, {"role": "ipython", "content": {"temperature": 22, "unit": "celsius",
                                                                       "list": [1, 2.5, None, True]}}),
                {"add_generation_prompt": True, "tools": TOOLS},
            ),
        ]
    if family == "llama3.1":
        c += [
            (
                "builtin_tools",
                msgs(SYS, U2),
                {"add_generation_prompt": True, "builtin_tools": ["code_interpreter", "brave_search", "wolfram_alpha"]},
            ),
            (
                "builtin_tool_call",
                [U2, {"role": "assistant", "tool_calls": [{"function": {"name": "brave_search",
                                                                        "arguments": {"query": "capital of France"}}}]},
                 {"role": "ipython", "content": "Paris"}],
                {"add_generation_prompt": True, "builtin_tools": ["brave_search", "wolfram_alpha"]},
            ),
        ]
    if family == "mistral-small":
        c += [
            (
                "tool_result_content_dict",
                msgs(U_WEATHER, A_CALL, {"role": "tool", "tool_call_id": "call_abc123xyz",
                                         "content": {"temperature": 22, "ok": True, "none": None, "pi": 3.14,
                                                     "text": "it's \"fine\"", "list": [1, "a"]}}),
                {"add_generation_prompt": True, "tools": TOOLS},
            ),
            (
                "tool_result_nested_content",
                msgs(U_WEATHER, A_CALL, {"role": "tool", "tool_call_id": "call_abc123xyz",
                                         "content": {"content": "nested result"}}),
                {"add_generation_prompt": True, "tools": TOOLS},
            ),
            (
                "tool_call_id_too_short",
                [U_WEATHER, {"role": "assistant", "tool_calls": [{"id": "short", "function": CALL["function"]}]}],
                {"add_generation_prompt": True, "tools": TOOLS},
            ),
        ]
    return c


def family_cases(family):
    c = []
    if family == "qwen3":
        think = {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHi! How can I help?"}
        c += [
            ("enable_thinking_false", msgs(U1), {"add_generation_prompt": True, "enable_thinking": False}),
            ("enable_thinking_true", msgs(U1), {"add_generation_prompt": True, "enable_thinking": True}),
            ("enable_thinking_false_no_generation_prompt", msgs(U1, A1), {"enable_thinking": False}),
            ("think_in_last_assistant", msgs(U1, think), {}),
            ("think_in_history_is_dropped", msgs(U1, think, U2), {"add_generation_prompt": True}),
            (
                "reasoning_content_field",
                msgs(U1, {"role": "assistant", "content": "Hi there!", "reasoning_content": "\nA greeting.\n"}),
                {},
            ),
            (
                "reasoning_content_none",
                msgs(U1, {"role": "assistant", "content": "<think>inline</think>Hi!", "reasoning_content": None}),
                {},
            ),
            (
                "multi_step_tool_with_thinking",
                msgs(U_WEATHER, {"role": "assistant", "content": "<think>I should call the tool.</think>",
                                 "tool_calls": [CALL]}, TOOL_RESULT,
                     {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nIt is sunny."}),
                {"tools": TOOLS},
            ),
            (
                "tool_response_in_user_message",
                msgs(U_WEATHER, A_CALL, {"role": "user", "content": "<tool_response>\n22 degrees\n</tool_response>"},
                     {"role": "assistant", "content": "<think>ok</think>It is 22 degrees."}),
                {"add_generation_prompt": True},
            ),
            (
                "non_string_content",
                msgs({"role": "user", "content": [{"type": "text", "text": "Describe this."}]}, A1),
                {"add_generation_prompt": True},
            ),
        ]
    if family == "mistral-small":
        c += [
            (
                "content_blocks",
                msgs({"role": "user", "content": [{"type": "text", "text": "What is in "},
                                                   {"type": "image_url", "image_url": {"url": "x.png"}},
                                                   {"type": "text", "text": " this image?"}]}),
                {"add_generation_prompt": True},
            ),
            (
                "system_content_blocks",
                msgs({"role": "system", "content": [{"type": "text", "text": "Block system."}]}, U1,
                     {"role": "assistant", "content": [{"type": "text", "text": "Block answer."}]}),
                {},
            ),
            ("unsupported_content_block", msgs({"role": "user", "content": [{"type": "audio"}]}), {}),
        ]
    if family == "qwen2.5":
        c += [("system_not_first", msgs(U1, SYS, U2), {"add_generation_prompt": True})]
    if family == "gpt-oss":
        thinking_call = {"role": "assistant", "thinking": "I need the weather tool.", "tool_calls": [CALL]}
        nested = {"type": "function", "function": {
            "name": "plan_trip", "description": "Plan a trip",
            "parameters": {"type": "object", "required": ["stops"], "properties": {
                "stops": {"type": "array", "description": "Cities in order", "items": {"type": "string"}},
                "legs": {"type": "array", "items": {"type": "object", "properties": {
                    "from": {"type": "string"}, "to": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["from"]}},
                "budget": {"type": ["number", "null"]},
                "mode": {"type": "string", "enum": ["train", "car"], "default": "train"},
                "flexible": {"type": "boolean", "default": False},
                "notes": {"oneOf": [{"type": "string", "description": "free text"}, {"type": "integer"}]},
                "meta": {"type": "object"}}}}}
        c += [
            ("reasoning_effort_high", msgs(U1), {"add_generation_prompt": True, "reasoning_effort": "high"}),
            ("model_identity", msgs(SYS, U1), {"add_generation_prompt": True, "model_identity": "You are kvlm's test."}),
            ("builtin_tools", msgs(U2), {"add_generation_prompt": True, "builtin_tools": ["browser", "python"]}),
            ("developer_message_first", msgs({"role": "developer", "content": "Answer in French."}, U1),
             {"add_generation_prompt": True, "tools": TOOLS}),
            ("tool_schema_shapes", msgs(U2), {"add_generation_prompt": True, "tools": [nested]}),
            ("thinking_before_call", msgs(U_WEATHER, thinking_call, TOOL_RESULT), {"add_generation_prompt": True,
                                                                                   "tools": TOOLS}),
            ("thinking_in_last_assistant", msgs(U1, {"role": "assistant", "thinking": "A greeting.", "content": "Hi!"}),
             {}),
            ("channel_tags_in_content",
             msgs(U1, {"role": "assistant", "content": "<|channel|>final<|message|>Hi"}, U2),
             {"add_generation_prompt": True}),
            ("tool_result_without_call", msgs(U_WEATHER, TOOL_RESULT), {"add_generation_prompt": True}),
        ]
    return c


def build_cases(family, tokens):
    cases = generic_cases()
    if family in ("qwen2.5", "qwen3", "llama3.1", "llama3.2", "mistral-small", "gpt-oss"):
        cases += tool_cases(family)
    cases += family_cases(family)
    out = []
    for name, messages, extra in cases:
        if extra is None:  # a bare jinja context, as a hand-written render() call would pass
            ctx = {"messages": messages, **tokens}
        else:
            ctx = {"messages": messages, "tools": None, "documents": None, "add_generation_prompt": False, **tokens}
            ctx.update(copy.deepcopy(extra))
        out.append((name, ctx))
    return out


def render_all(env, source, family, tokens):
    template = env.from_string(source)
    results = []
    for name, ctx in build_cases(family, tokens):
        # Render from a JSON round trip of the context: what the C++ side reads.
        context = json.loads(json.dumps(ctx, ensure_ascii=False))
        case = {"name": name, "context": context}
        try:
            case["expected"] = template.render(**copy.deepcopy(context))
        except Exception as e:  # noqa: BLE001 - every template error is an expected outcome
            case["error"] = str(e)
            case["error_type"] = type(e).__name__
        results.append(case)
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args()
    env = make_env()
    status = 0
    (DATA / "expected").mkdir(exist_ok=True)
    for fname, (tokens, family) in TEMPLATES.items():
        source = (DATA / fname).read_text(encoding="utf-8")
        doc = {
            "template": fname,
            "generator": "tools/make_template_goldens.py",
            "jinja2_version": jinja2.__version__,
            "now": NOW.isoformat(),
            "cases": render_all(env, source, family, tokens),
        }
        text = json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
        out = DATA / "expected" / (fname[: -len(".jinja")] + ".json")
        n_err = sum("error" in c for c in doc["cases"])
        if args.check:
            same = out.exists() and out.read_text(encoding="utf-8") == text
            print(f"{'ok  ' if same else 'DIFF'} {out.name}: {len(doc['cases'])} cases ({n_err} raise)")
            status |= 0 if same else 1
        else:
            out.write_text(text, encoding="utf-8")
            print(f"wrote {out.relative_to(ROOT)}: {len(doc['cases'])} cases ({n_err} raise)")
    return status


if __name__ == "__main__":
    sys.exit(main())
