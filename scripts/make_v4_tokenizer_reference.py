#!/usr/bin/env python3
"""Reference token ids of the DeepSeek-V4 tokenizer, from the Python `tokenizers` library.

Writes tests/fixtures/deepseek-v4-tokenizer/reference_ids.json, which the Rust tests compare
against (`cargo test -p deepseek-v41 --lib tokenizer`). Not run by CI; rerun by hand:

    pip install --target /tmp/pytok tokenizers==0.23.3
    PYTHONPATH=/tmp/pytok python3 scripts/make_v4_tokenizer_reference.py

The Python package is the same Rust core with the Oniguruma regex engine; the Rust crate here is
built with fancy-regex instead, so matching ids also checks the regex engines agree.

It also records a checksum of the Engram compressed token map (spec 9.1), computed here exactly
as the reference `build_compressed_token_map` does (decode each id alone, keep specials; raw
token string if the text holds U+FFFD; else the normalizer sequence below; first-seen order).
"""

import gzip
import json
import pathlib

import tokenizers
from tokenizers import Regex, Tokenizer, normalizers

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests/fixtures/deepseek-v4-tokenizer"
MODEL = ROOT / "models/v41-shakespeare-tiny"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def cases():
    golden = json.loads((MODEL / "golden_greedy.json").read_text())
    out = [p["prompt"] for p in golden["prompts"]]
    out += [p["prompt"] + p["new_text"] for p in golden["prompts"]]
    out += [
        "",
        " ",
        "Hello world",
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces, trailing spaces   ",
        "tabs\tand\t\ttabs\n\nnew\r\nlines\r\n\n\n   \n",
        "numbers: 1 12 123 1234 12345 3.14159 -42 1e-20 0x1F 2026-11-29",
        "naïve café résumé Ångström façade Ñandú Straße ÆØÅ",
        "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
        "中文分词测试：我爱北京天安门。",
        "日本語のテキスト、ひらがなとカタカナ。東京タワー",
        "한국어 문장입니다.",
        "emoji: 🦀🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨",
        "fullwidth ＡＢＣ１２３ and ligatures ﬁ ﬂ, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, combining e\u0301 vs é",
        "zero\u200bwidth\u200djoiner and nbsp\u00a0here, nel\u0085, bom\ufeff",
        "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * i).collect();\n    println!(\"{x:?}\");\n}\n",
        "def f(a, b=2, *args, **kw):\n\treturn {'a': a, \"b\": b}  # comment\n",
        "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
        "SELECT * FROM t WHERE a >= 10 AND b <> 'x'; -- sql",
        "path/to/file.rs:12:34 C:\\Users\\me https://example.com/a?b=c&d=e#f",
        "punctuation!!! ??? ... --- *** ((nested)) [[x]] {{y}} ''quoted'' \"dq\"",
        "CamelCaseWord snake_case_word kebab-case-word UPPER lower MiXeD",
        BOS + "Hello" + EOS,
        "<｜User｜>What is 2+2?<｜Assistant｜></think>4" + EOS,
        "<｜User｜>Think.<｜Assistant｜><think>reasoning</think>answer",
        "<｜System｜>not an added token in V4<｜▁pad▁｜><｜image｜>",
        "<think> spaced </think> and <thinking> (not a token)",
        "a" * 300,
        "🙂" * 20,
        "\n" * 7 + " " * 9 + "\t" * 3,
    ]
    readme = (MODEL / "README.md").read_text()
    out.append(readme)
    return out


def key_normalizer():
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def compressed_map(tok):
    norm = key_normalizer()
    keys, lookup = {}, []
    for tid in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = norm.normalize_str(text) or text
        lookup.append(keys.setdefault(key, len(keys)))
    return lookup, len(keys)


def checksum(lookup):
    # sum over i of (i+1)*(c+1)*golden-ratio constant, wrapping at 2^64 (same in the Rust test)
    acc = 0
    for i, c in enumerate(lookup):
        acc = (acc + (i + 1) * (c + 1) * 0x9E3779B97F4A7C15) % (1 << 64)
    return acc


def main():
    raw = gzip.decompress((FIXTURE / "tokenizer.json.gz").read_bytes())
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    out_cases = []
    for text in cases():
        ids = tok.encode(text, add_special_tokens=False).ids
        out_cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    lookup, distinct = compressed_map(tok)
    samples = [0, 1, 2, 3, 100, 1000, 12345, 50000, 99999, 127999, 128000, 128803, 128821, 129279]
    norm = key_normalizer()
    probes = [" The", "  Café\t\n", "ＡＢＣ", "ﬁ", "Ñandú", " ", "\n\n", "\t", "a  b", " \u00a0", " \u0085", "ΣΑΣ"]
    data = {
        "about": "DeepSeek-V4 tokenizer.json (tokenizer.json.gz here): ids of encode(text, add_special_tokens=False) "
                 "from the Python `tokenizers` library; produced by scripts/make_v4_tokenizer_reference.py",
        "python_tokenizers_version": tokenizers.__version__,
        "cases": out_cases,
        "compressed_token_map": {
            "len": len(lookup),
            "distinct": distinct,
            "checksum": checksum(lookup),
            "samples": [[i, lookup[i]] for i in samples],
        },
        "normalizer_probes": [[p, norm.normalize_str(p)] for p in probes],
    }
    (FIXTURE / "reference_ids.json").write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(out_cases)} cases, {sum(len(c['ids']) for c in out_cases)} ids, compressed vocab {distinct}")


if __name__ == "__main__":
    main()
