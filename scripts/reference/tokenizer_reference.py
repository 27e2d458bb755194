#!/usr/bin/env python3
"""Tokenizer and chat-template reference fixtures for Pagoda's model layer.

Builds the tokenizer independently of Pagoda with Hugging Face transformers' own GGUF-to-tokenizer conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), renders chats with its `apply_chat_template`, and writes
`worker/tests/fixtures/tokenizer_reference.json`, which `worker/tests/model_tokenizer.rs` compares against.

Setup and run (transformers 5.x's GGUF reader imports torch, so torch is needed too; CPU is enough):

    python3 -m pip install "transformers==5.23.0" torch gguf tokenizers sentencepiece protobuf numpy
    python3 scripts/reference/tokenizer_reference.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

About the pre-tokenizer: the GGUF says `tokenizer.ggml.pre = "smollm"`. SmolLM2's own `tokenizer.json` (and
llama.cpp's "smollm" pre-tokenizer) split every digit first: Sequence[Digits(individual_digits=True),
ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]. transformers' GGUF converter has no
entry for "smollm" and uses plain ByteLevel. This script therefore also tokenizes every text with the SmolLM2
pre-tokenizer and records both; the expected ids (`ids`) are the SmolLM2 ones, and `ids_transformers_gguf`
appears only where the two differ. In this text set that is one text: " ½" (a space before a non-ASCII number)
stays one pre-token under plain ByteLevel but is split by Digits.
"""

import json
import os
import sys

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer
import tokenizers
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "worker", "tests", "fixtures", "tokenizer_reference.json")

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "   three leading spaces",
    "tabs\tand\t\tmore tabs",
    "line one\nline two\n\nline four\r\nwindows line",
    "whitespace runs:     five    four   three  two",
    "\n\n\n",
    "digits 0123456789 and 3.14159 and 1,000,000 and 2024-11-22",
    "x1 y22 z333 a4444 12ab 99 bottles",
    "math: x² + y³ = ½ and ⅓ and ٣ and ① ",
    "unicode: café naïve résumé Ångström Straße ñandú",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "CJK: 你好，世界！ 日本語のテキスト 한국어 텍스트",
    "Cyrillic и Greek: Привет мир, Γειά σου κόσμε",
    "Arabic and Hebrew: مرحبا بالعالم שלום עולם",
    "code: fn main() {\n    let x: Vec<u32> = vec![1, 2, 3];\n    println!(\"{x:?}\");\n}",
    "def f(a, b=2):\n\treturn {'k': [a, b]}  # comment\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "URLs: https://example.com/path?q=1&r=two#frag and user@example.org",
    "contractions: I'm you're he's we'll they'd it's can't won't",
    "CAPS AND MiXeD CaSe WoRdS",
    "punctuation!!! ??? ... --- *** ### @@@ $$$ %%%",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "text<|im_end|>text <|im_start|> spaced <|endoftext|>",
    "<repo_name>pagoda<file_sep>src/main.rs<filename>x",
    "not special: <|im_start |> <im_end> <|imstart|>",
    "a" * 64,
    "the quick brown fox jumps over the lazy dog " * 4,
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "control \u0001\u0002 bytes \u007f and \ufffd replacement",
]

CHATS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Write a haiku about the sea."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "List three prime numbers."},
            {"role": "assistant", "content": "2, 3 and 5."},
            {"role": "user", "content": "And the next two?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "user", "content": "Translate 'good morning' into French, 日本語 and emoji 🌅."},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        "add_generation_prompt": False,
    },
]


def smollm_pre_tokenizer():
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    directory, name = os.path.split(os.path.abspath(model))
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    backend = tok.backend_tokenizer
    converted = tokenizers.Tokenizer.from_str(backend.to_str())
    smollm = tokenizers.Tokenizer.from_str(backend.to_str())
    smollm.pre_tokenizer = smollm_pre_tokenizer()

    texts = []
    n_diff = 0
    for text in TEXTS:
        ids_conv = converted.encode(text, add_special_tokens=False).ids
        ids = smollm.encode(text, add_special_tokens=False).ids
        # The transformers tokenizer object itself must agree with its backend.
        assert tok.encode(text, add_special_tokens=False) == ids_conv, text
        entry = {
            "text": text,
            "ids": ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            "ids_add_special": tok.encode(text, add_special_tokens=True)
            if ids == ids_conv
            else None,
        }
        if ids != ids_conv:
            n_diff += 1
            entry["ids_transformers_gguf"] = ids_conv
        texts.append(entry)

    chats = []
    for chat in CHATS:
        rendered = tok.apply_chat_template(
            chat["messages"], tokenize=False, add_generation_prompt=chat["add_generation_prompt"]
        )
        ids = smollm.encode(rendered, add_special_tokens=False).ids
        chats.append({**chat, "rendered": rendered, "ids": ids})

    special_ids = [i for i in range(len(tok)) if tok.convert_ids_to_tokens(i) in tok.all_special_tokens]
    fixture = {
        "generator": "scripts/reference/tokenizer_reference.py",
        "reference": "transformers AutoTokenizer.from_pretrained(gguf_file=...) + apply_chat_template; "
        "ids use SmolLM2's Digits+ByteLevel pre-tokenizer (see script docstring)",
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "model": name,
        "vocab_size": len(tok),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "special_ids": special_ids,
        "n_texts_where_pre_tokenizers_differ": n_diff,
        "texts": texts,
        "chats": chats,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(texts)} texts ({n_diff} differ between pre-tokenizers), {len(chats)} chats")


if __name__ == "__main__":
    main()
