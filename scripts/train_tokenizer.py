"""Train the repo's small byte-level BPE tokenizer on the offline corpus.

Reads ``tests/assets/titan_corpus/data.jsonl`` (see ``scripts/build_corpus.py``) and
writes ``tests/assets/tokenizer/tokenizer.json`` plus ``tokenizer_config.json`` naming
the BOS/EOS tokens. The vocabulary (default 2000 entries) holds the special tokens
``<|begin_of_text|>`` (id 0) and ``<|end_of_text|>`` (id 1), the 256 byte symbols and
the learned merges.

No normalizer and no post-processor are set: the byte-level pre-tokenizer and decoder
make ``decode(encode(text)) == text`` for any unicode string, and BOS/EOS are added by
``torchtitan.components.tokenizer.HuggingFaceTokenizer``, not by the backend.

Training is single-threaded (``RAYON_NUM_THREADS=1``) and the corpus is fed in file
order, so the output is the same bytes on every run.

Usage::

    python scripts/train_tokenizer.py [--corpus FILE] [--out DIR] [--vocab-size N]
"""

import argparse
import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def read_texts(corpus: Path) -> list[str]:
    """The ``text`` field of every line of a jsonl file, in file order."""
    with corpus.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train(texts: list[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with BOS/EOS as ids 0 and 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def write_assets(tokenizer, out: Path) -> None:
    """Write ``tokenizer.json`` (compact JSON) and ``tokenizer_config.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads(tokenizer.to_str())
    (out / "tokenizer.json").write_text(
        json.dumps(spec, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--corpus", type=Path, default=REPO_ROOT / "tests/assets/titan_corpus/data.jsonl"
    )
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests/assets/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=2000)
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"  # must be set before tokenizers starts its thread pool
    tokenizer = train(read_texts(args.corpus), args.vocab_size)
    write_assets(tokenizer, args.out)
    print(f"wrote {args.out}: vocab size {tokenizer.get_vocab_size()}")


if __name__ == "__main__":
    main()
