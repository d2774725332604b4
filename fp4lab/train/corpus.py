"""Corpora built once into the cache: the one home of what pycode (pycode.py) and the user's own corpora
(user_corpus.py; config.CORPUS_NAME, the names they may have) share: where they live, their manifest,
the staging folder an interrupted build leaves (and the next build continues from), token files
written with a progress bar, the token width, and loading a built corpus for training. Torch-free.

A built corpus is a folder holding manifest.json (what it was built from and each file's SHA-256),
tokenizer.json (a `tokenizers` tokenizer), train.bin and val.bin (little-endian token ids, uint16 when
the vocabulary fits in 65536 ids, else uint32). pycode lives in $FP4LAB_CACHE/pycode, a corpus of your
own named NAME in $FP4LAB_CACHE/corpora/NAME.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
from tokenizers import Tokenizer

from fp4lab.train.atomic import TEMP_SUFFIX, replace_atomically, swap_folder, write_atomic
from fp4lab.train.config import BUILTIN_SOURCES
from fp4lab.validation import did_you_mean

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
TOKEN_FILES = ("train.bin", "val.bin")
OWN_CORPORA = "corpora"  # the cache's folder of the user's corpora
# Bump whenever user_corpus.py builds differently (split, document ends, manifest): older builds are
# then refused on load, naming the command that builds them again.
OWN_FORMAT_VERSION = 1
_ENCODE_CHUNK = 512  # documents per encode_batch call: bounds the memory of the Encoding objects
_IDENTITY = "identity.json"  # in a staging folder: the build it belongs to


class Status(Protocol):
    """Where a build reports its progress: a message, and how far along it is when that is known."""

    def __call__(self, message: str, done: int | None = None, total: int | None = None) -> None: ...


def quiet(message: str, done: int | None = None, total: int | None = None) -> None:
    """A Status that shows nothing."""


class CorpusError(ValueError):
    """A corpus that cannot be built or loaded; the message names the place and the fix."""


def cache_dir() -> Path:
    """$FP4LAB_CACHE, or ~/.cache/fp4lab."""
    return Path(os.environ.get("FP4LAB_CACHE") or Path.home() / ".cache" / "fp4lab").expanduser()


@contextlib.contextmanager
def status_line(enabled: bool) -> Iterator[Status]:
    """A Status shown on stderr while a build works: the message beside a spinner, and a bar with the
    count when the work's size is known; silent when not `enabled` or when stderr is not a terminal
    (a log keeps only the result)."""
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield quiet
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeRemainingColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("", total=None, count="")

        def update(message: str, done: int | None = None, total: int | None = None) -> None:
            count = f"{done:,}/{total:,}" if done is not None and total is not None else ""
            bar.update(task, description=message, completed=done or 0, total=total, count=count)

        yield update


# ---------------------------------------------------------------------------------------------------
# Names and places.


def own_corpus_dir(cache: Path, name: str) -> Path:
    """Where the corpus of your own named `name` (config.CORPUS_NAME) is built."""
    return cache / OWN_CORPORA / name


# ---------------------------------------------------------------------------------------------------
# Files: checksums, manifests, token files.


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, manifest: dict) -> None:
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def read_manifest(folder: Path, expected: dict[str, Any], fix: str) -> dict:
    """The folder's manifest, which must hold the `expected` values (its name, its format version);
    `fix` says how to build it again."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{folder / MANIFEST}: unreadable ({exc}); {fix}") from None
    found = {key: manifest.get(key) for key in expected}
    if found != expected:
        shown = lambda values: " ".join(f"{key} {value!r}" for key, value in values.items())
        raise CorpusError(f"{folder / MANIFEST}: {shown(found)}, not {shown(expected)}; {fix}")
    return manifest


def token_dtype(vocab_size: int) -> str:
    """The narrowest id width (a DataConfig.token_dtype) that holds every id of `vocab_size`."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_tokens(path: Path, tokenizer: Tokenizer, documents: Iterable[str], count: int, document_end: Sequence[int],
                 dtype: str, status: Status, label: str) -> dict[str, int | str]:
    """Tokenize `count` documents, each followed by the ids `document_end`, into `path` (written
    atomically, as little-endian `dtype`), reporting progress; {"tokens": ..., "sha256": ...} of it."""
    width = np.dtype(dtype).newbyteorder("<")
    end = np.asarray(document_end, dtype=width)
    digest, written = hashlib.sha256(), 0

    def write(out: BinaryIO) -> None:
        nonlocal written
        done, pending = 0, iter(documents)
        status(label, 0, count)
        while chunk := list(itertools.islice(pending, _ENCODE_CHUNK)):
            for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
                # A Python int wider than `dtype` raises here (numpy 2) rather than wrapping around.
                block = np.concatenate([np.asarray(encoding.ids, dtype=width), end]).tobytes()
                out.write(block)
                digest.update(block)
                written += len(block)
            done += len(chunk)
            status(label, done, count)

    replace_atomically(path, write)
    return {"tokens": written // width.itemsize, "sha256": digest.hexdigest()}


# ---------------------------------------------------------------------------------------------------
# Building into a staging folder.


@contextlib.contextmanager
def staging(target: Path, identity: dict | None = None) -> Iterator[Path]:
    """A hidden folder beside `target` to build into, put in target's place when the block ends without
    an error: an interrupted or refused build never leaves a half corpus at `target`.

    Without an `identity` the folder starts empty and is removed if the block fails. With one (what the
    build is made of), a folder an interrupted build of the same identity left behind is kept, so the
    build continues from the files it holds: each was written atomically, so each is whole (the
    temporary file of a write cut short is removed). A folder of another identity is emptied first. If
    the block fails, the folder stays for the next build."""
    target.parent.mkdir(parents=True, exist_ok=True)
    folder = target.with_name(f".{target.name}.building")
    key = json.dumps(identity, sort_keys=True) if identity is not None else None
    if key is None or _staged_identity(folder) != key:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(exist_ok=True)
    for leftover in folder.glob(f".*{TEMP_SUFFIX}"):
        leftover.unlink()
    if key is not None:
        write_atomic(folder / _IDENTITY, key)
    try:
        yield folder
        (folder / _IDENTITY).unlink(missing_ok=True)
        swap_folder(folder, target, target.with_name(f".{target.name}.old"))
    finally:
        if key is None:
            shutil.rmtree(folder, ignore_errors=True)


def _staged_identity(folder: Path) -> str | None:
    try:
        return (folder / _IDENTITY).read_text()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------
# Loading.


def load_built(folder: Path, expected: dict[str, Any], missing: str, fix: str) -> tuple[np.memmap, np.memmap, Tokenizer, dict]:
    """(train ids, val ids, tokenizer, manifest) of the corpus built in `folder`; `missing` is the error
    when it is not built, `fix` says how to build it again (read_manifest)."""
    if not all((folder / name).is_file() for name in (MANIFEST, TOKENIZER, *TOKEN_FILES)):
        raise CorpusError(missing)
    manifest = read_manifest(folder, expected, fix)
    dtype = np.dtype(manifest.get("token_dtype", "uint16")).newbyteorder("<")
    train, val = (np.memmap(folder / name, dtype=dtype, mode="r") for name in TOKEN_FILES)
    return train, val, Tokenizer.from_file(str(folder / TOKENIZER)), manifest


def load_own(cache: Path, name: str) -> tuple[np.memmap, np.memmap, Tokenizer, dict]:
    """The corpus of your own named `name`, as `fp4lab data build NAME` built it in `cache`."""
    folder = own_corpus_dir(cache, name)
    build = f"fp4lab data build {name} --text FILES|DIR... (or --hf DATASET) --tokenizer embedded|bpe:SIZE|hf:NAME"
    missing = (f"DataConfig.source={name!r}{did_you_mean(name, BUILTIN_SOURCES)}: no corpus {name!r} is built in "
               f"{folder.parent}; build it: `{build}` (a token file's path ends in .bin)")
    return load_built(folder, {"name": name, "format_version": OWN_FORMAT_VERSION}, missing,
                      f"build it again with this fp4lab: `{build} --force`")
