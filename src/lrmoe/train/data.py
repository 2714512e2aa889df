"""Text → tokens (a byte-level BPE trained here, or a transformers checkpoint's own tokenizer
with ``--hf-model``) → packed training windows, identical on every rank.

The default corpus is the shortened English Wikipedia extract that the ``gensim`` wheel ships
for its own tests (about 3.1 M characters once gensim's wiki filters have run); nothing is
downloaded. ``--data PATH`` takes a text file or a folder of ``.txt``/``.md`` files instead.
The trained tokenizer and the token ids are cached under a hash of the corpus files (paths,
sizes, times) and of the checkpoint's tokenizer files.

Splits are deterministic: the last ``val_fraction`` of the token stream is validation. The
training windows of step s are a seeded permutation's slice [s·B·DP, (s+1)·B·DP); data-parallel
rank r takes its r-th share of B, so one rank with batch B·DP sees exactly what DP ranks see.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lrmoe.train.files import atomic_write

DEFAULT_CORPUS = "gensim:enwiki-shortened"
TEXT_SUFFIXES = (".txt", ".md", ".text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class DataError(ValueError):
    """A user-facing problem with the data (missing path, empty file, ...)."""


def _gensim_wiki_text() -> str:
    import bz2

    try:
        import gensim
        from gensim.corpora.wikicorpus import extract_pages, filter_wiki
    except ImportError as e:  # pragma: no cover - gensim is a dependency
        raise DataError("the default corpus needs the 'gensim' package (pip install gensim)") from e
    path = Path(gensim.__file__).parent / "test" / "test_data" / \
        "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if not path.exists():
        raise DataError(f"gensim's Wikipedia extract is missing at {path}; pass --data PATH")
    pages = (filter_wiki(text) for _, text, _ in extract_pages(bz2.BZ2File(path)))
    return "\n\n".join(p.strip() for p in pages if len(p.strip()) > 200)


def read_corpus(source: str) -> str:
    """The text of ``source``: the default corpus, a text file, or a folder of text files."""
    if source == DEFAULT_CORPUS:
        return _gensim_wiki_text()
    path = Path(source)
    if not path.exists():
        raise DataError(f"--data {source}: no such file or folder")
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"--data {source}: the folder has no {'/'.join(TEXT_SUFFIXES)} files")
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not text.strip():
        raise DataError(f"--data {source}: the text is empty")
    return text


def _cache_dir() -> Path:
    root = Path(os.environ.get("LRMOE_CACHE", Path.home() / ".cache" / "lrmoe"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _corpus_key(source: str, extra: bytes = b"") -> str:
    """The hex hash of the corpus's name, of every file's path, size and time, and of ``extra``."""
    key = hashlib.sha256(f"{source}|{Path(source).resolve() if source != DEFAULT_CORPUS else ''}".encode())
    if source != DEFAULT_CORPUS:
        for f in ([Path(source)] if Path(source).is_file() else sorted(Path(source).rglob("*"))):
            if f.is_file():
                st = f.stat()
                key.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    key.update(extra)
    return key.hexdigest()[:16]


def _checked(ids: np.ndarray, source: str) -> np.ndarray:
    if ids.size < 1000:
        raise DataError(f"--data {source}: only {ids.size} tokens; at least 1000 are needed")
    return ids


def tokenize_corpus(source: str, vocab_size: int, tokenizer: str = "") -> tuple[np.ndarray, int]:
    """Token ids (uint16/int32 numpy) of the corpus and the tokenizer's vocabulary size: with
    ``tokenizer`` (a transformers checkpoint folder) that folder's tokenizer, else a byte-level
    BPE of ``vocab_size`` trained on first use. Both are cached."""
    if tokenizer:
        return _hf_tokenize(source, tokenizer)
    from tokenizers import ByteLevelBPETokenizer, Tokenizer

    tag = f"{_corpus_key(source)}-v{vocab_size}"
    cache = _cache_dir()
    tok_path, ids_path = cache / f"{tag}.tokenizer.json", cache / f"{tag}.ids.npy"
    if tok_path.exists() and ids_path.exists():
        return np.load(ids_path), Tokenizer.from_file(str(tok_path)).get_vocab_size()
    text = read_corpus(source)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([text[i : i + 100_000] for i in range(0, len(text), 100_000)],
                            vocab_size=vocab_size, min_frequency=2, show_progress=False)
    ids = _checked(np.asarray(tok.encode(text).ids, dtype=np.int32), source)
    atomic_write(tok_path, lambda f: f.write(tok._tokenizer.to_str().encode()))
    atomic_write(ids_path, lambda f: np.save(f, ids))
    return ids, tok.get_vocab_size()


def hf_tokenizer(folder: str):
    """The tokenizer of a transformers checkpoint folder; a DataError when it has none."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # no warnings about texts longer than the model's context: they are split
    where = f"--hf-model {folder}: no tokenizer"
    # transformers falls back to an empty tokenizer for a folder without one: look for its files first
    if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise DataError(f"{where} ({', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(f"{where} transformers can load: {' '.join(str(e).split())[:200]}") from None
    if not len(tokenizer):
        raise DataError(f"{where}: its vocabulary is empty")
    return tokenizer


def _hf_tokenize(source: str, folder: str) -> tuple[np.ndarray, int]:
    """The corpus through a checkpoint's tokenizer, in pieces of whole lines (no special tokens)."""
    tok = hf_tokenizer(folder)
    files = sorted(f for f in Path(folder).iterdir()
                   if f.is_file() and ("token" in f.name or f.name in ("vocab.json", "merges.txt")))
    tag = _corpus_key(source, b"".join(f.name.encode() + f.read_bytes() for f in files))
    ids_path = _cache_dir() / f"{tag}-hf.ids.npy"
    if ids_path.exists():
        return np.load(ids_path), len(tok)
    pieces, piece, size = [], [], 0
    for line in read_corpus(source).splitlines(keepends=True):
        piece.append(line)
        size += len(line)
        if size >= 100_000:
            pieces.append("".join(piece))
            piece, size = [], 0
    pieces.append("".join(piece))
    encoded = tok(pieces, add_special_tokens=False)["input_ids"]
    ids = _checked(np.concatenate([np.asarray(e, dtype=np.int32) for e in encoded]), source)
    atomic_write(ids_path, lambda f: np.save(f, ids))
    return ids, len(tok)


@dataclass
class TokenData:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int

    @staticmethod
    def load(source: str, vocab_size: int, val_fraction: float = 0.05, tokenizer: str = "") -> TokenData:
        ids, vocab = tokenize_corpus(source, vocab_size, tokenizer)
        n_val = max(int(len(ids) * val_fraction), 1)
        return TokenData(ids[:-n_val], ids[-n_val:], vocab)

    def unigram_loss(self) -> float:
        """Cross entropy (nats) of the validation tokens under the training unigram
        distribution (add-one smoothed): the loss of a model that ignores context."""
        counts = np.bincount(self.train, minlength=self.vocab_size).astype(np.float64) + 1.0
        p = counts / counts.sum()
        return float(-np.log(p[self.val]).mean())


def check_fits(data: TokenData, seq_len: int, batch: int, dp_size: int) -> int:
    """The training split's number of windows, after checking that the training and the
    validation split each hold one global batch (``batch`` sequences × ``dp_size`` replicas);
    a DataError says by how much they fall short. The launcher runs it before any rank starts."""
    per = batch * dp_size
    n_train = (len(data.train) - 1) // seq_len
    n_val = (len(data.val) - 1) // seq_len
    for split, n in (("training", n_train), ("validation", n_val)):
        if n < per:
            raise DataError(f"the corpus is too small: its {split} split has {n} windows of {seq_len} tokens, "
                            f"fewer than one global batch of {per} (train.batch={batch} x {dp_size} data-parallel "
                            f"replica{'s' if dp_size != 1 else ''}); use more text, a smaller train.batch or "
                            f"model.seq_len"
                            + (", or a larger train.val_fraction" if split == "validation" else ""))
    return n_train


class Batches:
    """Packed windows of ``seq_len + 1`` tokens: inputs and next-token targets."""

    def __init__(self, data: TokenData, seq_len: int, batch: int, dp_rank: int, dp_size: int, seed: int) -> None:
        self.data, self.seq_len, self.batch = data, seq_len, batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        n_windows = check_fits(data, seq_len, batch, dp_size)
        self.order = np.random.default_rng(seed).permutation(n_windows)

    def _windows(self, source: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        w = torch.from_numpy(source[idx].astype(np.int64))
        return w[:, :-1], w[:, 1:]

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_step = self.batch * self.dp_size
        n = len(self.order)
        first = (step * per_step) % n
        picks = self.order[(first + np.arange(per_step)) % n]
        mine = picks[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]
        return self._windows(self.data.train, mine * self.seq_len)

    def val_batches(self, max_batches: int):
        """Fixed validation windows (non-overlapping), this DP rank's share of each batch."""
        n = (len(self.data.val) - 1) // self.seq_len
        starts = np.arange(n) * self.seq_len
        per = self.batch * self.dp_size
        for b in range(min(max_batches, max(n // per, 1))):
            chunk = starts[b * per : (b + 1) * per]
            if len(chunk) < per:
                break
            yield self._windows(self.data.val, chunk[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch])
