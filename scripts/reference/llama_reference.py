#!/usr/bin/env python3
"""Independent float32 llama forward pass for Pagoda's model reference test.

Setup and run (no torch, no transformers):

    python3 -m pip install numpy gguf
    python3 scripts/reference/llama_reference.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

It reads the GGUF with the PyPI `gguf` package (`GGUFReader`), dequantises every weight with
`gguf.quants.dequantize`, and runs the llama forward pass in numpy float32 -- written the Hugging Face way, not
the llama.cpp way: Wq/Wk are un-permuted back to Hugging Face's layout (undoing convert_hf_to_gguf.py's
`permute`) and RoPE is applied with `rotate_half` over the two halves of each head. Pagoda applies llama.cpp's
"normal" adjacent-pair RoPE to the permuted weights; the two are equal only if the whole chain is right.

Prompts: the chat prompts of `worker/tests/fixtures/tokenizer_reference.json` (rendered through the chat
template and tokenized by the Hugging Face reference), the first N_PROMPTS of them.

Output: `worker/tests/fixtures/llama_reference.json` with, per prompt, the prompt ids, the first N_GREEDY
greedy tokens, the top-20 logits (ids and values) of the first step and every greedy step's top-2 logit gap.
Each prompt has two runs: the exact float32 forward, and `act_q8`, the same forward with every input of a
quantised-weight matmul rounded to Q8_1 blocks (32 values, d = amax/127, round half to even) the way llama.cpp and
Pagoda's CPU kernels quantise activations. The second run separates "the forward pass is right" from "8-bit
activations move the logits". This model is very sensitive to that rounding: perturbing the act_q8 inputs by one
part in 10^6 moves prompt 0's first-step top logits by ~0.35 and swaps its top two tokens, so the Rust test holds
the quantised path to a loose bound and checks the forward pass exactly with F32 weights.
"""

import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOKENIZER_FIXTURE = os.path.join(ROOT, "worker", "tests", "fixtures", "tokenizer_reference.json")
OUT = os.path.join(ROOT, "worker", "tests", "fixtures", "llama_reference.json")
N_PROMPTS = 4
N_GREEDY = 32
TOP = 20


def q8_activations(x):
    """llama.cpp's Q8_1 activation rounding, as Pagoda's quantised matmul does it before a Q4_1/Q8_0 dot product:
    per block of 32 inputs d = amax/127, q = round_half_even(x/d), x -> d*q."""
    shape = x.shape
    b = x.reshape(-1, shape[-1] // 32, 32).astype(np.float32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / d, np.float32(0.0)).astype(np.float32)
    q = np.rint(b * inv)
    return (d * q).astype(np.float32).reshape(shape)


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


class Model:
    def __init__(self, path):
        self.act_q8 = False
        r = GGUFReader(path)
        arch = field(r, "general.architecture")
        assert arch == "llama", arch
        self.n_layers = int(field(r, f"{arch}.block_count"))
        self.hidden = int(field(r, f"{arch}.embedding_length"))
        self.n_heads = int(field(r, f"{arch}.attention.head_count"))
        self.n_kv = int(field(r, f"{arch}.attention.head_count_kv"))
        self.head_dim = self.hidden // self.n_heads
        self.eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.theta = float(field(r, f"{arch}.rope.freq_base"))
        tensors = {t.name: t for t in r.tensors}

        def w(name):
            t = tensors[name]
            # dequantize returns the array in numpy (row-major) order: [rows, cols] for a matrix.
            a = dequantize(t.data, t.tensor_type).astype(np.float32)
            shape = tuple(int(d) for d in reversed(t.shape))
            return a.reshape(shape)

        def unpermute(wt, n_head):
            # convert_hf_to_gguf.py: permute(w) = w.reshape(n_head, 2, rows//n_head//2, cols).swapaxes(1, 2)
            rows, cols = wt.shape
            return wt.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

        self.embed = w("token_embd.weight")
        self.lm_head = w("output.weight") if "output.weight" in tensors else self.embed
        self.norm = w("output_norm.weight")
        self.layers = []
        for i in range(self.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                dict(
                    attn_norm=w(p + "attn_norm.weight"),
                    wq=unpermute(w(p + "attn_q.weight"), self.n_heads),
                    wk=unpermute(w(p + "attn_k.weight"), self.n_kv),
                    wv=w(p + "attn_v.weight"),
                    wo=w(p + "attn_output.weight"),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    gate=w(p + "ffn_gate.weight"),
                    up=w(p + "ffn_up.weight"),
                    down=w(p + "ffn_down.weight"),
                )
            )
        half = self.head_dim // 2
        self.inv_freq = (1.0 / (self.theta ** (np.arange(0, half, dtype=np.float64) * 2.0 / self.head_dim)))

    def mm(self, x, w):
        """x @ w.T, with x rounded like llama.cpp's Q8_1 activations when act_q8 is on."""
        if self.act_q8:
            x = q8_activations(x)
        return x @ w.T

    def rmsnorm(self, x, w):
        x64 = x.astype(np.float64)
        return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + self.eps)).astype(np.float32) * w

    def rope(self, x, positions):
        # x: [n, heads, head_dim]; Hugging Face rotate_half convention.
        ang = np.outer(positions.astype(np.float64), self.inv_freq)  # [n, half]
        cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1).astype(np.float32)[:, None, :]
        sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1).astype(np.float32)[:, None, :]
        half = self.head_dim // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rot * sin

    def forward(self, ids, start, cache):
        """ids: new tokens; cache: per-layer (K, V) lists of [n, n_kv, head_dim]. Returns logits of every row."""
        n = len(ids)
        x = self.embed[np.array(ids)]
        positions = np.arange(start, start + n)
        group = self.n_heads // self.n_kv
        for li, L in enumerate(self.layers):
            h = self.rmsnorm(x, L["attn_norm"])
            q = self.mm(h, L["wq"]).reshape(n, self.n_heads, self.head_dim)
            k = self.mm(h, L["wk"]).reshape(n, self.n_kv, self.head_dim)
            v = self.mm(h, L["wv"]).reshape(n, self.n_kv, self.head_dim)
            q = self.rope(q, positions)
            k = self.rope(k, positions)
            K, V = cache[li]
            K = k if K is None else np.concatenate([K, k], axis=0)
            V = v if V is None else np.concatenate([V, v], axis=0)
            cache[li] = (K, V)
            total = K.shape[0]
            out = np.zeros((n, self.n_heads, self.head_dim), dtype=np.float32)
            scale = 1.0 / np.sqrt(self.head_dim)
            for hq in range(self.n_heads):
                hk = hq // group
                s = (q[:, hq, :] @ K[:, hk, :].T) * scale  # [n, total]
                mask = np.arange(total)[None, :] > (start + np.arange(n))[:, None]
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                p /= p.sum(axis=-1, keepdims=True)
                out[:, hq, :] = p @ V[:, hk, :]
            x = x + self.mm(out.reshape(n, -1), L["wo"])
            h = self.rmsnorm(x, L["ffn_norm"])
            g = self.mm(h, L["gate"])
            u = self.mm(h, L["up"])
            a = (g / (1.0 + np.exp(-g))) * u
            x = x + self.mm(a, L["down"])
        x = self.rmsnorm(x, self.norm)
        return self.mm(x, self.lm_head)


def top(logits, k):
    idx = np.argsort(-logits, kind="stable")[:k]
    return [int(i) for i in idx], [float(logits[i]) for i in idx]


def run(m, prompt_ids):
    ids = list(prompt_ids)
    cache = [(None, None)] * m.n_layers
    logits = m.forward(ids, 0, cache)[-1]
    first_ids, first_vals = top(logits, TOP)
    tokens, gaps = [], []
    pos = len(ids)
    for step in range(N_GREEDY):
        t_ids, t_vals = top(logits, 2)
        tokens.append(t_ids[0])
        gaps.append(t_vals[0] - t_vals[1])
        if step + 1 < N_GREEDY:
            logits = m.forward([t_ids[0]], pos, cache)[-1]
            pos += 1
    return dict(greedy=tokens, top2_gaps=gaps, first_step_top_ids=first_ids, first_step_top_logits=first_vals)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    m = Model(path)
    with open(TOKENIZER_FIXTURE, encoding="utf-8") as f:
        chats = json.load(f)["chats"]
    prompts = [c for c in chats if c["add_generation_prompt"]][:N_PROMPTS]
    results = []
    for c in prompts:
        m.act_q8 = False
        exact = run(m, c["ids"])
        m.act_q8 = True
        q8 = run(m, c["ids"])
        results.append(dict(messages=c["messages"], prompt_ids=c["ids"], **exact, act_q8=q8))
        for name, r in (("f32", exact), ("act-q8", q8)):
            print(f"{name}: prompt of {len(c['ids'])} tokens -> {r['greedy']}  (min top-2 gap {min(r['top2_gaps']):.4f})")
    fixture = dict(
        generator="scripts/reference/llama_reference.py",
        reference="numpy float32 forward, weights from gguf.quants.dequantize, HF-layout Wq/Wk with rotate_half RoPE; "
        "act_q8: the same with every quantised-weight matmul input rounded to Q8_1 blocks as llama.cpp does",
        numpy_version=np.__version__,
        model=os.path.basename(path),
        n_greedy=N_GREEDY,
        prompts=results,
    )
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
