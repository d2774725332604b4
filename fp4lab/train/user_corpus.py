"""A corpus of your own: text files or a Hugging Face dataset, tokenized once into the cache, then a
DataConfig.source by its name (`source = "NAME"`, `--data NAME`).

    fp4lab data build NAME --text FILES|DIR...  | --hf DATASET[:split] [--column text]
                           --tokenizer embedded|bpe:SIZE|hf:NAME

NAME: lowercase letters, digits, "-" and "_", first a letter, not a built-in source (config.CORPUS_NAME):
with no "." or "/" it never reads as a path to a .bin token file.

Documents. `--text`: each file is one document, read as UTF-8 (a folder: every file under it, in path
order, hidden files and folders left out). `--hf`: each row's `column` value (a string), in the
dataset's order; DATASET is a folder written by `save_to_disk` (read with `datasets.load_from_disk`)
or a dataset name for `datasets.load_dataset` (from the local Hugging Face cache when there is no
network), and `:split` picks the split (default "train"). Empty documents are left out (counted).

The validation split is VAL_FRACTION (1 %) of the distinct documents, rounded, at least one, leaving at
least one for training: those whose SHA-256 (its first 8 bytes as a number) is smallest. Deterministic,
whatever the documents' order; exact copies of a document fall on the same side.

Tokenizers. `embedded`: the 4096-token byte-level BPE of the default `shakespeare` source (built on first
use: seconds). `bpe:SIZE`: a byte-level BPE of at most SIZE tokens (the trainer of Shakespeare's and
pycode's, bpe.py) trained on the training documents, <|endoftext|> its id 0 (a small corpus may run out
of merges first: the manifest has the real size). `hf:NAME`: a Hugging Face tokenizer through
transformers' AutoTokenizer (a Hub name, from the local cache when there is no network, or a folder),
which must have a fast (`tokenizers`) version. Every document ends with the tokenizer's end-of-text
token: <|endoftext|> (bpe), the Hugging Face tokenizer's eos_token, or, for a tokenizer without one
(embedded has no special tokens), the ids of a blank line "\\n\\n", as Shakespeare's speeches end.

The corpus is $FP4LAB_CACHE/corpora/NAME (corpus.py): manifest.json (the inputs and their SHA-256, the
tokenizer, the vocabulary, the token width, the document counts, each file's token count and
SHA-256), tokenizer.json, train.bin and val.bin (uint16 ids when the vocabulary fits, else uint32).

Building again with the same inputs and tokenizer finds the corpus built and does nothing; other inputs
or another tokenizer are refused, naming --force (which replaces it) or another name. A build writes
into a staging folder beside its target and renames it into place at the end; an interrupted build
continues from the tokenizer and the token files the staging folder holds (corpus.staging).
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from fp4lab.train.atomic import write_atomic
from fp4lab.train.bpe import END_OF_TEXT, train_tokenizer
from fp4lab.train.config import corpus_name_problem
from fp4lab.train.corpus import (
    MANIFEST,
    OWN_FORMAT_VERSION,
    TOKEN_FILES,
    TOKENIZER,
    CorpusError,
    Status,
    own_corpus_dir,
    quiet,
    read_manifest,
    sha256_file,
    staging,
    token_dtype,
    write_manifest,
    write_tokens,
)

VAL_FRACTION = 0.01
BLANK_LINE = "\n\n"  # a document's end where the tokenizer has no end-of-text token
_REPORT_EVERY = 256  # documents between progress updates while reading
_TOKENIZER_SPEC = re.compile(r"embedded|bpe:(?P<size>\d+)|hf:(?P<name>.+)")
_SMALLEST_BPE = 257  # the 256 byte tokens and <|endoftext|>


@dataclass(frozen=True)
class Inputs:
    """Where the documents come from: how the manifest describes it, how many documents, and the
    documents themselves, read anew on each call (never all held in memory)."""

    description: dict
    count: int
    documents: Callable[[], Iterator[str]]


@dataclass(frozen=True)
class Scan:
    """What one pass over the documents found: the SHA-256 of the inputs (of the documents' own
    SHA-256s, in order), the split, the counts."""

    sha256: str
    val_threshold: int  # documents whose key is at most this are held out (document_key)
    train: int
    val: int
    empty: int


def document_key(document: str) -> int:
    """The number the split compares: the first 8 bytes of the document's SHA-256."""
    return int.from_bytes(hashlib.sha256(document.encode()).digest()[:8], "big")


# ---------------------------------------------------------------------------------------------------
# Inputs.


def text_inputs(paths: Sequence[Path]) -> Inputs:
    """Text files and folders of them (every file under a folder, in path order, hidden ones left out)."""
    files: dict[Path, None] = {}  # ordered, each file once
    for path in paths:
        if path.is_file():
            files[path.resolve()] = None
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            if not found:
                raise CorpusError(f"--text {path}: the folder holds no files (hidden ones are left out); add text files")
            files.update(dict.fromkeys(p.resolve() for p in found))
        else:
            raise CorpusError(f"--text {path}: no such file or folder; check the path")

    def documents() -> Iterator[str]:
        for file in files:
            try:
                yield file.read_bytes().decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"--text {file}: not UTF-8 text (byte {exc.start}); convert it to UTF-8 "
                                  "or leave it out") from None

    listed = [{"path": str(file), "bytes": file.stat().st_size, "sha256": sha256_file(file)} for file in files]
    return Inputs({"kind": "text", "files": listed}, len(files), documents)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def hf_inputs(dataset: str, column: str = "text") -> Inputs:
    """The `column` of a Hugging Face dataset: DATASET[:split], a folder written by save_to_disk or a
    name for datasets.load_dataset (default split "train")."""
    name, split = dataset, None
    if ":" in dataset and not Path(dataset).exists():
        name, split = dataset.rsplit(":", 1)
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--hf {dataset}: needs the datasets package: pip install 'fp4lab[hf]'") from None
    table = _load_hf_dataset(datasets, name, split, dataset)
    if column not in table.column_names:
        raise CorpusError(f"--hf {dataset}: no column {column!r}; it has {', '.join(table.column_names)}: "
                          "pick one with --column")
    rows = len(table)

    def documents() -> Iterator[str]:
        done = 0
        for batch in table.select_columns([column]).iter(batch_size=1024):
            for value in batch[column]:
                if not isinstance(value, (str, type(None))):
                    raise CorpusError(f"--hf {dataset}: row {done} of column {column!r} holds {type(value).__name__}, "
                                      "not text; pick a text column with --column")
                done += 1
                yield value or ""

    where = str(Path(name).resolve()) if Path(name).is_dir() else name
    return Inputs({"kind": "hf", "dataset": where, "split": split or "train", "column": column, "rows": rows},
                  rows, documents)


def _load_hf_dataset(datasets, name: str, split: str | None, given: str):
    local = Path(name).is_dir()
    if local:
        fix = "pass a folder written by Dataset.save_to_disk or DatasetDict.save_to_disk"
    else:
        fix = (f"with no network it must be in the local Hugging Face cache ({_hf_cache()}): load it once where "
               "there is network and copy that cache, or save it with Dataset.save_to_disk and pass that folder")
    try:
        loaded = datasets.load_from_disk(name) if local else datasets.load_dataset(name, split=split or "train")
    except (OSError, ValueError) as exc:
        raise CorpusError(f"--hf {given}: cannot load it ({_first_line(exc)}); {fix}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if (split or "train") not in loaded:
            raise CorpusError(f"--hf {given}: no split {split or 'train'!r}; it has {', '.join(loaded)}: "
                              f"name one as {name}:SPLIT")
        return loaded[split or "train"]
    if split is not None and Path(name).is_dir():
        raise CorpusError(f"--hf {given}: the folder holds one dataset without splits; leave out ':{split}'")
    return loaded


def _hf_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# ---------------------------------------------------------------------------------------------------
# The split.


def scan(inputs: Inputs, label: str, status: Status = quiet) -> Scan:
    """One pass over the documents: their SHA-256s and the validation split (the module docstring)."""
    digest, keys, empty = hashlib.sha256(), array("Q"), 0
    for index, document in enumerate(inputs.documents()):
        raw = hashlib.sha256(document.encode()).digest()
        digest.update(raw)
        if document:
            keys.append(int.from_bytes(raw[:8], "big"))
        else:
            empty += 1
        if index % _REPORT_EVERY == 0:
            status(f"{label}: reading the documents", index, inputs.count)
    status(f"{label}: reading the documents", inputs.count, inputs.count)
    all_keys = np.frombuffer(keys, dtype=np.uint64)
    distinct = np.unique(all_keys)
    if distinct.size < 2:
        raise CorpusError(f"{label}: the inputs hold {distinct.size} distinct non-empty document(s); training and "
                          "validation need at least 2 (each text file, each dataset row is one document): add more")
    held_out = min(distinct.size - 1, max(1, round(distinct.size * VAL_FRACTION)))
    threshold = int(distinct[held_out - 1])
    val = int(np.count_nonzero(all_keys <= threshold))
    return Scan(digest.hexdigest(), threshold, all_keys.size - val, val, empty)


def _side(inputs: Inputs, split: Scan, validation: bool) -> Iterator[str]:
    return (d for d in inputs.documents() if d and (document_key(d) <= split.val_threshold) == validation)


# ---------------------------------------------------------------------------------------------------
# Tokenizers.


@dataclass(frozen=True)
class TokenizerChoice:
    """--tokenizer as given, and, for embedded and hf, the tokenizer with its document end."""

    spec: str
    bpe_size: int | None = None
    given: Tokenizer | None = None
    end: tuple[int, ...] = ()

    @property
    def basis(self) -> str:
        """What the tokens depend on besides the spec: the given tokenizer's SHA-256, or the release of
        the `tokenizers` trainer a BPE is trained with."""
        if self.given is not None:
            return hashlib.sha256(self.given.to_str().encode()).hexdigest()
        return f"tokenizers {tokenizers.__version__}"


def parse_tokenizer(spec: str) -> TokenizerChoice:
    """--tokenizer embedded|bpe:SIZE|hf:NAME, checked (nothing loaded yet)."""
    match = _TOKENIZER_SPEC.fullmatch(spec)
    if match is None:
        raise CorpusError(f"--tokenizer {spec!r} is not supported; use embedded, bpe:SIZE (e.g. bpe:8192) or hf:NAME "
                          "(e.g. hf:gpt2)")
    if match["size"] is not None and int(match["size"]) < _SMALLEST_BPE:
        raise CorpusError(f"--tokenizer {spec}: a byte-level BPE needs at least {_SMALLEST_BPE} tokens "
                          "(256 bytes and <|endoftext|>); use a larger SIZE, e.g. bpe:8192")
    return TokenizerChoice(spec, bpe_size=int(match["size"]) if match["size"] else None)


def resolve_tokenizer(choice: TokenizerChoice, status: Status = quiet) -> TokenizerChoice:
    """`choice` with its tokenizer loaded (embedded, hf); a BPE is trained later, in the build."""
    if choice.bpe_size is not None:
        return choice
    if choice.spec == "embedded":
        from fp4lab.train.config import DataConfig
        from fp4lab.train.data import DEFAULT_SHAKESPEARE_VOCAB, load_shakespeare

        status("embedded: the Shakespeare tokenizer (built on first use)")
        tokenizer = load_shakespeare(DEFAULT_SHAKESPEARE_VOCAB, DataConfig().val_fraction).tokenizer
        return TokenizerChoice(choice.spec, given=tokenizer, end=_end_ids(tokenizer, None))
    name = choice.spec.removeprefix("hf:")
    status(f"{choice.spec}: loading the tokenizer")
    tokenizer, eos = _hf_tokenizer(name)
    return TokenizerChoice(choice.spec, given=tokenizer, end=_end_ids(tokenizer, eos))


def _hf_tokenizer(name: str) -> tuple[Tokenizer, int | None]:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CorpusError(f"--tokenizer hf:{name}: needs the transformers package: pip install 'fp4lab[hf]'") from None
    try:
        auto = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise CorpusError(f"--tokenizer hf:{name}: cannot load it ({_first_line(exc)}); with no network it must be in "
                          f"the local Hugging Face cache ({_hf_cache()}): load it once where there is network and copy "
                          "that cache, or pass a folder holding its tokenizer.json") from None
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        raise CorpusError(f"--tokenizer hf:{name}: it has no fast (tokenizers) version, which fp4lab needs; "
                          "use another tokenizer or bpe:SIZE")
    tokenizer = Tokenizer.from_str(backend.to_str())
    tokenizer.no_truncation()  # a model's max_length would silently cut every long document short
    tokenizer.no_padding()
    return tokenizer, auto.eos_token_id


def _end_ids(tokenizer: Tokenizer, end_of_text: int | None) -> tuple[int, ...]:
    if end_of_text is not None:
        return (end_of_text,)
    return tuple(tokenizer.encode(BLANK_LINE, add_special_tokens=False).ids)


# ---------------------------------------------------------------------------------------------------
# Build, load.


def check_name(name: str) -> None:
    """Refuse a name that cannot be a corpus's (config.CORPUS_NAME)."""
    problem = corpus_name_problem(name)
    if problem:
        raise CorpusError(f"data build NAME: {problem}")


def corpus_dir(cache: Path, name: str) -> Path:
    """Where the corpus `name` is built; a name that cannot be a corpus's is refused."""
    check_name(name)
    return own_corpus_dir(cache, name)


def build(cache: Path, name: str, inputs: Inputs, tokenizer: str, *, force: bool = False,
          status: Status = quiet) -> tuple[dict, bool]:
    """Build the corpus `name` (the module docstring says how): (its manifest, whether it was built now;
    False when the same build was already there)."""
    folder = corpus_dir(cache, name)
    choice = parse_tokenizer(tokenizer)
    split = scan(inputs, name, status)
    choice = resolve_tokenizer(choice, status)
    identity = {"format_version": OWN_FORMAT_VERSION, "inputs_sha256": split.sha256, "tokenizer": choice.spec,
                "tokenizer_basis": choice.basis}
    if (folder / MANIFEST).is_file() and not force:
        built = read_manifest(folder, {"name": name}, f"build it again with --force, or choose another name than {name!r}")
        if _identity(built) == identity:
            return built, False
        raise CorpusError(f"data build {name}: {_difference(_identity(built), identity)} than the corpus built in "
                          f"{folder}; add --force to replace it, or choose another name")
    with staging(folder, identity) as building:
        manifest = _write(building, name, inputs, split, choice, status)
    return manifest, True


def _write(folder: Path, name: str, inputs: Inputs, split: Scan, choice: TokenizerChoice, status: Status) -> dict:
    """Tokenizer, token files and manifest into the staging folder `folder`; what an interrupted build
    finished there is kept."""
    if (folder / TOKENIZER).is_file():
        status(f"{name}: the tokenizer of the interrupted build is kept")
        tokenizer = Tokenizer.from_file(str(folder / TOKENIZER))
    elif choice.given is not None:
        tokenizer = choice.given
    else:
        label = f"{name}: training a {choice.bpe_size}-token byte-level BPE on {split.train:,} documents"
        documents = _counted(_side(inputs, split, False), split.train, label, status)
        tokenizer = train_tokenizer(documents, choice.bpe_size, special_tokens=(END_OF_TEXT,))
    if not (folder / TOKENIZER).is_file():
        write_atomic(folder / TOKENIZER, tokenizer.to_str())
    end = choice.end or (tokenizer.token_to_id(END_OF_TEXT),)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    files = {}
    for file, validation, count in zip(TOKEN_FILES, (False, True), (split.train, split.val)):
        path = folder / file
        if path.is_file():
            status(f"{name}: {file} of the interrupted build is kept")
            files[file] = {"tokens": path.stat().st_size // np.dtype(dtype).itemsize, "sha256": sha256_file(path)}
        else:
            files[file] = write_tokens(path, tokenizer, _side(inputs, split, validation), count, end, dtype, status,
                                       f"{name}: tokenizing {count:,} documents into {file}")
    files[TOKENIZER] = {"sha256": sha256_file(folder / TOKENIZER)}
    manifest = {
        "name": name, "format_version": OWN_FORMAT_VERSION, "inputs": dict(inputs.description, sha256=split.sha256),
        "tokenizer": {"spec": choice.spec, "basis": choice.basis}, "tokenizers_version": tokenizers.__version__,
        "vocab_size": vocab_size, "token_dtype": dtype, "document_end": list(end),
        "split": {"val_fraction": VAL_FRACTION, "val_threshold": f"{split.val_threshold:016x}"},
        "documents": {"train": split.train, "val": split.val, "empty": split.empty}, "files": files,
    }  # fmt: skip
    write_manifest(folder, manifest)
    return manifest


def _counted(documents: Iterator[str], count: int, label: str, status: Status) -> Iterator[str]:
    for done, document in enumerate(documents):
        if done % _REPORT_EVERY == 0:
            status(label, done, count)
        yield document
    status(label, count, count)


def _identity(manifest: dict) -> dict:
    return {"format_version": manifest.get("format_version"), "inputs_sha256": manifest.get("inputs", {}).get("sha256"),
            "tokenizer": manifest.get("tokenizer", {}).get("spec"), "tokenizer_basis": manifest.get("tokenizer", {}).get("basis")}


def _difference(built: dict, wanted: dict) -> str:
    """What differs between two builds, in words: "other inputs (SHA-256 1a2b.., not 3c4d..)", ..."""
    parts = []
    if built["inputs_sha256"] != wanted["inputs_sha256"]:
        parts.append(f"other inputs (SHA-256 {wanted['inputs_sha256'][:12]}.., not {str(built['inputs_sha256'])[:12]}..)")
    if built["tokenizer"] != wanted["tokenizer"]:
        parts.append(f"another tokenizer ({wanted['tokenizer']}, not {built['tokenizer']})")
    elif built["tokenizer_basis"] != wanted["tokenizer_basis"]:
        parts.append(f"another version of {wanted['tokenizer']} ({wanted['tokenizer_basis'][:20]}, not "
                     f"{str(built['tokenizer_basis'])[:20]})")
    if built["format_version"] != wanted["format_version"]:
        parts.append(f"another format ({wanted['format_version']}, not {built['format_version']})")
    return " and ".join(parts)
