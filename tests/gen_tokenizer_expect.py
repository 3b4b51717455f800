#!/usr/bin/env python3
"""Generates the expected values of tests/tokenizer_test.cc (dev only).

The test itself needs no Python: this script was run once and its output is
hard-coded in the test between the BEGIN/END GENERATED markers.  Rerun it only
when the cases change:

    python3 tests/gen_tokenizer_expect.py [--gguf PATH] --write tests/tokenizer_test.cc

It reads SmolLM2's tokenizer from the GGUF (gguf 0.x, GGUFReader), builds the
same tokenizer with Hugging Face `tokenizers` (BPE with the GGUF's vocab and
merges, unk = tokenizer.ggml.unknown_token_id, pre-tokenizer
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)], the token_type 3 entries as special added tokens) and
computes the ids of each case with it, and renders the GGUF's chat template
with jinja2 (trim_blocks and lstrip_blocks, as transformers does).
Needs: pip install gguf tokenizers jinja2.
"""

import argparse
import os
import re
import sys

from gguf import GGUFReader
import jinja2
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, text, parse_special)
CASES = [
    ("English", "The quick brown fox jumps over the lazy dog.", True),
    ("Sentence", "Hello, world! This is SmolLM2, a small language model from Hugging Face.", True),
    ("Contractions", "I'm sure they'll say it's fine, but we'd rather you'd've asked. Don't; can't; won't.", True),
    ("UpperContractions", "DON'T SHOUT: I'M HERE AND YOU'RE THERE", True),
    ("Date", "2026-12-01 12345", True),
    ("Numbers", "Version 3.14159 costs $1,299.99 (about 1e-5 per unit), 42% off!", True),
    ("SpaceRuns", "   leading, inner   runs,   and trailing   ", True),
    ("Newlines", "line one\nline two\n\n\tindented with a tab\r\nwindows line\n   \n", True),
    ("Punctuation", "Wait... what?! (Really) [yes] {no} <maybe> \"quoted\" 'single' -- semi; colon: a/b\\c", True),
    ("NonAscii", "naïve café — 日本語 🙂", True),
    ("Scripts", "Привет, мир! Γειά σου κόσμε. שלום עולם. مرحبا بالعالم. नमस्ते दुनिया. 안녕하세요", True),
    ("EmojiSequences", "👩‍💻 coder, 🏳️‍🌈 flag, 🇫🇷 France, 👍🏽 thumbs", True),
    ("FourByte", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 𓀀 and 𝟙𝟚𝟛", True),
    ("UnicodeSpacesAndDigits", "a\u00a0b\u2003c\u3000d \u180e e\u200bf ١٢٣ ½ ² Ⅻ", True),
    ("Code", "def square(x):\n    return x ** 2  # TODO: check\n\nprint(square(12))\n", True),
    ("ChatPrompt",
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", True),
    ("ChatPromptAsText",
     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", False),
    ("AdjacentAndPartialSpecials", "<|im_end|><|endoftext|><jupyter_code>x<|im_start <|im_end|", True),
    ("Empty", "", True),
    ("LongWhitespace", "x" + " " * 40 + "y\n\n\n\n", True),
    ("BytesWithoutSymbol", "a\x04b\x1d!", True),
]

# Fuzz strings: FUZZ_COUNT strings of 1..40 items from FUZZ_POOL, picked by
# a 64-bit LCG that the test reimplements (fuzz_strings there); string i is
# encoded with parse_special = (i % 2 == 0).
FUZZ_POOL = (list("abcXYZ019 '\t\n\r\v\f.,!?-_()[]{}<>|/\\\"$%&*+=~`^@#")
             + ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<jupyter_code>", "<|", "|>", "  ", "the", " the", "ing"]
             + [chr(c) for c in [
                 0xa0, 0x85, 0x2028, 0x2029, 0x3000, 0x2003, 0x180e, 0x200b, 0x200d, 0xfeff,
                 0x1680, 0x202f, 0x205f, 0x0301, 0x0308, 0x0663, 0x00bd, 0x00b2, 0x2167,
                 0x1f642, 0x1f469, 0x1f3f3, 0xfe0f, 0x1f1eb, 0x4e2d, 0x65e5, 0x0416, 0x03b1,
                 0x05d0, 0x0627, 0x0915, 0x093f, 0xac00, 0x1100, 0x10348, 0x1d400, 0xe9, 0xdf,
                 0xff, 0x0100, 0x7f, 0x1b, 0x1f, 0x2060, 0xad, 0x2212, 0x2014, 0x2026,
                 0x201c, 0xa9, 0x20ac, 0xe000, 0x10ffff, 0xfffd, 0x40000, 0x04]])
FUZZ_COUNT = 20000
# Every code point but the surrogates, in blocks of SWEEP_BLOCK, each code
# point c in the context SWEEP_CONTEXT (the test builds the same strings).
SWEEP_BLOCK = 64


def sweep_context(c):
    return "x%s %s%s! %s1'%s\n" % (c, c, c, c, c)


def fuzz_strings():
    x = 20261201
    out = []

    def next_value():
        nonlocal x
        x = (x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return x >> 33

    for _ in range(FUZZ_COUNT):
        n = 1 + next_value() % 40
        out.append("".join(FUZZ_POOL[next_value() % len(FUZZ_POOL)] for _ in range(n)))
    return out


def sweep_strings():
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    return ["".join(sweep_context(chr(c)) for c in cps[i:i + SWEEP_BLOCK])
            for i in range(0, len(cps), SWEEP_BLOCK)]


TEXTS = ["apache-2.0.txt", "gpl-3.0-preamble.txt"]  # in data/
PROMPTS = "data/prompts/chat.txt"


def default_gguf():
    p = os.environ.get("KVXFER_SMOLLM2_GGUF")
    if p:
        return p
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
    return os.path.join(cache, "kvxfer", "SmolLM2-135M-Instruct.Q4_1.gguf")


def load(path):
    f = GGUFReader(path).fields
    tokens = f["tokenizer.ggml.tokens"].contents()
    types = f["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in f["tokenizer.ggml.merges"].contents()]
    unk = tokens[f["tokenizer.ggml.unknown_token_id"].contents()]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=unk, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok, f["tokenizer.chat_template"].contents()


def encode(tok, text, parse_special):
    tok.encode_special_tokens = not parse_special
    return tok.encode(text, add_special_tokens=False).ids


def c_string(s):
    """A C++ string literal of the UTF-8 bytes of s (octal escapes, never ambiguous)."""
    out = []
    for b in s.encode("utf-8"):
        c = chr(b)
        if c == "\\":
            out.append("\\\\")
        elif c == '"':
            out.append('\\"')
        elif c in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[c])
        elif c == "?":
            out.append("\\?")  # no trigraphs
        elif 0x20 <= b < 0x7F:
            out.append(c)
        else:
            out.append("\\%03o" % b)
    return '"' + "".join(out) + '"'


def c_ids(ids, indent):
    lines, line = [], []
    for i in ids:
        line.append(str(i))
        if len(line) == 12:
            lines.append(", ".join(line))
            line = []
    if line:
        lines.append(", ".join(line))
    if not lines:
        return "{}"
    pad = " " * indent
    return "{" + (",\n" + pad).join(lines) + "}"


def fnv1a(ids, h=0xCBF29CE484222325):
    for i in ids:
        for byte in (i & 0xFFFFFFFF).to_bytes(4, "little"):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def render(template, messages):
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def generate(gguf_path):
    tok, template = load(gguf_path)
    out = ["// BEGIN GENERATED by tests/gen_tokenizer_expect.py (HF tokenizers %s, jinja2 %s)"
           % (sys.modules["tokenizers"].__version__, jinja2.__version__),
           "// clang-format off"]
    out.append("const Case kCases[] = {")
    for name, text, special in CASES:
        ids = encode(tok, text, special)
        out.append("    {\"%s\", %s, %s,\n     %s}," % (name, c_string(text),
                                                    "true" if special else "false", c_ids(ids, 6)))
    out.append("};")
    out.append("")
    out.append("const TextExpect kTexts[] = {")
    for rel in TEXTS:
        with open(os.path.join(ROOT, "data", rel), encoding="utf-8", newline="") as f:
            ids = encode(tok, f.read(), True)
        out.append("    {\"%s\", %d, 0x%016xull, %s, %s}," % (rel, len(ids), fnv1a(ids),
                                                         c_ids(ids[:8], 6), c_ids(ids[-8:], 6)))
    out.append("};")
    out.append("")
    out.append("// %d fuzz strings (fuzz_strings), and every code point in context (sweep_strings):"
               % FUZZ_COUNT)
    out.append("// total ids and FNV-1a 64 over all ids in order.")
    out.append("const char* const kFuzzPool[] = {")
    out.append("    " + ",\n    ".join(", ".join(c_string(p) for p in FUZZ_POOL[i:i + 8])
                                       for i in range(0, len(FUZZ_POOL), 8)) + "};")
    for name, strings, specials in (
            ("kFuzz", fuzz_strings(), lambda i: i % 2 == 0),
            ("kSweep", sweep_strings(), lambda i: True)):
        total, h = 0, 0xCBF29CE484222325
        for i, text in enumerate(strings):
            ids = encode(tok, text, specials(i))
            total += len(ids)
            h = fnv1a(ids, h)
        out.append("const IdsDigest %s = {%d, 0x%016xull};" % (name, total, h))
    out.append("")
    with open(os.path.join(ROOT, PROMPTS), encoding="utf-8", newline="") as f:
        prompt = f.readline().rstrip("\n")
    default = render(template, [{"role": "user", "content": prompt}])
    custom = render(template, [{"role": "system", "content": "Answer in one sentence."},
                               {"role": "user", "content": prompt}])
    empty = render(template, [{"role": "system", "content": ""},
                              {"role": "user", "content": "Hi"}])
    out.append("// The GGUF's tokenizer.chat_template.")
    out.append("const char kSmolLM2Template[] = %s;" % c_string(template))
    out.append("// jinja2 renders of it (add_generation_prompt=True) for the first line of %s:" % PROMPTS)
    out.append("// [user], [system \"Answer in one sentence.\", user], and [system \"\", user \"Hi\"].")
    out.append("const char kChatDefault[] = %s;" % c_string(default))
    out.append("const char kChatCustom[] = %s;" % c_string(custom))
    out.append("const char kChatEmptySystem[] = %s;" % c_string(empty))
    out.append("const std::vector<std::int32_t> kChatDefaultIds = %s;"
               % c_ids(encode(tok, default, True), 4))
    out.append("// clang-format on")
    out.append("// END GENERATED")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", default=default_gguf())
    ap.add_argument("--write", metavar="TEST_CC",
                    help="replace the generated block of this file instead of printing it")
    args = ap.parse_args()
    block = generate(args.gguf)
    if not args.write:
        sys.stdout.write(block)
        return
    with open(args.write, encoding="utf-8") as f:
        src = f.read()
    pattern = re.compile(r"// BEGIN GENERATED.*?// END GENERATED\n", re.S)
    if not pattern.search(src):
        sys.exit("%s has no BEGIN/END GENERATED block" % args.write)
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(pattern.sub(lambda _: block, src, count=1))


if __name__ == "__main__":
    main()
