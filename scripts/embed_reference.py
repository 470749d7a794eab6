#!/usr/bin/env python3
"""Reference vectors for memproxy's contextual embedder (crates/embed), computed without it.

A plain numpy forward pass of all-MiniLM-L6-v2 (BERT: embeddings, 6 layers of self-attention
and feed-forward, erf GELU, LayerNorm), in float64, over the model's own tokenizer.json
truncated at 256 word pieces, mean pooled over the attention mask and L2 normalised, as
sentence-transformers computes it. Writes crates/embed/tests/it/reference.json: each text with its
word-piece ids and its vector (full float32 precision), which tests/it/reference.rs compares the
Rust embedder with.

    pip install -r scripts/embed-reference-requirements.txt
    scripts/fetch-model.sh
    python3 scripts/embed_reference.py [MODEL_DIR] [OUT]
"""

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "crates", "embed", "tests", "it", "reference.json")
MAX_PIECES = 256

LONG = " ".join(
    f"Sentence {i} of a long message: the agent kept notes about deployments, invoices, "
    f"the staging database and the on-call rota, so that nothing would be forgotten."
    for i in range(1, 16)
)
TEXTS = [
    "I drive a silver Volvo to work every morning.",
    "What kind of automobile do I own?",
    "Ünïcödé: café, naïve, Straße, 東京タワー, Ελληνικά, emoji 🙂 and a "
    + "x" * 120
    + " word.",
    LONG,
    "",
]

erf = np.frompyfunc(math.erf, 1, 1)


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def forward(ids, weights, config):
    w = {name: value.astype(np.float64) for name, value in weights.items()}
    eps = config["layer_norm_eps"]
    heads = config["num_attention_heads"]
    n = len(ids)
    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.position_embeddings.weight"][:n]
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    d = x.shape[-1] // heads
    for layer in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        lin = lambda t, name: t @ w[p + name + ".weight"].T + w[p + name + ".bias"]
        q, k, v = (
            lin(x, f"attention.self.{part}").reshape(n, heads, d).transpose(1, 0, 2)
            for part in ("query", "key", "value")
        )
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        context = (scores @ v).transpose(1, 0, 2).reshape(n, heads * d)
        x = layer_norm(
            lin(context, "attention.output.dense") + x,
            w[p + "attention.output.LayerNorm.weight"],
            w[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        h = lin(x, "intermediate.dense")
        h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)).astype(np.float64))
        x = layer_norm(
            lin(h, "output.dense") + x,
            w[p + "output.LayerNorm.weight"],
            w[p + "output.LayerNorm.bias"],
            eps,
        )
    pooled = x.mean(0)  # one text, no padding: every position is in the mask
    return pooled / np.linalg.norm(pooled)


def main():
    tokenizer = Tokenizer.from_file(os.path.join(MODEL_DIR, "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(MAX_PIECES)
    weights = load_file(os.path.join(MODEL_DIR, "model.safetensors"))
    with open(os.path.join(MODEL_DIR, "config.json")) as f:
        config = json.load(f)
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text).ids
        vector = forward(np.array(ids), weights, config).astype(np.float32)
        cases.append({"text": text, "ids": ids, "vector": [float(x) for x in vector]})
        print(f"{len(ids):4} pieces  {text[:60]!r}", file=sys.stderr)
    with open(OUT, "w") as f:
        json.dump({"model": "all-MiniLM-L6-v2", "max_pieces": MAX_PIECES, "cases": cases}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
