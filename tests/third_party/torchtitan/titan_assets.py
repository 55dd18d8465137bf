"""The files torchtitan's llama3 debug config reads, written locally (its wheel ships neither).

torchtitan 0.3.0's `llama3_debugmodel` points at `tests/assets/tokenizer` and the `c4_test` data
set of torchtitan's source tree; the pip wheel has neither, and nothing may be downloaded at run
time. `write_assets(folder)` writes, from a fixed seed (the same bytes every time):
- `tokenizer/`: a byte-level BPE tokenizer (HuggingFace `tokenizers`) of at most 2,048 tokens (the
  debug model's vocabulary), with `<|begin_of_text|>` / `<|end_of_text|>` named in its
  tokenizer_config.json, as torchtitan's HuggingFaceTokenizer reads them;
- `c4_local/train.jsonl`: `{"text": ...}` documents of words drawn with a Zipf-like law (so the
  loss falls), the shape of C4's records; `datasets.load_dataset(folder, split="train")` reads it.
"""
from __future__ import annotations

import json
import os
import random

VOCAB = 2048
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _documents(count: int, seed: int):
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = sorted({"".join(rng.choice(letters[:12 + i % 14]) for _ in range(2 + i % 7)) for i in range(600)})
    weights = [1.0 / (i + 1) for i in range(len(words))]
    for _ in range(count):
        n = rng.randint(40, 160)
        sentence = rng.choices(words, weights, k=n)
        yield " ".join(sentence).capitalize() + "."


def write_assets(folder: str, documents: int = 3000, seed: int = 1234) -> dict:
    """Writes the tokenizer and the data set under `folder` (once); returns their paths."""
    tok_dir = os.path.join(folder, "tokenizer")
    data_dir = os.path.join(folder, "c4_local")
    paths = {"tokenizer": tok_dir, "dataset": data_dir}
    if os.path.isfile(os.path.join(tok_dir, "tokenizer_config.json")) and os.path.isfile(
            os.path.join(data_dir, "train.jsonl")):
        return paths
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    texts = list(_documents(documents, seed))
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": True}, f)
    return paths
