"""Local stand-ins for the assets torchtitan's debug config reads from its repository checkout (the
wheel ships neither): a word-level tokenizer (tokenizer.json + tokenizer_config.json with BOS/EOS)
and a c4_test-like dataset (JSON lines with a "text" field), generated from a fixed seed.

    python tests/distributed/titan/make_assets.py DIR
"""
from __future__ import annotations

import json
import os
import random
import sys

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
WORDS = 1500  # below the debug model's vocabulary of 2048
DOCUMENTS = 400


def _corpus(rng: random.Random) -> list[str]:
    words = [f"w{i}" for i in range(WORDS)]
    weights = [1.0 / (i + 1) for i in range(WORDS)]  # Zipf-like, so the loss has something to learn
    return [" ".join(rng.choices(words, weights, k=rng.randint(20, 120))) for _ in range(DOCUMENTS)]


def _tokenizer(path: str) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {token: i for i, token in enumerate([UNK, BOS, EOS] + [f"w{i}" for i in range(WORDS)])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([BOS, EOS])
    os.makedirs(path, exist_ok=True)
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True,
                   "add_eos_token": True, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def make_assets(root: str) -> str:
    """Write DIR/tokenizer and DIR/c4_test; return root."""
    _tokenizer(os.path.join(root, "tokenizer"))
    data = os.path.join(root, "c4_test")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "train.json"), "w") as f:
        for text in _corpus(random.Random(0)):
            f.write(json.dumps({"text": text}) + "\n")
    return root


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: make_assets.py DIR")
    make_assets(sys.argv[1])
