"""Train the byte-level BPE tokenizers of afmd's built-in "demo" models (one-off).

The demo models (``afmd/engine/demo/builtin.py``) are materialised at runtime without any
download, but a frozen afmd binary carries no Python stdlib sources to train on, and
training takes seconds to a minute. So the tokenizers are trained once, here, and the
resulting ``tokenizer.json`` files are committed as package data:

    afmd/data/demo_tokenizer.json       variant "demo"      (2048 tokens)
    afmd/data/demo_32k_tokenizer.json   variant "demo-32k"  (32000 tokens)

To rerun (only needed to change the tokenizers; it changes the demo models'
fingerprints, so every user's cached demo model is rebuilt on next use):

    .venv/bin/python build/train_demo_tokenizers.py            # writes both files
    .venv/bin/python build/train_demo_tokenizers.py --check    # trains, compares, writes nothing

The corpus is the ``.py`` sources of the running interpreter's stdlib (tests, encodings
tables and site-packages left out) in sorted path order, plus its LICENSE text; the
output depends on the Python version the script runs under (these files were made with
CPython 3.11.7) but is otherwise deterministic, which ``--check`` verifies.

The layout copies Qwen2's tokenizer.json: NFC normaliser, Qwen's own split regex
followed by a byte-level pre-tokenizer without prefix space, byte-level decoder. The
regex must be Qwen's because transformers (5.x) rebuilds a ``Qwen2Tokenizer``'s
pre-tokenizer from that regex regardless of the file: with any other regex, encoding
through transformers and through ``tokenizers`` would disagree. As in Qwen2.5/Qwen3, the
control tokens are special (skipped by ``skip_special_tokens`` decoding) while the
tool-call and thinking markup tokens are plain added tokens, so they survive decoding
and reach the tool-call/thinking parsers; all seven are single, never-split tokens
placed after the BPE vocabulary.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "afmd" / "data"

# Qwen2's pre-tokenizer regex, verbatim from transformers' tokenization_qwen2.py.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# Total vocabulary sizes, added tokens included.
VARIANTS = {
    "demo_tokenizer.json": 2048,
    "demo_32k_tokenizer.json": 32000,
}

SKIPPED_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}

# A little conversational English, so the small vocabulary is not all Python.
ENGLISH = """\
Hello! How can I help you today? I am a small demonstration model running locally.
The quick brown fox jumps over the lazy dog. What is the weather like in Paris?
Please summarise the following text in two sentences. Thank you, that was helpful.
Could you write a short poem about the sea? Sure, here is a poem about the sea.
The answer is 42. Let me think about this step by step before I answer the question.
I will call a tool to look that up. The tool returned the following result.
"""


def corpus_files() -> list[Path]:
    """Stdlib sources in a fixed order, so that training is reproducible."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in root.rglob("*.py")
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    files.sort(key=lambda path: path.relative_to(root).as_posix())
    license_file = root / "LICENSE.txt"
    if license_file.is_file():
        files.append(license_file)
    return files


def corpus() -> Iterator[str]:
    """Yield training texts one file at a time (BPE counts words, so order barely matters)."""
    for _ in range(20):
        yield ENGLISH
    for path in corpus_files():
        yield path.read_text(encoding="utf-8", errors="replace")


def new_tokenizer() -> Tokenizer:
    """An empty tokenizer laid out like Qwen2's tokenizer.json."""
    tokenizer = Tokenizer(
        BPE(
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train(vocab_size: int) -> Tokenizer:
    """Train one tokenizer of exactly ``vocab_size`` tokens, added tokens included."""
    tokenizer = new_tokenizer()
    bpe_size = vocab_size - len(CONTROL_TOKENS) - len(MARKUP_TOKENS)
    trainer = BpeTrainer(
        vocab_size=bpe_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != bpe_size:
        raise SystemExit(f"corpus too small: {tokenizer.get_vocab_size()} < {bpe_size}")
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in CONTROL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise SystemExit(f"unexpected vocabulary size {tokenizer.get_vocab_size()}")
    return finish(tokenizer)


def check(tokenizer: Tokenizer) -> None:
    """Fail loudly if the file would not behave as the demo model needs."""
    for token in CONTROL_TOKENS + MARKUP_TOKENS:
        ids = tokenizer.encode(f"a{token}b").ids
        token_id = tokenizer.token_to_id(token)
        if token_id is None or token_id not in ids or len(tokenizer.encode(token).ids) != 1:
            raise SystemExit(f"{token!r} is not a single token")
    sample = "Hello, wörld! 123 ünïcödé 😀\n\n  def f(x):\n\treturn x  \r\n"
    if tokenizer.decode(tokenizer.encode(sample).ids) != sample:
        raise SystemExit("round trip failed")


def finish(tokenizer: Tokenizer) -> Tokenizer:
    """Set the byte-level flags Qwen2's file has; the Python API cannot set them all."""
    spec = json.loads(tokenizer.to_str())
    qwen_byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    spec["pre_tokenizer"]["pretokenizers"][1] = dict(qwen_byte_level)
    spec["post_processor"] = dict(qwen_byte_level)
    spec["decoder"] = dict(qwen_byte_level)
    return Tokenizer.from_str(json.dumps(spec))


def serialise(tokenizer: Tokenizer) -> bytes:
    """Compact JSON with a trailing newline; the bytes feed the demo model's fingerprint."""
    return (tokenizer.to_str(pretty=False) + "\n").encode("utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="train and compare with the shipped files"
    )
    args = parser.parse_args()
    print(f"Python {sys.version.split()[0]}, {len(corpus_files())} corpus files")
    status = 0
    for name, vocab_size in VARIANTS.items():
        tokenizer = train(vocab_size)
        check(tokenizer)
        data = serialise(tokenizer)
        target = DATA_DIR / name
        digest = hashlib.sha256(data).hexdigest()[:16]
        if args.check:
            same = target.is_file() and target.read_bytes() == data
            print(f"{name}: {'identical' if same else 'DIFFERENT'} (sha256 {digest})")
            status |= not same
        else:
            DATA_DIR.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            print(f"{name}: {vocab_size} tokens, {len(data)} bytes, sha256 {digest}")
    return status


if __name__ == "__main__":
    sys.exit(main())
