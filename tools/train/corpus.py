"""Procedural, reproducible corpus for the bundled kvlm model (issue 6).

Four kinds of documents, each generated from a `random.Random` so that a seed fixes the
whole corpus:

- arithmetic  ChatML. A multi-step word problem (2-4 computations on small integers) as the
              user turn; a worked solution with one explicit computation per line
              ("38 - 9 = 29.") ending in "The answer is 29." as the assistant turn.
- recall      ChatML. A user turn of prose (the haystack) in which sentences
              "The pass key for the amber vault is 48213." are hidden at random depths,
              ending with "What is the pass key for the amber vault?"; the assistant answers
              "The pass key for the amber vault is 48213.". Lengths are counted in tokens.
              Training documents hide 1-4 keys (Mix.recall_keys) and may ask about up to 3
              of them, the others in follow-up user turns; evaluation prompts hide 1-3 and
              ask once.
- chat        ChatML. Short instruction-following exchanges (repeat a word, reverse a list,
              add two numbers, greet someone, ...), one to three turns, sometimes with a
              system message.
- prose       Plain text, no special tokens: paragraphs about a small cast of people and a
              town (the same generator writes the recall haystacks). heldout.txt is prose.

The ChatML rendering (`render_chat`) is exactly what the chat template in
tokenizer_config.json produces; train.py checks the two agree. This module needs only the
standard library and, for token-level work, a `tokenizers.Tokenizer`.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass, field

# Special tokens: ids 0, 1, 2 of the trained tokenizer, in this order.
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

# Token kinds, one per target position, so train.py can report a loss per task.
KIND_PAD = 0        # padding: no loss
KIND_TEXT = 1       # prose, user turns, chat scaffolding
KIND_RECALL = 2     # the assistant's answer of a recall document
KIND_ARITH = 3      # the assistant's worked solution of an arithmetic problem
KIND_CHAT = 4       # the assistant's turns of a chat document
KIND_KEY = 5        # the digits of the pass key in a recall answer
KIND_NAMES = ["pad", "text", "recall_answer", "arith_solution", "chat_answer", "recall_key"]

# Regexes that extract the answer from a completion (group 1), written into the eval files.
ARITH_REGEX = r"The answer is (-?\d+)"
RECALL_REGEX = r"vault is (\d+)"

# --------------------------------------------------------------------------------------
# Word lists. Every word is plain lowercase ASCII (names capitalised) so that the trained
# BPE vocabulary holds each of them as one or two tokens. VAULTS is disjoint from every
# list the prose uses, so a vault name in the haystack can only come from a key sentence.
# --------------------------------------------------------------------------------------
SHE_NAMES = ("Ada Cara Fay Hana Jia Lena Nora Pia Rosa Tara Uma Wen Xia Yara Alma Cleo Emma "
             "Gia Iris Kira Maya Olga Rhea Tess Vera Yuki Zoe Anna Dora Ines Mina Sara Ula "
             "Bianca Daria Flora Helga Julia Laura Nadia Petra Selma Ursula Wanda Yvonne "
             "Agnes Celia Esther Greta Ingrid Klara").split()
HE_NAMES = ("Ben Dan Eli Gus Ivan Kai Milo Omar Quin Sam Vic Zed Bo Dev Finn Hugo Jon Leo "
            "Nico Paul Sven Ugo Will Carl Evan Hal Jude Luca Ned Otto Remy Theo Wade Abel "
            "Cyrus Edgar Gideon Isaac Kevin Magnus Oscar Ruben Tobias Victor Xavier Zachary "
            "Bruno Dmitri Felix Henrik Joel").split()
NAMES = SHE_NAMES + HE_NAMES
TOWNS = ("Ashford Brookvale Cedarton Dunmore Elmstead Fairhaven Glenrock Hillcrest Ironwood "
         "Juniper Kingsley Lakeside Millbrook Northgate Oakridge Pinecrest Queensbury "
         "Riverton Stonebridge Thornbury Upton Westfield Yarrow Zephyr Applecross Bellmont "
         "Clearwater Deepdale Eastwick Foxhollow Greenford Harrowgate Ivybridge Kettering "
         "Larkspur Marshfield Newhaven Oldcastle Pembrook Redcliff Silverdale Tamworth").split()
PLACES = ("market library park bakery station harbor school garden museum bridge square "
          "river forest hill farm beach castle tower mill cafe orchard workshop theater "
          "pharmacy stadium lighthouse chapel barn pond meadow").split()
ANIMALS = ("cat dog horse goat rabbit fox owl duck sheep mouse deer bear frog swan crow "
           "donkey hedgehog squirrel turtle pigeon goose parrot lamb pony hamster").split()
ADJECTIVES = ("small large quiet busy old new bright dark warm cold happy sleepy tall short "
              "gentle brave clever lazy noisy calm").split()
COLORS = "red blue green yellow white black brown gray orange purple pink".split()
WEATHER = "sunny rainy windy cloudy foggy snowy stormy mild".split()
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
TIMES = "morning afternoon evening night".split()
THINGS = ("lamp book map key coin hat bell box cup kite ring shell stone feather ribbon "
          "basket candle clock compass lantern whistle umbrella blanket mirror needle "
          "bucket ladder").split()
TOPICS = ("weather harvest festival river election concert garden storm market bridge "
          "library school").split()
OPINIONS = "wonderful strange boring exciting important difficult funny".split()
ACTIVITIES = "swim paint read cook sing dance fish draw run garden knit climb skate sketch".split()
JOBS = ("baker farmer teacher doctor sailor painter builder miller singer guard carpenter "
        "gardener librarian fisherman potter weaver nurse").split()
VEHICLES = "cart wagon boat bus truck bicycle train".split()
BUILDINGS = "school library bakery tower museum station hall church inn".split()
LANDSCAPES = "field meadow valley road yard hill".split()
MEALS = "breakfast lunch dinner".split()
# (singular, plural) countable things for the arithmetic problems.
OBJECTS = [("apple", "apples"), ("marble", "marbles"), ("pencil", "pencils"), ("sticker", "stickers"),
           ("card", "cards"), ("cookie", "cookies"), ("stamp", "stamps"), ("book", "books"),
           ("shell", "shells"), ("coin", "coins"), ("egg", "eggs"), ("flower", "flowers"),
           ("toy", "toys"), ("candy", "candies"), ("ball", "balls"), ("button", "buttons"),
           ("orange", "oranges"), ("bead", "beads"), ("cup", "cups"), ("box", "boxes")]
ITEMS = [("pen", "pens"), ("notebook", "notebooks"), ("ticket", "tickets"), ("sandwich", "sandwiches"),
         ("shirt", "shirts"), ("lamp", "lamps"), ("toy", "toys"), ("plate", "plates"),
         ("candle", "candles"), ("hat", "hats"), ("bottle", "bottles"), ("bag", "bags")]
MACHINES = [("machine", "toy", "toys"), ("baker", "loaf", "loaves"), ("printer", "page", "pages"),
            ("farmer", "basket", "baskets"), ("robot", "box", "boxes"), ("tailor", "shirt", "shirts")]
VAULTS = ("amber azure bronze cobalt coral crimson emerald garnet indigo ivory jade lilac "
          "marble navy ochre onyx opal pearl quartz ruby saffron scarlet silver topaz "
          "umber violet walnut zinc falcon heron eagle hawk raven robin sparrow finch "
          "condor osprey pelican puffin lynx otter badger beaver bison camel cobra "
          "dingo gecko iguana jaguar koala lemur llama moose panda tiger walrus zebra").split()
CHAT_WORDS = ("apple river stone cloud green music paper window garden silver candle rabbit "
              "orange winter summer yellow pencil mountain ocean forest banana guitar "
              "thunder blanket diamond kitten rocket village violin puzzle lemon castle").split()
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]

_PROSE_WORDS = set(w.lower() for lst in (NAMES, TOWNS, PLACES, ANIMALS, ADJECTIVES, COLORS, WEATHER,
                                          THINGS, TOPICS, OPINIONS, ACTIVITIES, JOBS, VEHICLES,
                                          BUILDINGS, LANDSCAPES, MEALS) for w in lst)
assert not _PROSE_WORDS & set(VAULTS), "vault names must not occur in the prose"


_SHE = frozenset(SHE_NAMES)


def _pronouns(name: str) -> tuple[str, str, str]:
    """(subject, object, possessive) pronouns for a name."""
    return ("she", "her", "her") if name in _SHE else ("he", "him", "his")


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# --------------------------------------------------------------------------------------
# ChatML
# --------------------------------------------------------------------------------------
# The chat template written to tokenizer_config.json: plain Jinja2, ChatML, no BOS.
CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}"
)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """What CHAT_TEMPLATE renders for `messages` (checked against jinja2 by train.py)."""
    out = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return out + (f"{IM_START}assistant\n" if add_generation_prompt else "")


# --------------------------------------------------------------------------------------
# Arithmetic word problems
# --------------------------------------------------------------------------------------
@dataclass
class Problem:
    question: str
    solution: str     # worked solution, one computation per line, last line "The answer is N."
    answer: int
    steps: int        # number of explicit computations in the solution


def _inventory_problem(rng: random.Random, steps: int) -> Problem:
    """Someone's count of objects changes step by step; how many at the end?"""
    name, other = rng.sample(NAMES, 2)
    he, him, his = _pronouns(name)
    sing, plur = rng.choice(OBJECTS)
    x = rng.randint(5, 60)
    story = [f"{name} has {x} {plur}."]
    work = [f"{name} starts with {x} {plur}."]
    done = 0
    while done < steps:
        ops = ["add"]
        if x >= 3:
            ops.append("sub")
        if x <= 60:
            ops.append("mul")
        if any(x % k == 0 and x // k >= 2 for k in (2, 3, 4, 5)):
            ops.append("div")
        if steps - done >= 2 and x <= 300:
            ops.append("bags")
        op = rng.choice(ops)
        if op == "add":
            b = rng.randint(2, 40)
            y = x + b
            story.append(rng.choice([f"{_cap(he)} finds {b} more {plur}.",
                                     f"{_cap(he)} buys {b} more {plur}.",
                                     f"{other} gives {him} {b} {plur}.",
                                     f"{_cap(he)} gets {b} {plur} from {other}."]))
            work.append(f"{_cap(he)} gets {b} more, so {x} + {b} = {y}.")
            done += 1
        elif op == "sub":
            b = rng.randint(1, x - 1)
            y = x - b
            things = sing if b == 1 else plur
            story.append(rng.choice([f"{_cap(he)} gives {b} {things} to {other}.",
                                     f"{_cap(he)} loses {b} {things}.",
                                     f"{_cap(he)} sells {b} {things}.",
                                     f"{other} takes {b} {things} from {him}."]))
            work.append(f"{_cap(he)} loses {b}, so {x} - {b} = {y}.")
            done += 1
        elif op == "mul":
            k = rng.choice([2, 3])
            word = {2: "doubles", 3: "triples"}[k]
            y = x * k
            story.append(f"Then the number of {plur} {he} has {word}.")
            work.append(f"The number {word}, so {x} * {k} = {y}.")
            done += 1
        elif op == "div":
            k = rng.choice([k for k in (2, 3, 4, 5) if x % k == 0 and x // k >= 2])
            y = x // k
            story.append(f"{_cap(he)} splits {his} {plur} into {k} equal groups and keeps one group.")
            work.append(f"{_cap(he)} keeps one of {k} groups, so {x} / {k} = {y}.")
            done += 1
        else:  # bags: two computations
            k, b = rng.randint(2, 5), rng.randint(2, 12)
            c = k * b
            y = x + c
            story.append(f"{_cap(he)} buys {k} bags with {b} {plur} in each bag.")
            work.append(f"{k} bags of {b} is {k} * {b} = {c}, so {x} + {c} = {y}.")
            done += 2
        x = y
    question = " ".join(story) + f" How many {plur} does {name} have now?"
    work.append(f"The answer is {x}.")
    return Problem(question, "\n".join(work), x, steps)


def _shopping_problem(rng: random.Random, steps: int) -> Problem:
    """Prices times quantities, summed; with four steps, the change from a bill."""
    name = rng.choice(NAMES)
    (s1, p1n), (s2, p2n) = rng.sample(ITEMS, 2)
    p1, p2 = rng.randint(2, 15), rng.randint(2, 20)
    q1, q2 = rng.randint(2, 9), rng.randint(2, 9)
    c1, c2 = q1 * p1, q2 * p2
    if steps == 2:
        fee = rng.randint(2, 30)
        total = c1 + fee
        question = (f"A {s1} costs {p1} dollars. {name} buys {q1} {p1n} and pays {fee} dollars "
                    f"for delivery. How many dollars does {name} spend?")
        work = [f"{q1} {p1n} cost {q1} * {p1} = {c1} dollars.",
                f"With delivery, {c1} + {fee} = {total} dollars."]
        answer = total
    else:
        total = c1 + c2
        question = (f"A {s1} costs {p1} dollars and a {s2} costs {p2} dollars. "
                    f"{name} buys {q1} {p1n} and {q2} {p2n}.")
        work = [f"{q1} {p1n} cost {q1} * {p1} = {c1} dollars.",
                f"{q2} {p2n} cost {q2} * {p2} = {c2} dollars.",
                f"Together, {c1} + {c2} = {total} dollars."]
        if steps == 3:
            question += f" How many dollars does {name} spend?"
            answer = total
        else:
            bill = next(b for b in (50, 100, 200, 500) if b > total)
            change = bill - total
            question += (f" {name} pays with a {bill} dollar bill. "
                         f"How many dollars of change does {name} get?")
            work.append(f"The change is {bill} - {total} = {change} dollars.")
            answer = change
    work.append(f"The answer is {answer}.")
    return Problem(question, "\n".join(work), answer, steps)


def _rate_problem(rng: random.Random, steps: int) -> Problem:
    """A rate times a duration, then losses, then packing into groups."""
    maker, sing, plur = rng.choice(MACHINES)
    rate, hours = rng.randint(2, 20), rng.randint(2, 9)
    made = rate * hours
    bad = rng.randint(1, made - 1)
    good = made - bad
    question = (f"A {maker} makes {rate} {plur} each hour. It works for {hours} hours. "
                f"Then {bad} of the {plur} are broken.")
    work = [f"It makes {rate} * {hours} = {made} {plur}.",
            f"Without the broken ones, {made} - {bad} = {good}."]
    answer = good
    if steps >= 3:
        # Pack the good ones into groups of g; re-draw `bad` so the division is exact.
        g = rng.choice([g for g in (2, 3, 4, 5, 6) if made // g >= 2])
        good = g * rng.randint(1, (made - 1) // g)
        bad = made - good
        question = (f"A {maker} makes {rate} {plur} each hour. It works for {hours} hours. "
                    f"Then {bad} of the {plur} are broken.")
        work[1] = f"Without the broken ones, {made} - {bad} = {good}."
        packs = good // g
        question += f" The rest are packed in boxes of {g}. How many boxes are there?"
        work.append(f"In boxes of {g}, {good} / {g} = {packs} boxes.")
        answer = packs
        if steps == 4:
            price = rng.randint(2, 9)
            answer = packs * price
            question = question.replace(" How many boxes are there?",
                                        f" Each box sells for {price} dollars. "
                                        "How many dollars do the boxes bring?")
            work.append(f"They bring {packs} * {price} = {answer} dollars.")
    else:
        question += f" How many good {plur} are left?"
    work.append(f"The answer is {answer}.")
    return Problem(question, "\n".join(work), answer, steps)


def arithmetic_problem(rng: random.Random) -> Problem:
    steps = rng.randint(2, 4)
    family = rng.choices([_inventory_problem, _shopping_problem, _rate_problem], weights=[5, 3, 2])[0]
    return family(rng, steps)


def arithmetic_messages(p: Problem) -> list[dict]:
    return [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}]


# --------------------------------------------------------------------------------------
# Chat turns
# --------------------------------------------------------------------------------------
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a small, friendly assistant.",
                  "Answer briefly."]


def _chat_exchange(rng: random.Random) -> tuple[str, str]:
    """One (user, assistant) instruction-following exchange."""
    kind = rng.randrange(11)
    if kind == 0:
        w, n = rng.choice(CHAT_WORDS), rng.randint(2, 6)
        return f"Repeat the word {w} {NUMBER_WORDS[n]} times.", " ".join([w] * n)
    if kind == 1:
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        return f"What is {a} plus {b}?", f"{a} + {b} = {a + b}. The answer is {a + b}."
    if kind == 2:
        a = rng.randint(1, 60)
        b = rng.randint(0, a)
        return f"What is {a} minus {b}?", f"{a} - {b} = {a - b}. The answer is {a - b}."
    if kind == 3:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"What is {a} times {b}?", f"{a} * {b} = {a * b}. The answer is {a * b}."
    if kind == 4:
        items = rng.sample(CHAT_WORDS if rng.random() < 0.5 else [str(i) for i in range(1, 30)],
                           rng.randint(2, 6))
        return f"Reverse the list: {', '.join(items)}.", ", ".join(reversed(items))
    if kind == 5:
        name = rng.choice(NAMES)
        return f"Say hello to {name}.", f"Hello, {name}!"
    if kind == 6:
        n = rng.randint(0, 98)
        return f"What number comes after {n}?", f"{n + 1} comes after {n}."
    if kind == 7:
        nums = [rng.randint(0, 99) for _ in range(rng.randint(2, 6))]
        return (f"Sort these numbers from smallest to largest: {', '.join(map(str, nums))}.",
                ", ".join(map(str, sorted(nums))))
    if kind == 8:
        a, b = rng.sample(range(100), 2)
        return f"Which is larger, {a} or {b}?", f"{max(a, b)} is larger."
    if kind == 9:
        items = rng.sample(CHAT_WORDS, rng.randint(2, 7))
        return (f"How many words are in this list: {', '.join(items)}?",
                f"There are {len(items)} words.")
    return rng.choice([
        ("Who are you?", "I am kvlm-tiny, a small language model. I solve arithmetic problems "
                         "and remember pass keys."),
        ("What can you do?", "I can solve short arithmetic word problems, find pass keys in long "
                             "texts, and follow simple instructions."),
        ("Hello!", "Hello! How can I help you?"),
        ("Thank you.", "You are welcome."),
    ])


def chat_messages(rng: random.Random) -> list[dict]:
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice([1, 1, 2, 3])):
        user, assistant = _chat_exchange(rng)
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return msgs


# --------------------------------------------------------------------------------------
# Prose (plain documents and recall haystacks)
# --------------------------------------------------------------------------------------
@dataclass
class Cast:
    """The people and town a prose document keeps coming back to."""
    names: list[str]
    town: str
    other_town: str
    pet: str
    pet_name: str


def new_cast(rng: random.Random) -> Cast:
    names = rng.sample(NAMES, 4)
    town, other = rng.sample(TOWNS, 2)
    return Cast(names[:3], town, other, rng.choice(ANIMALS), names[3])


def prose_sentence(rng: random.Random, c: Cast) -> str:
    n, n2 = rng.sample(c.names, 2)
    k = rng.randrange(22)
    if k == 0:
        return f"{n} walked to the {rng.choice(PLACES)} in the {rng.choice(TIMES)}."
    if k == 1:
        return f"The {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} slept near the {rng.choice(PLACES)}."
    if k == 2:
        return f"{n} and {n2} talked about the {rng.choice(TOPICS)} for a long time."
    if k == 3:
        return f"In {c.town}, the {rng.choice(BUILDINGS)} opens at {rng.randint(6, 11)} o'clock."
    if k == 4:
        return f"{n} bought {rng.randint(2, 30)} {rng.choice(OBJECTS)[1]} at the market."
    if k == 5:
        return f"It was a {rng.choice(WEATHER)} day in {c.town}."
    if k == 6:
        return f"{n} told {n2} a story about a {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)}."
    if k == 7:
        return f"The {rng.choice(BUILDINGS)} in {c.town} was painted {rng.choice(COLORS)}."
    if k == 8:
        return f"{n} likes to {rng.choice(ACTIVITIES)} on {rng.choice(DAYS)}."
    if k == 9:
        return f"After {rng.choice(MEALS)}, {n} went to the {rng.choice(PLACES)}."
    if k == 10:
        return f"The road from {c.town} to {c.other_town} is {rng.randint(3, 90)} miles long."
    if k == 11:
        return f"{n} wrote a letter to {n2} about the {rng.choice(TOPICS)}."
    if k == 12:
        return f"Every {rng.choice(DAYS)}, {n} visits the {rng.choice(PLACES)}."
    if k == 13:
        return f"A {rng.choice(COLORS)} {rng.choice(VEHICLES)} stopped near the {rng.choice(PLACES)}."
    if k == 14:
        return f"{n} found a {rng.choice(ADJECTIVES)} {rng.choice(THINGS)} in the {rng.choice(PLACES)}."
    if k == 15:
        return f"Many people in {c.town} work as a {rng.choice(JOBS)}."
    if k == 16:
        return f"{n2} smiled at {n} and said that the {rng.choice(TOPICS)} was {rng.choice(OPINIONS)}."
    if k == 17:
        return f"The {rng.choice(ANIMALS)} ran across the {rng.choice(LANDSCAPES)}."
    if k == 18:
        return f"{c.pet_name} the {c.pet} followed {n} to the {rng.choice(PLACES)}."
    if k == 19:
        return f"On {rng.choice(DAYS)}, it was {rng.choice(WEATHER)} in {c.town}."
    if k == 20:
        return f"{n} is a {rng.choice(JOBS)} and lives in {c.town}."
    return f"{n} gave {n2} a {rng.choice(COLORS)} {rng.choice(THINGS)}."


def prose_paragraph(rng: random.Random, c: Cast) -> list[str]:
    """A paragraph as a list of sentences (joined with spaces, ended by a blank line)."""
    return [prose_sentence(rng, c) for _ in range(rng.randint(3, 6))]


def join_paragraph(sentences: list[str]) -> str:
    # Paragraphs end in ".\n\n", one pre-token of the tokenizer's regex, and the next one
    # starts with a letter: token ids of consecutive paragraphs concatenate exactly.
    return " ".join(sentences) + "\n\n"


def prose_text(rng: random.Random, n_paragraphs: int) -> str:
    c = new_cast(rng)
    return "".join(join_paragraph(prose_paragraph(rng, c)) for _ in range(n_paragraphs))


# --------------------------------------------------------------------------------------
# Recall
# --------------------------------------------------------------------------------------
RECALL_HEADER = "Read the text and remember the pass keys.\n\n"


def key_sentence(vault: str, key: str) -> str:
    return f"The pass key for the {vault} vault is {key}."


def recall_question(vault: str) -> str:
    return f"What is the pass key for the {vault} vault?"


@dataclass
class RecallDoc:
    prompt: str        # ChatML, ending with "<|im_start|>assistant\n"
    answer_text: str   # the assistant turn's content
    key: str
    prompt_ids: list[int]
    answer_ids: list[int]   # answer_text + "<|im_end|>\n"
    # Follow-up questions (training only): (ids of "<|im_start|>user\n<question><|im_end|>\n
    # <|im_start|>assistant\n", ids of "<answer><|im_end|>\n"), each about another key.
    turns: list[tuple[list[int], list[int]]] = field(default_factory=list)
    followups: list[tuple[str, str]] = field(default_factory=list)  # (question, answer) texts
    vaults: list[str] = field(default_factory=list)   # every vault with a key in the haystack

    def ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids + [i for q, a in self.turns for i in q + a]

    def text(self) -> str:
        """The whole document as ChatML text (what ids() tokenizes to)."""
        return (self.prompt + self.answer_text + IM_END + "\n"
                + "".join(render_chat([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
                          for q, a in self.followups))


def recall_doc(rng: random.Random, tok, max_tokens: int, depth: float | None = None,
               prompt_only: bool = False, n_keys: int | None = None, n_questions: int = 1,
               vault_pool: list[str] | None = None) -> RecallDoc:
    """A recall document of at most `max_tokens` tokens in all (prompt, answer and follow-up
    turns).

    The haystack grows paragraph by paragraph (each tokenized once) until the next one would
    not fit; key sentences go into random paragraphs, the asked one at relative `depth` if
    given (0 = first paragraph, 1 = last). The document comes out at most one paragraph
    (~40-90 tokens) shorter than `max_tokens`; with `prompt_only` the limit applies to the
    prompt alone (evaluation sets). `tok` is a `tokenizers.Tokenizer`.

    `n_keys` (default: 1, 1, 2 or 3 at random) keys are hidden, their vault names drawn from
    `vault_pool` (default all); with `n_questions` > 1, up to n_questions - 1 other keys are
    asked for in follow-up user turns. The defaults draw exactly what the evaluation sets
    have always drawn, so the same seed gives the same evaluation prompts.
    """
    if n_keys is None:
        n_keys = rng.choice([1, 1, 2, 3])
    vaults = rng.sample(VAULTS if vault_pool is None else vault_pool, n_keys)
    keys = [str(rng.randint(10000, 99999)) for _ in vaults]
    asked = rng.randrange(n_keys)
    followups = []
    if n_questions > 1 and n_keys > 1:
        followups = rng.sample([i for i in range(n_keys) if i != asked], min(n_questions - 1, n_keys - 1))
    question = recall_question(vaults[asked])
    answer_text = key_sentence(vaults[asked], keys[asked])
    head = f"{IM_START}user\n{RECALL_HEADER}"
    tail = f"{question}{IM_END}\n{IM_START}assistant\n"
    head_ids = tok.encode(head, add_special_tokens=False).ids
    tail_ids = tok.encode(tail, add_special_tokens=False).ids
    answer_ids = tok.encode(answer_text + IM_END + "\n", add_special_tokens=False).ids
    texts = [(recall_question(vaults[i]), key_sentence(vaults[i], keys[i])) for i in followups]
    turns = [(tok.encode(f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n", add_special_tokens=False).ids,
              tok.encode(a + IM_END + "\n", add_special_tokens=False).ids) for q, a in texts]
    answer_cost = 0 if prompt_only else len(answer_ids) + sum(len(q) + len(a) for q, a in turns)
    # Room for the key sentences (~12 tokens each, re-measured below).
    budget = max_tokens - len(head_ids) - len(tail_ids) - answer_cost - 14 * n_keys
    cast = new_cast(rng)
    paragraphs: list[list[str]] = []
    para_ids: list[list[int]] = []
    used = 0
    # Paragraphs are drawn and tokenized 8 at a time (fewer for short training documents,
    # whose unused paragraphs would be wasted work; the evaluation sets keep 8, so their
    # random draws stay what they have always been).
    n_batch = 8 if prompt_only else max(2, min(8, budget // 45 + 1))
    while True:
        batch = [prose_paragraph(rng, cast) for _ in range(n_batch)]
        encoded = tok.encode_batch([join_paragraph(p) for p in batch], add_special_tokens=False)
        stop = False
        for p, e in zip(batch, encoded):
            if used + len(e.ids) > budget:
                stop = True
                break
            paragraphs.append(p)
            para_ids.append(e.ids)
            used += len(e.ids)
        if stop:
            break
    if not paragraphs:  # a very small budget: one short paragraph regardless
        paragraphs = [[prose_sentence(rng, cast)]]
        para_ids = [tok.encode(join_paragraph(paragraphs[0]), add_special_tokens=False).ids]
    # Insert the key sentences, each into its own paragraph when there are enough.
    n = len(paragraphs)
    slots = rng.sample(range(n), n_keys) if n >= n_keys else [rng.randrange(n) for _ in range(n_keys)]
    if depth is not None:
        target = min(n - 1, int(round(depth * (n - 1))))
        if target in slots:
            slots[slots.index(target)] = slots[asked]
        slots[asked] = target
    for vault, key, slot in zip(vaults, keys, slots):
        sentences = paragraphs[slot]
        sentences.insert(rng.randint(0, len(sentences)), key_sentence(vault, key))
    for slot in set(slots):
        para_ids[slot] = tok.encode(join_paragraph(paragraphs[slot]), add_special_tokens=False).ids
    body = "".join(join_paragraph(p) for p in paragraphs)
    prompt = head + body + tail
    prompt_ids = head_ids + [i for ids in para_ids for i in ids] + tail_ids
    doc = RecallDoc(prompt, answer_text, keys[asked], prompt_ids, answer_ids, turns, texts, vaults)
    # The key sentences may have cost a few more tokens than reserved: drop paragraphs that
    # hold no key from the end until the document fits.
    while len(doc.prompt_ids) + answer_cost > max_tokens and len(paragraphs) > 1:
        last = len(paragraphs) - 1
        drop = next((i for i in range(last, -1, -1) if i not in slots), None)
        if drop is None:
            break
        del paragraphs[drop], para_ids[drop]
        slots = [s - 1 if s > drop else s for s in slots]
        body = "".join(join_paragraph(p) for p in paragraphs)
        doc.prompt = head + body + tail
        doc.prompt_ids = head_ids + [i for ids in para_ids for i in ids] + tail_ids
    return doc


# --------------------------------------------------------------------------------------
# Token-level documents and packed training rows
# --------------------------------------------------------------------------------------
def chat_ids_kinds(tok, messages: list[dict], answer_kind: int) -> tuple[list[int], list[int]]:
    """Token ids of a rendered ChatML document plus <|endoftext|>, and each token's kind.

    Assistant contents (and their <|im_end|>) get `answer_kind`; everything else KIND_TEXT.
    Each message is encoded separately: special tokens split the text, so ids concatenate.
    """
    ids: list[int] = []
    kinds: list[int] = []
    for m in messages:
        head = tok.encode(f"{IM_START}{m['role']}\n", add_special_tokens=False).ids
        body = tok.encode(f"{m['content']}{IM_END}", add_special_tokens=False).ids
        nl = tok.encode("\n", add_special_tokens=False).ids
        kind = answer_kind if m["role"] == "assistant" else KIND_TEXT
        ids += head + body + nl
        kinds += [KIND_TEXT] * len(head) + [kind] * len(body) + [KIND_TEXT] * len(nl)
    eot = tok.token_to_id(EOT)
    return ids + [eot], kinds + [KIND_TEXT]


def encode_doc_text(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


@dataclass
class Mix:
    """Training mixture and curriculum (see README.md).

    recall_share: expected fraction of a row's tokens in recall documents.
    The remaining tokens are filled with short documents, drawn per document with the
    probabilities below (set so arithmetic gets ~60% of those tokens).
    """
    seq_len: int = 8192
    recall_share: float = 0.45
    recall_min: int = 128
    recall_start_max: int = 1024     # longest recall document while the recall circuit forms
    recall_hold: float = 0.25        # fraction of training spent at recall_start_max
    recall_ramp: float = 0.65        # fraction of training after which the longest is seq_len
    recall_log_lengths: bool = True  # lengths log-uniform in [recall_min, longest], not uniform
    p_frontier: float = 0.3          # share of recall documents drawn near the longest length
    recall_keys: tuple = (1, 4)      # keys hidden per training document (min, max)
    recall_questions: int = 3        # questions per training document (at most)
    unique_vaults: bool = True       # no vault name twice in a row
    recall_weight: float = 5.0       # loss weight of recall answers (key digits and the rest)
    p_arith: float = 0.62
    p_chat: float = 0.33             # prose gets the rest
    prose_max_paragraphs: int = 24

    def recall_max(self, progress: float) -> int:
        span = self.recall_ramp - self.recall_hold
        f = min(1.0, max(0.0, (progress - self.recall_hold) / span)) if span > 0 else 1.0
        return int(self.recall_start_max + f * (self.seq_len - self.recall_start_max))


class RowBuilder:
    """Builds packed training rows of seq_len + 1 tokens from whole documents.

    A row holds recall documents (about `recall_share` of its tokens on average), short
    documents (arithmetic, chat, prose) in random order, and, at the end, a prose chunk cut
    to fill the row exactly. Documents are never split across rows, so every recall question
    sees its keys. Returns (ids, kinds), kinds[i] being the kind of token i.
    """

    def __init__(self, tok, mix: Mix):
        self.tok = tok
        self.mix = mix
        self.eot = tok.token_to_id(EOT)
        self.digits = {tok.token_to_id(str(d)) for d in range(10)}
        if None in self.digits:
            raise RuntimeError("the tokenizer has no single-digit token for some digit")

    def short_doc(self, rng: random.Random) -> tuple[list[int], list[int]]:
        r = rng.random()
        if r < self.mix.p_arith:
            return chat_ids_kinds(self.tok, arithmetic_messages(arithmetic_problem(rng)), KIND_ARITH)
        if r < self.mix.p_arith + self.mix.p_chat:
            return chat_ids_kinds(self.tok, chat_messages(rng), KIND_CHAT)
        ids = encode_doc_text(self.tok, prose_text(rng, rng.randint(1, self.mix.prose_max_paragraphs)))
        ids.append(self.eot)
        return ids, [KIND_TEXT] * len(ids)

    def answer_kinds(self, answer_ids: list[int]) -> list[int]:
        """Kinds of "<answer><|im_end|>\n": the key's digits KIND_KEY, the rest of the answer
        and <|im_end|> KIND_RECALL, the newline KIND_TEXT."""
        return [KIND_KEY if i in self.digits else KIND_RECALL for i in answer_ids[:-1]] + [KIND_TEXT]

    def recall_ids(self, rng: random.Random, max_tokens: int,
                   pool: list[str] | None = None) -> tuple[list[int], list[int], list[str]] | None:
        """A recall document plus <|endoftext|> in at most max_tokens (ids, kinds, its vault
        names), or None if a few draws all came out too long (possible only for very small
        limits: the key sentences cannot be dropped). Vault names come from `pool`."""
        lo, hi = self.mix.recall_keys
        hi = min(hi, len(pool)) if pool is not None else hi
        if hi < 1:
            return None
        for _ in range(8):
            n_keys = rng.randint(min(lo, hi), hi)
            n_q = rng.randint(1, max(1, min(n_keys, self.mix.recall_questions)))
            d = recall_doc(rng, self.tok, max_tokens - 1, n_keys=n_keys, n_questions=n_q,
                           vault_pool=pool)  # - 1: the <|endoftext|>
            if len(d.ids()) <= max_tokens - 1:
                break
        else:
            return None
        ids = d.ids() + [self.eot]
        kinds = [KIND_TEXT] * len(d.prompt_ids) + self.answer_kinds(d.answer_ids)
        for q, a in d.turns:
            kinds += [KIND_TEXT] * len(q) + self.answer_kinds(a)
        kinds.append(KIND_TEXT)
        return ids, kinds, d.vaults

    def recall_length(self, rng: random.Random, longest: int) -> int:
        lo = self.mix.recall_min
        if rng.random() < self.mix.p_frontier:  # near the current longest length
            return rng.randint(max(lo, int(longest * 0.85)), max(lo, longest))
        if self.mix.recall_log_lengths:
            return int(math.exp(rng.uniform(math.log(lo), math.log(max(lo, longest)))))
        return rng.randint(lo, max(lo, longest))

    def row(self, rng: random.Random, progress: float) -> tuple[list[int], list[int]]:
        cap = self.mix.seq_len + 1
        docs: list[tuple[list[int], list[int]]] = []
        used = 0
        # Recall documents: a random token budget per row, uniform in [0, 2 * share * cap].
        # A document longer than what is left of the budget is taken with probability
        # left / length, so the expected recall tokens per row match the budget without
        # biasing the lengths towards short documents.
        recall_budget = rng.random() * 2 * self.mix.recall_share * cap
        longest = self.mix.recall_max(progress)
        recall_used = 0
        pool = list(VAULTS) if self.mix.unique_vaults else None
        while cap - used >= self.mix.recall_min + 16:
            length = min(self.recall_length(rng, longest), cap - used)
            left = recall_budget - recall_used
            if left <= 0 or (length > left and rng.random() >= left / length):
                break
            d = self.recall_ids(rng, length, pool)
            if d is None:
                break
            docs.append(d[:2])
            used += len(d[0])
            recall_used += len(d[0])
            if pool is not None:
                pool = [v for v in pool if v not in d[2]]
        # Short documents until the next one does not fit.
        while True:
            d = self.short_doc(rng)
            if used + len(d[0]) > cap:
                break
            docs.append(d)
            used += len(d[0])
        rng.shuffle(docs)
        ids = [i for d in docs for i in d[0]]
        kinds = [k for d in docs for k in d[1]]
        # Fill the rest with the start of a prose document.
        while len(ids) < cap:
            need = cap - len(ids)
            filler = encode_doc_text(self.tok, prose_text(rng, max(1, need // 50 + 1)))
            ids += filler[:need]
            kinds += [KIND_TEXT] * min(need, len(filler))
        if len(ids) != cap or len(kinds) != cap:
            raise RuntimeError(f"packed row has {len(ids)} tokens, expected {cap}")
        return ids, kinds


# --------------------------------------------------------------------------------------
# Tokenizer training text and evaluation sets
# --------------------------------------------------------------------------------------
def tokenizer_training_texts(rng: random.Random, n_docs: int) -> list[str]:
    """Rendered documents of every kind, for training the BPE tokenizer."""
    texts = []
    for i in range(n_docs):
        k = i % 4
        if k == 0:
            texts.append(render_chat(arithmetic_messages(arithmetic_problem(rng))))
        elif k == 1:
            texts.append(render_chat(chat_messages(rng)))
        elif k == 2:
            texts.append(prose_text(rng, rng.randint(1, 6)))
        else:
            cast = new_cast(rng)
            body = [prose_paragraph(rng, cast) for _ in range(3)]
            vault, key = rng.choice(VAULTS), str(rng.randint(10000, 99999))
            body[1].insert(1, key_sentence(vault, key))
            texts.append(render_chat([
                {"role": "user", "content": RECALL_HEADER + "".join(join_paragraph(p) for p in body)
                 + recall_question(vault)},
                {"role": "assistant", "content": key_sentence(vault, key)}]))
    # Every vault name, word and number form at least once.
    texts.append(" ".join(VAULTS + CHAT_WORDS + NUMBER_WORDS))
    return texts


@dataclass
class EvalSizes:
    arithmetic: int = 100
    recall: dict | None = None       # name -> (n_items, min_tokens, max_tokens)
    heldout_chars: int = 150_000

    def __post_init__(self):
        if self.recall is None:
            self.recall = {"recall_1k": (100, 900, 1024), "recall_4k": (50, 3700, 4096),
                           "recall_8k": (50, 7300, 8100)}


def build_eval_sets(out_dir: str, tok, seed: int, sizes: EvalSizes) -> dict:
    """Writes arithmetic.jsonl, recall_*.jsonl and heldout.txt under out_dir.

    Prompts are ChatML, already rendered with the generation prompt. The recall items'
    asked keys sit at evenly spaced depths (0 to 1) through the haystack. Returns a summary.
    """
    os.makedirs(out_dir, exist_ok=True)
    summary = {}
    rng = random.Random(f"eval-arithmetic-{seed}")
    with open(os.path.join(out_dir, "arithmetic.jsonl"), "w") as f:
        for _ in range(sizes.arithmetic):
            p = arithmetic_problem(rng)
            prompt = render_chat([{"role": "user", "content": p.question}], add_generation_prompt=True)
            f.write(json.dumps({"prompt": prompt, "answer": str(p.answer), "regex": ARITH_REGEX}) + "\n")
    summary["arithmetic"] = {"items": sizes.arithmetic}
    for name, (n, lo, hi) in sizes.recall.items():
        rng = random.Random(f"eval-{name}-{seed}")
        lengths = []
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w") as f:
            for i in range(n):
                depth = i / (n - 1) if n > 1 else 0.5
                # Draw until the prompt is within [lo, hi] tokens (the answer is extra).
                for _ in range(20):
                    d = recall_doc(rng, tok, hi, depth=depth, prompt_only=True)
                    if lo <= len(d.prompt_ids) <= hi:
                        break
                else:
                    raise RuntimeError(f"{name}: could not make a prompt of {lo}-{hi} tokens")
                lengths.append(len(d.prompt_ids))
                f.write(json.dumps({"prompt": d.prompt, "answer": d.key, "regex": RECALL_REGEX}) + "\n")
        summary[name] = {"items": n, "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths)}
    rng = random.Random(f"eval-heldout-{seed}")
    parts, size = [], 0
    while size < sizes.heldout_chars:
        t = prose_text(rng, rng.randint(20, 60))
        parts.append(t)
        size += len(t)
    heldout = "".join(parts)
    with open(os.path.join(out_dir, "heldout.txt"), "w") as f:
        f.write(heldout)
    summary["heldout"] = {"chars": len(heldout), "tokens": len(tok.encode(heldout).ids)}
    return summary


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def extract(regex: str, completion: str) -> str | None:
    m = re.search(regex, completion)
    if not m:
        return None
    return m.group(1) if m.groups() else m.group(0)


if __name__ == "__main__":
    # Print a few documents of each kind: python3 tools/train/corpus.py [seed]
    import sys
    r = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for _ in range(3):
        print(render_chat(arithmetic_messages(arithmetic_problem(r))))
    for _ in range(3):
        print(render_chat(chat_messages(r)))
    print(prose_text(r, 2))
