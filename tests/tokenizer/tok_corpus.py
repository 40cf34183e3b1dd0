"""Text for parity and speed tests: many scripts, emoji, combining marks, code, whitespace, digits, specials."""

from __future__ import annotations

import random

SAMPLES = [
    "",
    " ",
    "Hello world!",
    " Hello  world ",
    "Crème brûlée, naïve café, Ångström, façade, jalapeño, Straße, Łódź, İstanbul",
    "日本語のテキストです。東京は晴れ。",
    "中文文本：你好，世界！",
    "한국어 텍스트입니다. 안녕하세요!",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου κόσμε· Ελληνικά κείμενα.",
    "שלום עולם! עברית מימין לשמאל.",
    "مرحبا بالعالم! النص العربي.",
    "हिन्दी पाठ, ภาษาไทย, ქართული",
    "👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏿 ❤️‍🔥 🇫🇷🇯🇵",
    "e\u0301 a\u0308\u0301 n\u0303 Z\u0351\u0362\u0335a\u0337\u034c\u0356l\u0338g\u0315o",
    "def f(x):\n    return x**2  # comment\n\n\n\tif x: pass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; } // C++\r\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    '{"key": [1, 2.5, -3e10, null], "nested": {"a": "b"}}',
    "     \n\n   \t\t  x   ",
    "\n\n\n\n\n\n",
    "\t\t\tindented\n        spaces\n",
    "a\r\nb\rc\r\n\r\n",
    "1234567890 3.14159 1,000,000 0x1F 1e-9 ²³ ½ ٣٤٥ ௧௨",
    "I'm you're we've they'll she'd it's DON'T I'M YOU'RE 'tis",
    "  ?  !  . , ' s 's 're 've \" quote \" ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos>",
    "<|endoftext|><s></s><unk><pad><mask>",
    "text<|im_end|>more<|im_start|><|im_start|>",
    "<unused12> <start_of_image> [multimodal]",
    "\u00a0non-breaking\u2003em\u3000ideographic\u200bzero-width",
    "\ufeffBOM and \ufffd replacement and \U0001F600 \U00010348 \U0002A6D6",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "control \x00\x01\x06\x7f ?\x06: a\x1db \x04\x13\x14",
    "https://example.com/path?q=1&r=two#frag user@example.org",
]

_WORDS = ("the quick brown fox jumps over the lazy dog while 42 developers write code in Python and C++ "
          "über naïve façade 東京 서울 Москва Αθήνα 😀 👍🏽 — “quotes” ‘single’ … ").split(" ")
_CODE = ["def main():", "    x = [i ** 2 for i in range(10)]", "    print(f'{x!r}')", "if __name__ == '__main__':",
         "\tmain()", "int main(void) { return 0; }", "// comment with émoji 🚀", "    ", ""]


def mixed_text(n_bytes: int, seed: int = 0) -> str:
    """About ``n_bytes`` of UTF-8 mixing prose in several scripts, code lines and the samples above."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_bytes:
        kind = rng.random()
        if kind < 0.5:
            chunk = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) + rng.choice([". ", "\n", "? "])
        elif kind < 0.85:
            chunk = "\n".join(rng.choice(_CODE) for _ in range(rng.randint(1, 6))) + "\n"
        else:
            chunk = rng.choice(SAMPLES[2:25]) + " "
        parts.append(chunk)
        size += len(chunk.encode())
    return "".join(parts)
