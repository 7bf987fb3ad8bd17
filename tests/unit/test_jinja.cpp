// The jinja2 interpreter behind ChatTemplate, feature by feature, and its error messages.
//
// Every {template, context, expected} triple in the tables below was checked against Python
// jinja2 3.1 under transformers' environment (trim_blocks, lstrip_blocks, the same tojson,
// strftime_now at the fixed time below); tests/golden/test_chat_templates.cpp does the same
// for whole real templates.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/chat_template.h"
#include "text/jinja/value.h"
#include "test_util.h"

using namespace kvlm;

namespace {

struct Case {
  const char* tpl;
  const char* ctx;
  const char* want;
};

ChatTemplateRenderOptions fixed_time() {
  ChatTemplateRenderOptions o;
  std::tm tm{};
  tm.tm_year = 2024 - 1900;
  tm.tm_mon = 6;
  tm.tm_mday = 26;
  tm.tm_hour = 10;
  tm.tm_min = 30;
  tm.tm_wday = 5;  // a Friday
  tm.tm_yday = 207;
  o.now = tm;
  return o;
}

std::string render(std::string_view tpl, const char* ctx = "{}") {
  return ChatTemplate::parse(tpl, "t").render(nlohmann::ordered_json::parse(ctx), fixed_time());
}

void check(const Case* cases, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    SCOPED_TRACE(std::string("template: ") + cases[i].tpl);
    try {
      EXPECT_EQ(render(cases[i].tpl, cases[i].ctx), cases[i].want);
    } catch (const Error& e) {
      ADD_FAILURE() << "threw: " << e.what();
    }
  }
}
#define CHECK_CASES(table) check(table, sizeof(table) / sizeof(table[0]))

std::string parse_error(std::string_view tpl) {
  try {
    ChatTemplate::parse(tpl, "t");
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string render_error(std::string_view tpl, const char* ctx = "{}") {
  const ChatTemplate t = ChatTemplate::parse(tpl, "t");  // must parse
  try {
    t.render(nlohmann::ordered_json::parse(ctx), fixed_time());
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Jinja, WhitespaceControl) {
  static const Case cases[] = {
      {R"J(a
{% if true %}
b
{% endif %}
c)J", R"J({})J", R"J(a
b
c)J"},
      {R"J(    {% if true %}x{% endif %}  
y)J", R"J({})J", R"J(x  
y)J"},
      {R"J(a  {%- if true -%}  b  {%- endif -%}  c)J", R"J({})J", R"J(abc)J"},
      {R"J(<{{- ' x ' -}}>  <  {{ 1 }}  >)J", R"J({})J", R"J(< x >  <  1  >)J"},
      {R"J(a
    {{ 1 }}
  {{ 2 }})J", R"J({})J", R"J(a
    1
  2)J"},
      {R"J(a
  {# comment #}
b)J", R"J({})J", R"J(a
b)J"},
      {R"J(a  {#- comment -#}  b)J", R"J({})J", R"J(ab)J"},
      {R"J(  {%+ if true %}x{% endif %})J", R"J({})J", R"J(  x)J"},
      {R"J({% if true +%}
x{% endif %})J", R"J({})J", R"J(
x)J"},
      {R"J({% raw %}{{ not rendered }} {% if %}{% endraw %}!)J", R"J({})J", R"J({{ not rendered }} {% if %}!)J"},
      {"a\r\nb\rc\n", R"J({})J", "a\nb\nc"},
      {"x\n\n", R"J({})J", "x\n"},
      {R"J({% for i in [1, 2] %}
  - {{ i }}
{% endfor %})J", R"J({})J", R"J(  - 1
  - 2
)J"},
      {R"J({%- for i in [1, 2] -%}
  [{{ i }}]
{%- endfor %}
end)J", R"J({})J", R"J([1][2]end)J"},
      {R"J({{ 'a' }}
{{ 'b' }}
)J", R"J({})J", R"J(a
b)J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, LiteralsAndPrinting) {
  static const Case cases[] = {
      {R"J({{ 1 }} {{ -2 }} {{ 1.5 }} {{ 3.0 }} {{ 1e-5 }} {{ 1e16 }} {{ 1_000 }} {{ 0x1F }} {{ 0.1 + 0.2 }})J",
       R"J({})J", R"J(1 -2 1.5 3.0 1e-05 1e+16 1000 31 0.30000000000000004)J"},
      {R"J({{ none }} {{ None }} {{ true }} {{ False }} [{{ undefined_name }}])J", R"J({})J", R"J(None None True False [])J"},
      {R"J({{ [1, 'a', none, true, 1.5, {'k': 'v'}] }})J", R"J({})J", R"J([1, 'a', None, True, 1.5, {'k': 'v'}])J"},
      {R"J({{ (1,) }} {{ () }} {{ (1, 2) }} {{ 1, 2 }} {{ [] }} {{ {} }})J", R"J({})J", R"J((1,) () (1, 2) (1, 2) [] {})J"},
      {R"J({{ ["it's", 'say "hi"', 'both \'"', 'tab\t\n', 'é\\'] }})J", R"J({})J",
       R"J(["it's", 'say "hi"', 'both \'"', 'tab\t\n', 'é\\'])J"},
      {R"J({{ 'a' 'b' "c" }} {{ 'line\nbreak' }} {{ '\x41\u00e9\U0001F600\101' }} {{ 'keep \d' }})J", R"J({})J",
       "abc line\nbreak A\u00e9\U0001F600A keep \\d"},
      {R"J({{ x }} {{ x.y }} {{ x['y'] }} {{ n }} {{ f }} {{ b }} {{ l }})J",
       R"J({"x": {"y": "z"}, "n": null, "f": 2.50, "b": false, "l": [1, {"a": null}]})J",
       R"J({'y': 'z'} z z None 2.5 False [1, {'a': None}])J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, Operators) {
  static const Case cases[] = {
      {R"J({{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 2 ** -1 }})J",
       R"J({})J", R"J(7 9 3 -4 1 2 1024 0.5)J"},
      {R"J({{ 1 / 2 }} {{ 4 / 2 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ true + 1 }} {{ 2 * 'ab' }} {{ [1] * 2 }})J",
       R"J({})J", R"J(0.5 2.0 3.0 0.5 2 abab [1, 1])J"},
      {R"J({{ 'a' ~ 1 ~ none ~ true ~ missing ~ [1] }} {{ 'a' + 'b' }} {{ [1] + [2] }})J", R"J({})J",
       R"J(a1NoneTrue[1] ab [1, 2])J"},
      {R"J({{ 1 < 2 < 3 }} {{ 1 < 2 > 3 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }})J",
       R"J({})J", R"J(True False True True True True True)J"},
      {R"J({{ 'a' in 'abc' }} {{ 1 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1, 2] }} {{ 'x' in missing }})J",
       R"J({})J", R"J(True True True True False)J"},
      {R"J({{ 0 or 'x' }} {{ 'a' and 'b' }} {{ none or [] }} {{ not 0 }} {{ not missing }} {{ not (1 and 0) }})J",
       R"J({})J", R"J(x b [] True True True)J"},
      {R"J({{ 'y' if c else 'n' }} [{{ 'y' if false }}] {{ 1 if 0 else 2 if 0 else 3 }})J", R"J({})J", R"J(n [] 3)J"},
      {R"J({{ {'a': 1} == {'a': 1.0} }} {{ [1, 2] == (1, 2) }} {{ missing == missing2 }} {{ missing == none }})J",
       R"J({})J", R"J(True False True False)J"},
      {R"J({{ -x|abs }} {{ 'a' + 'b'|upper }} {{ l|length - 1 }})J", R"J({"x": 3, "l": [1, 2, 3]})J", R"J(3 aB 2)J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, SubscriptsAndSlices) {
  static const Case cases[] = {
      {R"J({{ 'hello'[1:3] }} {{ 'hello'[::-1] }} {{ 'héllo'[1] }} {{ 'abc'[-1] }} [{{ 'abc'[5] }}])J", R"J({})J",
       R"J(el olleh é c [])J"},
      {R"J({{ l[1:] }} {{ l[-2:] }} {{ l[::2] }} {{ l[:-1] }} {{ l[10:] }} {{ l[-1] }} {{ l.0 }})J", R"J({"l": [1, 2, 3, 4]})J",
       R"J([2, 3, 4] [3, 4] [1, 3] [1, 2, 3] [] 4 1)J"},
      {R"J({{ m.role }} {{ m['role'] }} [{{ m.missing }}] {{ m.missing is defined }} {{ m.get('x', 'dflt') }} {{ m.get('role') }})J",
       R"J({"m": {"role": "user"}})J", R"J(user user [] False dflt user)J"},
      {R"J({% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.keys()|list }} {{ d.values()|list }})J",
       R"J({"d": {"b": 1, "a": 2}})J", R"J(b=1;a=2; ['b', 'a'] [1, 2])J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, StringMethods) {
  static const Case cases[] = {
      {R"J({{ ' a b '.split() }} {{ 'a,b,,c'.split(',') }} {{ 'a,b,c'.rsplit(',', 1) }} {{ 'a b c'.split(none, 1) }})J",
       R"J({})J", R"J(['a', 'b'] ['a', 'b', '', 'c'] ['a,b', 'c'] ['a', 'b c'])J"},
      {R"J([{{ '  x  '.strip() }}|{{ '  x  '.lstrip() }}|{{ '  x  '.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\n\nq\n'.strip('\n') }}])J",
       R"J({})J", R"J([x|x  |  x|a|q])J"},
      {R"J({{ s.startswith('<think>') }} {{ s.endswith('</think>') }} {{ s.startswith(('a', '<')) }} {{ s.split('</think>')[-1] }})J",
       R"J({"s": "<think>r</think>answer"})J", R"J(True False True answer)J"},
      {R"J({{ 'aXbXc'.replace('X', '-') }} {{ 'aXbXc'.replace('X', '-', 1) }} {{ 'héllo'.find('l') }} {{ 'abab'.count('ab') }} {{ 'x'.find('y') }})J",
       R"J({})J", R"J(a-b-c a-bXc 2 2 -1)J"},
      {R"J({{ 'Straße ÉCOLE'.upper() }} {{ 'ÀÉÎ Σ'.lower() }} {{ "hello's world".title() }} {{ 'hELLO'.capitalize() }} {{ '-'.join(['a', 'b']) }})J",
       R"J({})J", R"J(STRASSE ÉCOLE àéî σ Hello'S World Hello a-b)J"},
      {R"J({{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ 'ab'.islower() }} {{ 'a\nb'.splitlines() }} {{ 'k=v'.partition('=') }})J",
       R"J({})J", R"J(True True True ['a', 'b'] ('k', '=', 'v'))J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, Filters) {
  static const Case cases[] = {
      {R"J([{{ '  x \n'|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ 'héllo'|length }} {{ [1, 2]|count }} {{ {'a': 1}|length }} {{ missing|length }})J",
       R"J({})J", R"J([x] [a] 5 2 1 0)J"},
      {R"J({{ missing|default('d') }} {{ none|default('d') }} {{ ''|default('d', true) }} [{{ missing|d }}] {{ 0|d(5) }})J",
       R"J({})J", R"J(d None d [] 0)J"},
      {R"J({{ [3, 1, 2]|first }} {{ 'abc'|last }} [{{ []|first }}] {{ [1, 2]|join(', ') }} {{ [1, none]|join }} {{ users|join(', ', attribute='name') }})J",
       R"J({"users": [{"name": "a"}, {"name": "b"}]})J", R"J(3 c [] 1, 2 1None a, b)J"},
      {R"J({{ 'aBc'|lower }} {{ 'aBc'|upper }} {{ 'hello wORLD-x (y)'|title }} {{ 'hELLO'|capitalize }} {{ 'a-b'|replace('-', '+') }})J",
       R"J({})J", R"J(abc ABC Hello World-X (Y) Hello a+b)J"},
      {R"J({{ [1, 2, 3]|reverse|list }} {{ 'abc'|reverse }} {{ 'ab'|list }} {{ 42|string }} {{ {'a': 1}|list }})J",
       R"J({})J", R"J([3, 2, 1] cba ['a', 'b'] 42 ['a'])J"},
      {R"J({{ '12'|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '1.5'|float }} {{ 2|float }} {{ -3|abs }} {{ '0x1A'|int(base=16) }})J",
       R"J({})J", R"J(12 4 0 7 3 1.5 2.0 3 26)J"},
      {R"J({{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(method='ceil') }} {{ 5|round }} {{ 2.7|round(0, 'floor') }})J",
       R"J({})J", R"J(2.0 4.0 2.67 3.0 5 2.0)J"},
      {R"J({% for k, v in d|items %}{{ k }}{{ v }}{% endfor %} {{ d|dictsort }} {{ d|dictsort(by='value', reverse=true) }})J",
       R"J({"d": {"b": 1, "a": 2}})J", R"J(b1a2 [('a', 2), ('b', 1)] [('a', 2), ('b', 1)])J"},
      {R"J({{ l|map(attribute='n')|list }} {{ l|map(attribute='x', default=0)|list }} {{ ['a', 'b']|map('upper')|join }})J",
       R"J({"l": [{"n": 1}, {"n": 2}]})J", R"J([1, 2] [0, 0] AB)J"},
      {R"J({{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, 2, 3]|reject('equalto', 2)|list }} {{ [0, 1, '']|select|list }})J",
       R"J({})J", R"J([1, 3] [1, 3] [1])J"},
      {R"J({{ m|selectattr('role', 'equalto', 'user')|map(attribute='c')|list }} {{ m|rejectattr('tool')|list|length }} {{ m|selectattr('tool')|list }})J",
       R"J({"m": [{"role": "user", "c": 1}, {"role": "tool", "c": 2, "tool": true}]})J",
       R"J([1] 1 [{'role': 'tool', 'c': 2, 'tool': True}])J"},
      {R"J({{ ['b', 'A', 'a', 'B']|unique|list }} {{ ['b', 'A', 'a']|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ l|sort(attribute='n')|map(attribute='n')|list }})J",
       R"J({"l": [{"n": 2}, {"n": 1}]})J", R"J(['b', 'A'] ['A', 'a', 'b'] [3, 2, 1] [1, 2])J"},
      {R"J({{ [1, 2, 3]|sum }} {{ l|sum(attribute='n') }} {{ [3, 1, 2]|min }} {{ ['b', 'A']|max }} {{ 'one two  three'|wordcount }})J",
       R"J({"l": [{"n": 2}, {"n": 1}]})J", R"J(6 3 1 b 3)J"},
      {"{{ 'a\nb\n\nc'|indent }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent('> ', blank=true) }}", R"J({})J",
       "a\n    b\n\n    c|  a\n  b|a\n> \n> b"},
      {R"J({{ '<a href="x">&'|e }} {{ '<b>'|safe }} {{ 1|safe }})J", R"J({})J", R"J(&lt;a href=&#34;x&#34;&gt;&amp; <b> 1)J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, ToJson) {
  static const Case cases[] = {
      {R"J({{ v|tojson }})J", R"J({"v": {"b": 1, "a": [1, 2.5, "é\"\n", null, true], "c": {}}})J",
       R"J({"b": 1, "a": [1, 2.5, "é\"\n", null, true], "c": {}})J"},
      {R"J({{ v|tojson(indent=2) }})J", R"J({"v": {"b": [1, []], "a": {}}})J", "{\n  \"b\": [\n    1,\n    []\n  ],\n  \"a\": {}\n}"},
      {R"J({{ v|tojson(sort_keys=true, separators=(',', ':')) }} {{ v|tojson(ensure_ascii=true) }})J",
       R"J({"v": {"b": "ü😀", "a": 1.0}})J", R"J({"a":1.0,"b":"ü😀"} {"b": "\u00fc\ud83d\ude00", "a": 1.0})J"},
      {R"J({{ 'x\u2028\x7f\x01'|tojson }} {{ 1e-7|tojson }} {{ 12345678901234|tojson }} {{ (1, 'a')|tojson }})J",
       R"J({})J", "\"x\u2028\x7f\\u0001\" 1e-07 12345678901234 [1, \"a\"]"},
      {R"J({{ t|tojson(indent=4) }})J", R"J({"t": {"name": "f", "parameters": {"type": "object"}}})J",
       "{\n    \"name\": \"f\",\n    \"parameters\": {\n        \"type\": \"object\"\n    }\n}"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, Tests) {
  static const Case cases[] = {
      {R"J({{ x is defined }} {{ missing is undefined }} {{ n is none }} {{ s is string }} {{ d is mapping }} {{ l is sequence }})J",
       R"J({"x": 1, "n": null, "s": "a", "d": {}, "l": []})J", R"J(True True True True True True)J"},
      {R"J({{ s is iterable }} {{ 1 is iterable }} {{ missing is iterable }} {{ true is number }} {{ true is integer }} {{ 1.0 is float }} {{ 1 is integer }})J",
       R"J({"s": "a"})J", R"J(True False True True False True True)J"},
      {R"J({{ b is boolean }} {{ b is false }} {{ b is true }} {{ 0 is false }} {{ n is not none }} {{ d is not mapping }})J",
       R"J({"b": false, "n": 1, "d": []})J", R"J(True True False False True True)J"},
      {R"J({{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} {{ 'a' is eq 'a' }} {{ 1 is equalto 2 }} {{ 1 is lt 2 }} {{ 2 is in [1, 2] }})J",
       R"J({})J", R"J(True True True True False True True)J"},
      {R"J({{ none is sameas none }} {{ false is sameas 0 }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ 'upper' is filter }} {{ 'odd' is test }})J",
       R"J({})J", R"J(True False True True True True)J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, Loops) {
  static const Case cases[] = {
      {R"J({% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %})J",
       R"J({"l": ["a", "b"]})J", R"J(1021TrueFalse2;2110FalseTrue2;)J"},
      {R"J({% for x in [] %}a{% else %}empty{% endfor %} {% for x in missing %}a{% else %}none{% endfor %})J", R"J({})J",
       R"J(empty none)J"},
      {R"J({% for x in [1, 2, 3, 4] if x is odd %}{{ x }}/{{ loop.length }}{{ loop.last }} {% endfor %})J", R"J({})J",
       R"J(1/2False 3/2True )J"},
      {R"J({% for x in [1, 2, 3, 4, 5] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %})J",
       R"J({})J", R"J(13)J"},
      {R"J({% for x in [1, 2, 3] %}{% with y = x %}{% if y == 2 %}{% break %}{% endif %}{{ y }}{% endwith %}{% endfor %})J",
       R"J({})J", R"J(1)J"},
      {R"J({% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %} {% for k in {'x': 1, 'y': 2} %}{{ k }}{% endfor %} {% for c in 'hé' %}[{{ c }}]{% endfor %})J",
       R"J({})J", R"J(37 xy [h][é])J"},
      {R"J({% for x in [3, 1, 2]|sort|reverse %}{{ x }}{% endfor %} {% for m in msgs[1:] %}{{ m }}{% endfor %})J",
       R"J({"msgs": ["a", "b", "c"]})J", R"J(321 bc)J"},
      {R"J({% for i in [1, 2] %}{% for j in 'ab' %}{{ i }}{{ j }}{{ loop.index }} {% endfor %}{{ loop.index }}|{% endfor %})J",
       R"J({})J", R"J(1a1 1b2 1|2a1 2b2 2|)J"},
      {R"J({% for x in [1, 2, 3] %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}{{ loop.cycle('o', 'e') }} {% endfor %})J",
       R"J({})J", R"J(<1>2o 1<2>3e 2<3>o )J"},
      {R"J({% for i in range(3) %}{{ i }}{% endfor %} {{ range(1, 10, 3)|list }} {{ range(3, 0, -1)|list }})J", R"J({})J",
       R"J(012 [1, 4, 7] [3, 2, 1])J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, AssignmentAndScoping) {
  static const Case cases[] = {
      {R"J({% set a = 1 %}{% for x in [1, 2] %}{{ a }}{% set a = a + 10 %}{{ a }} {% endfor %}{{ a }})J", R"J({})J",
       R"J(111 111 1)J"},
      {R"J({% set acc = [] %}{% for x in [1, 2] %}{% set acc = acc + [x] %}{% endfor %}{{ acc }})J", R"J({})J", R"J([])J"},
      {R"J({% if true %}{% set c = 'set in if' %}{% endif %}{{ c }})J", R"J({})J", R"J(set in if)J"},
      {R"J({% set ns = namespace(total=0, items=[]) %}{% for x in [1, 2, 3] %}{% set ns.total = ns.total + x %}{% set ns.items = ns.items + [x] %}{% endfor %}{{ ns.total }} {{ ns.items }} {{ ns }})J",
       R"J({})J", R"J(6 [1, 2, 3] <Namespace {'total': 6, 'items': [1, 2, 3]}>)J"},
      {R"J({% set a, b = 1, 2 %}{{ a }}{{ b }} {% set t = (3, 4) %}{% set c, d = t %}{{ c + d }})J", R"J({})J",
       R"J(12 7)J"},
      {R"J({% set ns = namespace() %}{% set ns.a, b, ns.c = 'xyz' %}{{ ns.a }}{{ b }}{{ ns.c }} {% set ns.d %}blk{% endset %}{{ ns.d }})J",
       R"J({})J", R"J(xyz blk)J"},
      {R"J({% set x %}  block {{ 1 + 1 }} {% endset %}[{{ x }}] {% set y | upper | trim %} shout {% endset %}[{{ y }}])J",
       R"J({})J", R"J([  block 2 ] [SHOUT])J"},
      {R"J({% set messages = messages[1:] %}{{ messages|length }})J", R"J({"messages": [1, 2, 3]})J", R"J(2)J"},
      {R"J({% with a = 1, b = x %}{{ a }}{{ b }}{% endwith %}[{{ a }}])J", R"J({"x": 5})J", R"J(15[])J"},
      {R"J({% filter upper %}hello {{ name }}{% endfilter %})J", R"J({"name": "bob"})J", R"J(HELLO BOB)J"},
      {R"J({% set d = dict(a=1, b='x') %}{{ d }} {{ dict({'k': 1}, z=2) }})J", R"J({})J",
       R"J({'a': 1, 'b': 'x'} {'k': 1, 'z': 2})J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, Macros) {
  static const Case cases[] = {
      {R"J({% macro tag(name, cls='x') %}<{{ name }} class="{{ cls }}">{% endmacro %}{{ tag('a') }}{{ tag('b', 'y') }}{{ tag(cls='z', name='c') }})J",
       R"J({})J", R"J(<a class="x"><b class="y"><c class="z">)J"},
      {R"J({% macro m() %}{{ g }}{% endmacro %}{% set g = 1 %}{{ m() }}{% set g = 2 %}{{ m() }})J", R"J({})J", R"J(12)J"},
      {R"J({% for x in [1, 2] %}{% macro show() %}[{{ x }}]{% endmacro %}{{ show() }}{% endfor %})J", R"J({})J",
       R"J([1][2])J"},
      {R"J({% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * (fact(n - 1)|int) }}{% endif %}{% endmacro %}{{ fact(5) }})J",
       R"J({})J", R"J(120)J"},
      {R"J({% macro m(a) %}[{{ a }}]{% endmacro %}{{ m() }} {{ m('x') ~ '!' }})J", R"J({})J", R"J([] [x]!)J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, GlobalsAndUndefined) {
  static const Case cases[] = {
      {R"J({{ strftime_now('%d %b %Y') }} {{ strftime_now('%Y-%m-%d %H:%M') }} {{ strftime_now is defined }})J",
       R"J({})J", R"J(26 Jul 2024 2024-07-26 10:30 True)J"},
      {R"J({% set j = joiner(' | ') %}{% for x in 'abc' %}{{ j() }}{{ x }}{% endfor %})J", R"J({})J", R"J(a | b | c)J"},
      {R"J([{{ missing }}] {{ missing is defined }} {{ missing|length }} {% for x in missing %}x{% endfor %}{% if not missing %}falsy{% endif %})J",
       R"J({})J", R"J([] False 0 falsy)J"},
      {R"J({{ messages[0]['role'] if messages else 'none' }} [{{ []|last }}] {{ (1 if false) is defined }})J",
       R"J({"messages": []})J", R"J(none [] False)J"},
      {R"J({{ range is defined }} {{ namespace is defined }} {{ raise_exception is defined }})J", R"J({})J",
       R"J(True True True)J"},
      {R"J({% generation %}body {{ 1 }}{% endgeneration %})J", R"J({})J", R"J(body 1)J"},
  };
  CHECK_CASES(cases);
}

// map/select/reject/selectattr/rejectattr/unique/items return generators in jinja2 and
// reverse a reverse iterator: lazy, single use, always truthy, without len().
TEST(Jinja, GeneratorsAreLazyAndSingleUse) {
  static const Case cases[] = {
      {R"J({% if [1]|select('odd') %}T{% endif %}|{% if []|select('odd') %}T{% endif %}|{{ []|map('upper') is iterable }}|{{ []|map('upper') is sequence }})J",
       R"J({})J", R"J(T|T|True|False)J"},
      {R"J({% set g = [1, 2]|map('string') %}{{ g|list }}{{ g|list }} {% set r = [1, 2]|reverse %}{{ r|join }}{{ r|join }})J",
       R"J({})J", R"J(['1', '2'][] 21)J"},
      {R"J({{ [3, 1]|reverse|list }} {{ {'a': 1, 'b': 2}|reverse|list }} {{ (5|map('upper')) is defined }} {{ [1, 2]|select('odd')|first }})J",
       R"J({})J", R"J([1, 3] ['b', 'a'] True 1)J"},
      {R"J({% for x in d|items %}{{ x }}{% endfor %} {{ 2 in [1, 2]|select('even') }} {{ ms|selectattr('role', 'eq', 'user')|map(attribute='content')|join('+') }})J",
       R"J({"d": {"a": 1}, "ms": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}, {"role": "user", "content": "c"}]})J",
       R"J(('a', 1) True a+c)J"},
  };
  CHECK_CASES(cases);
  EXPECT_EQ(render_error("{{ [1]|select('odd')|length }}"), "t:1:22: object of type 'generator' has no len()");
  EXPECT_EQ(render_error("{{ [1]|map('upper')|last }}"), "t:1:21: 'generator' object is not reversible");
  EXPECT_EQ(render_error("{{ 5|map('upper')|list }}"), "t:1:19: 'int' object is not iterable");
}

TEST(Jinja, PercentFormatting) {
  static const Case cases[] = {
      {R"J({{ '%s and %d' % ('a', 3) }} {{ '%05.1f|%-4s|%x|%#o|%%' % (3.14159, 'ab', 255, 8) }} {{ '%(k)s=%(n)03d' % {'k': 'v', 'n': 7} }} {{ '%r' % 'q' }} {{ 'x: %s' % [1, 2] }} {{ '%.2s' % 'abc' }})J",
       R"J({})J", R"J(a and 3 003.1|ab  |ff|0o10|% v=007 'q' x: [1, 2] ab)J"},
  };
  CHECK_CASES(cases);
  EXPECT_EQ(render_error("{{ '%s %s' % ('a',) }}"), "t:1:12: not enough arguments for format string");
  EXPECT_EQ(render_error("{{ '%s' % ('a', 'b') }}"), "t:1:9: not all arguments converted during string formatting");
  EXPECT_EQ(render_error("{{ '%d' % 'a' }}"), "t:1:9: %d format: a real number is required, not str");
}

// Names resolve per frame, at compile time, as jinja2 does (scoping.h).
TEST(Jinja, StaticScopingLikeJinja2) {
  static const Case cases[] = {
      {R"J({% for i in [1] %}[{{ a }}]{% endfor %}{% set a = 1 %})J", R"J({"a": "A"})J", R"J([])J"},
      {R"J([{{ a }}]{% set a = 1 %}[{{ a }}])J", R"J({"a": "A"})J", R"J([A][1])J"},
      {R"J({% if true %}[{{ a }}]{% endif %}{% set a = 1 %})J", R"J({"a": "A"})J", R"J([A])J"},
      {R"J({% for i in [1] %}[{{ a }}]{% endfor %}{% if false %}{% set a = 1 %}{% endif %})J", R"J({"a": "A"})J", R"J([A])J"},
      {R"J({% macro m() %}[{{ a }}]{% endmacro %}{{ m() }}{% set a = 1 %}{{ m() }})J", R"J({"a": "A"})J", R"J([][1])J"},
      {R"J({% for i in [1] %}{% for j in [1] %}[{{ a }}]{% endfor %}{% set a = 2 %}{% endfor %})J", R"J({"a": "A"})J", R"J([])J"},
      {R"J({% set x = 1 %}{% for i in [1] %}[{{ x }}]{% endfor %}{% set x = 2 %})J", R"J({})J", R"J([1])J"},
      {R"J({% with q = 1 %}[{{ a }}]{% endwith %}{% set a = 3 %}{% set b %}[{{ c }}]{% endset %}{{ b }}{% set c = 4 %})J",
       R"J({"a": "A", "c": "C"})J", R"J([][])J"},
      {R"J({% for i in [1, 2] %}[{{ a }}]{% if i == 1 %}{% set a = 9 %}{% endif %}{% endfor %})J", R"J({"a": "A"})J", R"J([A][A])J"},
  };
  CHECK_CASES(cases);
}

TEST(Jinja, LexerCornerCases) {
  static const Case cases[] = {
      {R"J(text{#)J", R"J({})J", R"J(text)J"},
      {R"J(a {#-)J", R"J({})J", R"J(a)J"},
      {R"J({{ {'a': {'b': 1}} }}{{ {'k': [1, {'x': 2}]}['k'][1].x }})J", R"J({})J", R"J({'a': {'b': 1}}2)J"},
      {R"J({{ d[1, 2] is defined }} {{ x.0 }})J", R"J({"d": {}, "x": ["first"]})J", R"J(False first)J"},
      {R"J({{ 'a\
b' }}|{{ "tab\there" }})J", R"J({})J", "ab|tab\there"},
  };
  CHECK_CASES(cases);
  EXPECT_EQ(parse_error("x {{"), "t:1:5: unexpected end of template in an expression");
  EXPECT_EQ(parse_error("{% for a, in [[1]] %}{% endfor %}"), "t:1:14: expected 'in', got '['");
}

TEST(Jinja, ParseErrorsNameLineAndColumn) {
  EXPECT_EQ(parse_error("ok\n  {% frobnicate x %}"), "t:2:6: unknown tag 'frobnicate'");
  EXPECT_EQ(parse_error("{{ x | nosuchfilter }}"), "t:1:8: unknown filter 'nosuchfilter'");
  EXPECT_EQ(parse_error("{{ x | batch(2) }}"), "t:1:8: filter 'batch' is not supported by kvlm");
  EXPECT_EQ(parse_error("{% if x is nosuchtest %}{% endif %}"), "t:1:12: unknown test 'nosuchtest'");
  EXPECT_EQ(parse_error("line\n{% if x %}\nabc"),
            "t:3:4: unexpected end of template: the {% if %} at 2:4 is never closed (expected {% elif %}, {% else %} or "
            "{% endif %})");
  EXPECT_EQ(parse_error("{% for x in y %}\n  {% if x %}{% endfor %}"),
            "t:2:16: unknown tag 'endfor' (expected {% elif %}, {% else %} or {% endif %} to close the {% if %} at 2:6)");
  EXPECT_EQ(parse_error("{% for x in y %}{% endif %}"),
            "t:1:20: unknown tag 'endif' (expected {% endfor %} or {% else %} to close the {% for %} at 1:4)");
  EXPECT_EQ(parse_error("{{ 1 + }}"), "t:1:8: unexpected '}}' in an expression");
  EXPECT_EQ(parse_error("{{ }}"), "t:1:4: expected an expression, got '}}'");
  EXPECT_EQ(parse_error("{{ (1 }}"), "t:1:7: unexpected '}', expected ')'");
  EXPECT_EQ(parse_error("{{ x ]}}"), "t:1:6: unexpected ']'");
  EXPECT_EQ(parse_error("{{ 'abc }}"), "t:1:4: unterminated string literal");
  EXPECT_EQ(parse_error("a {# never closed"), "t:1:3: missing end of comment tag '#}'");
  EXPECT_EQ(parse_error("{{ x "), "t:1:6: expected '}}' to end the '{{' at 1:1, got end of template");
  EXPECT_EQ(parse_error("{{ x y }}"), "t:1:6: expected '}}' to end the '{{' at 1:1, got 'y'");
  EXPECT_EQ(parse_error("{% set %}"), "t:1:8: expected a variable name to assign to, got '%}'");
  EXPECT_EQ(parse_error("{% if x %}{% else if y %}{% endif %}"), "t:1:19: expected '%}', got 'if'");
  EXPECT_EQ(parse_error("{{ x ! y }}"), "t:1:6: unexpected character '!'");
  EXPECT_EQ(parse_error("{% include 'x.jinja' %}"), "t:1:4: unsupported tag 'include': kvlm's chat template engine has no {% include %}");
  EXPECT_EQ(parse_error("{% for x in y recursive %}{% endfor %}"), "t:1:15: recursive for loops are not supported");
  EXPECT_EQ(parse_error("{{ f(*args) }}"), "t:1:6: *args and **kwargs in calls are not supported");
  EXPECT_EQ(parse_error("{% break %}"), "t:1:4: 'break' outside of a for loop");
  EXPECT_EQ(parse_error("{% macro m(a=1, b) %}{% endmacro %}"), "t:1:17: non-default argument follows default argument");
  EXPECT_EQ(parse_error("{{ '\\x4' }}"), "t:1:4: bad escape in string literal: truncated \\x escape");
  EXPECT_EQ(parse_error("{% do x.append(1) %}"), "t:1:4: unknown tag 'do'");
  // The default name.
  try {
    ChatTemplate::parse("{% endif %}");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "chat template:1:4: unknown tag 'endif'");
  }
}

TEST(Jinja, RenderErrorsNameTheTemplate) {
  EXPECT_EQ(render_error("{{ raise_exception('Roles must alternate!') }}"), "t: Roles must alternate!");
  try {
    ChatTemplate::parse("{% if true %}{{ raise_exception('boom: ' ~ 42) }}{% endif %}").render(nlohmann::json::object());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "chat template: boom: 42");
  }
}

TEST(Jinja, RenderErrors) {
  EXPECT_EQ(render_error("{{ foo.bar }}"), "t:1:7: 'foo' is undefined");
  EXPECT_EQ(render_error("{{ m.content + 'x' }}", R"({"m": {}})"), "t:1:14: 'dict object' has no attribute 'content'");
  EXPECT_EQ(render_error("\n  {{ 'a' + none }}"), "t:2:10: can only concatenate str (not \"NoneType\") to str");
  EXPECT_EQ(render_error("{{ messages[0]['role'] }}", R"({"messages": []})"), "t:1:15: list object has no element 0");
  EXPECT_EQ(render_error("{{ missing|tojson }}"), "t:1:12: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(render_error("{{ missing.upper() }}"), "t:1:11: 'missing' is undefined");
  EXPECT_EQ(render_error("{{ nofunc() }}"), "t:1:10: 'nofunc' is undefined");
  EXPECT_EQ(render_error("{{ 'x'() }}"), "t:1:7: 'str' object is not callable");
  EXPECT_EQ(render_error("{{ 1 < 'a' }}"), "t:1:4: '<' not supported between instances of 'int' and 'str'");
  EXPECT_EQ(render_error("{{ 1 // 0 }}"), "t:1:6: integer division or modulo by zero");
  EXPECT_EQ(render_error("{{ 1 in 'abc' }}"), "t:1:4: 'in <string>' requires string as left operand, not int");
  EXPECT_EQ(render_error("{% for x in none %}{% endfor %}"), "t:1:4: 'NoneType' object is not iterable");
  EXPECT_EQ(render_error("{% set ns.x = 1 %}"), "t:1:4: cannot assign attribute on non-namespace object");
  EXPECT_EQ(render_error("{{ [1].append(2) }}"), "t:1:14: access to attribute 'append' of 'list' object is unsafe.");
  EXPECT_EQ(render_error("{{ 'a'|indent(nope=1) }}"), "t:1:8: indent() got an unexpected keyword argument 'nope'");
  EXPECT_EQ(render_error("{{ 'a'.format(1) }}"), "t:1:14: str.format() is not supported by kvlm");
  EXPECT_EQ(render_error("{% set a, b = [1] %}"), "t:1:4: not enough values to unpack (expected 2, got 1)");
  EXPECT_EQ(render_error("{{ range(200000)|length }}"),
            "t:1:9: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
  EXPECT_EQ(render_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"), "t:1:20: maximum macro recursion depth exceeded");
  EXPECT_EQ(render_error("{{ x }}", "[1, 2]"), "t: the context must be a JSON object, got array");
  EXPECT_EQ(render_error("{{ 9223372036854775807 + 1 }}"), "t:1:24: integer overflow (kvlm integers are 64-bit)");
}

// Limits that keep a hostile template or request from exhausting the stack or memory.
TEST(Jinja, ResourceGuards) {
  EXPECT_EQ(parse_error("{{ " + std::string(300, '(') + "1" + std::string(300, ')') + " }}"),
            "t:1:204: the template nests too deeply (more than 200 levels)");
  std::string deep_blocks;
  for (int i = 0; i < 250; ++i) deep_blocks += "{% if true %}";
  EXPECT_NE(parse_error(deep_blocks).find("nests too deeply"), std::string::npos);
  std::string deep_json = "{\"x\": " + std::string(300, '[') + std::string(300, ']') + "}";
  EXPECT_EQ(render_error("{{ x }}", deep_json.c_str()), "t: the context nests too deeply (more than 256 levels)");
  EXPECT_EQ(render_error("{{ 'ab' * 100000000 }}"), "t:1:9: repetition result too large");
  // A namespace that holds itself prints as jinja2 prints it.
  EXPECT_EQ(render("{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns }}"),
            "<Namespace {'a': 1, 'self': <Namespace {...}>}>");
}

TEST(Jinja, KeyOrderFollowsTheJsonType) {
  const ChatTemplate t = ChatTemplate::parse("{{ d|tojson }}");
  const char* ctx = R"({"d": {"b": 1, "a": 2}})";
  EXPECT_EQ(t.render(nlohmann::ordered_json::parse(ctx)), R"({"b": 1, "a": 2})");
  EXPECT_EQ(t.render(nlohmann::json::parse(ctx)), R"({"a": 2, "b": 1})");  // nlohmann::json sorts keys
}

TEST(Jinja, FloatRepr) {
  using jinja::float_repr;
  EXPECT_EQ(float_repr(0.0), "0.0");
  EXPECT_EQ(float_repr(-0.0), "-0.0");
  EXPECT_EQ(float_repr(1e-4), "0.0001");
  EXPECT_EQ(float_repr(1e-5), "1e-05");
  EXPECT_EQ(float_repr(123456789012345678.0), "1.2345678901234568e+17");
  EXPECT_EQ(float_repr(1234567890123456.0), "1234567890123456.0");
  EXPECT_EQ(float_repr(0.1), "0.1");
  EXPECT_EQ(float_repr(1.5e300), "1.5e+300");
  EXPECT_EQ(float_repr(2.5e-310), "2.5e-310");
}

TEST(Jinja, TemplateIsReusableAndThreadSafeToShare) {
  const ChatTemplate t = ChatTemplate::parse("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}");
  const auto ctx = nlohmann::json::parse(R"({"messages": [1, 2, 3]})");
  EXPECT_EQ(t.render(ctx), "3");
  EXPECT_EQ(t.render(ctx), "3");  // no state survives a render
  const ChatTemplate copy = t;
  EXPECT_EQ(copy.render(ctx), "3");
  EXPECT_EQ(copy.name(), "chat template");
}

// A template that loops for ever or writes without end is stopped by the render budget
// with an error naming where it was (the server answers 400 for that request).
TEST(Jinja, RenderBudgetStopsRunawayTemplates) {
  const std::string loops = render_error("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}");
  EXPECT_NE(loops.find("steps (a loop that does not end?)"), std::string::npos) << loops;
  EXPECT_NE(loops.find("t:1:"), std::string::npos) << loops;
  const std::string grows = render_error(
      "{% set ns = namespace(s='x') %}{% for a in range(100000) %}{% for b in range(100) %}{{ 'y' * 60000 }}{% endfor %}{% endfor %}");
  EXPECT_NE(grows.find("MiB; rendering stopped"), std::string::npos) << grows;
  EXPECT_NE(render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").find("recursion"), std::string::npos);
}
