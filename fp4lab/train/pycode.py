"""The "pycode" corpus: Python source of 21 open-source projects, as served by PyPI, for GPU-scale runs.

The Shakespeare default (1.5M tokens) is too small for a 125m-350m model: it would see every token
many times over. No package registry serves a large natural-language corpus (no PyPI or Debian
package ships TinyStories, WikiText or web text), but PyPI serves real, human-written code in
quantity: the source distributions of well-known projects. pycode is the `.py` files of 21 of them,
pinned by version and SHA-256 (`PACKAGES`: 270 MB of source, 70.8M tokens), all under permissive
licenses (BSD, MIT, Apache-2.0). Code is a standard language-modelling domain (The Stack, StarCoder);
an FP4 recipe that trains it as well as bf16 passes a test of the same kind as on web text.

Building (`fp4lab data build pycode`, once, needs files.pythonhosted.org):
  1. download each pinned sdist into $FP4LAB_CACHE/downloads (checked against its SHA-256);
  2. keep its `.py` files in name order (Windows newlines made Unix), leaving out files over
     `MAX_FILE_BYTES` (generated tables), files with a line over `MAX_LINE_CHARS` (data blobs), files
     that are not UTF-8, hold the end-of-text marker, are blank, or repeat an earlier file
     (vendored copies): the manifest counts each kind;
  3. hold out every document whose SHA-256 falls in the lowest `VAL_PERCENT` % for validation;
  4. train a byte-level BPE of `VOCAB_SIZE` tokens (the same trainer as Shakespeare's) with one special
     token, `<|endoftext|>` (id 0), on the training documents;
  5. tokenize each document and end it with `<|endoftext|>`: train.bin and val.bin (uint16).

The folder $FP4LAB_CACHE/pycode then holds manifest.json (packages, filters, counts, each file's
SHA-256), tokenizer.json, train.bin and val.bin; decoding the token files gives the documents back
(byte-level BPE round-trips exactly). `fp4lab data pack pycode DIR` writes the portable bundle, the
manifest, the tokenizer and the xz-compressed token files (34 MB); `fp4lab data build pycode --from
DIR` unpacks it with no network and checks every file against the manifest's SHA-256: how the
corpus travels, tokenized once, to a GPU machine that cannot reach PyPI, and how that machine knows
it trains on the same tokens.

A build writes into a hidden folder beside its target and renames it into place at the end: an
interrupted or refused build leaves no half corpus behind.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from fp4lab.train.atomic import replace_atomically, replace_folder
from fp4lab.train.bpe import train_tokenizer
from fp4lab.train.config import PYCODE as NAME

FORMAT_VERSION = 1
VOCAB_SIZE = 32768
END_OF_TEXT = "<|endoftext|>"
VAL_PERCENT = 1
MAX_FILE_BYTES = 200_000
MAX_LINE_CHARS = 1000
TOKEN_FILES = ("train.bin", "val.bin")
BUNDLE_FILES = ("manifest.json", "tokenizer.json", *(f"{name}.xz" for name in TOKEN_FILES))
_ENCODE_CHUNK = 512  # documents per encode_batch call: bounds the memory of the Encoding objects


@dataclass(frozen=True)
class Sdist:
    """One pinned source distribution on PyPI."""

    name: str
    version: str
    license: str
    url: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.url.rsplit("/", 1)[1]


def _pypi(path: str) -> str:
    return f"https://files.pythonhosted.org/packages/{path}"


PACKAGES: tuple[Sdist, ...] = (
    Sdist("transformers", "4.46.3", "Apache-2.0", _pypi("37/5a/58f96c83e566f907ae39f16d4401bbefd8bb85c60bd1e6a95c419752ab90/transformers-4.46.3.tar.gz"), "8ee4b3ae943fe33e82afff8e837f4b052058b07ca9be3cb5b729ed31295f72cc"),
    Sdist("salt", "3007.1", "Apache-2.0", _pypi("2d/9f/198e2d3b930f74724ffe7c01e377b356ee2da7fa88634ef41f244753b72e/salt-3007.1.tar.gz"), "b933ac4cb3e4b1118b46dada55c9cc6bdc6f0f94b4c92877aec44b25c6a28c9a"),
    Sdist("sympy", "1.13.3", "BSD-3-Clause", _pypi("11/8a/5a7fd6284fa8caac23a26c9ddf9c30485a48169344b4bd3b0f02fef1890f/sympy-1.13.3.tar.gz"), "b27fd2c6530e0ab39e275fc9b683895367e51d5da91baa8d3d64db2565fec4d9"),
    Sdist("pandas", "2.2.3", "BSD-3-Clause", _pypi("9c/d6/9f8431bacc2e19dca897724cd097b1bb224a6ad5433784a44b587c7c13af/pandas-2.2.3.tar.gz"), "4f18ba62b61d7e192368b84517265a99b4d7ee8912f8708660fb4a366cc82667"),
    Sdist("sqlalchemy", "2.0.36", "MIT", _pypi("50/65/9cbc9c4c3287bed2499e05033e207473504dc4df999ce49385fb1f8b058a/sqlalchemy-2.0.36.tar.gz"), "7f2767680b6d2398aea7082e45a774b2b0767b5c8d8ffb9c8b683088ea9b29c5"),
    Sdist("django", "5.1.4", "BSD-3-Clause", _pypi("d3/e8/536555596dbb79f6e77418aeb40bdc1758c26725aba31919ba449e6d5e6a/Django-5.1.4.tar.gz"), "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a"),
    Sdist("statsmodels", "0.14.4", "BSD-3-Clause", _pypi("1f/3b/963a015dd8ea17e10c7b0e2f14d7c4daec903baf60a017e756b57953a4bf/statsmodels-0.14.4.tar.gz"), "5d69e0f39060dc72c067f9bb6e8033b6dccdb0bae101d76a7ef0bcc94e898b67"),
    Sdist("scikit-learn", "1.5.2", "BSD-3-Clause", _pypi("37/59/44985a2bdc95c74e34fef3d10cb5d93ce13b0e2a7baefffe1b53853b502d/scikit_learn-1.5.2.tar.gz"), "b4237ed7b3fdd0a4882792e68ef2545d5baa50aca3bb45aa7df468138ad8f94d"),
    Sdist("astropy", "6.1.6", "BSD-3-Clause", _pypi("8b/5d/3cfd730e64d96c81d69ec1560ea315dd6168f34aa60e8e8fe3dc29f1221a/astropy-6.1.6.tar.gz"), "63e153747de7892138860925f0395de66d0bd036c69837f68bf93aeadaac6847"),
    Sdist("numpy", "2.1.3", "BSD-3-Clause", _pypi("25/ca/1166b75c21abd1da445b97bf1fa2f14f423c6cfb4fc7c4ef31dccf9f6a94/numpy-2.1.3.tar.gz"), "aa08e04e08aaf974d4458def539dece0d28146d866a39da5639596f4921fd761"),
    Sdist("twisted", "24.10.0", "MIT", _pypi("b2/0f/2d0b0dcd52a849db64ff63619aead94ae1091fe4d4d7e100371efe513585/twisted-24.10.0.tar.gz"), "02951299672595fea0f70fa2d5f7b5e3d56836157eda68859a6ad6492d36756e"),
    Sdist("jax", "0.4.35", "Apache-2.0", _pypi("e3/34/21da583b9596e72bb8e95b6197dee0a44b96b9ea2c147fccabd43ca5515b/jax-0.4.35.tar.gz"), "c0c986993026b10bf6f607fecb7417377460254640766ce40f1fef3fd139c12e"),
    Sdist("networkx", "3.4.2", "BSD-3-Clause", _pypi("fd/1d/06475e1cd5264c0b870ea2cc6fdb3e37177c1e565c43f56ff17a10e3937f/networkx-3.4.2.tar.gz"), "307c3669428c5362aab27c8a1260aa8f47c4e91d3891f48be0141738d8d053e1"),
    Sdist("nltk", "3.9.1", "Apache-2.0", _pypi("3c/87/db8be88ad32c2d042420b6fd9ffd4a149f9a0d7f0e86b3f543be2eeeedd2/nltk-3.9.1.tar.gz"), "87d127bd3de4bd89a4f81265e5fa59cb1b199b27440175370f7417d2bc7ae868"),
    Sdist("mypy", "1.13.0", "MIT", _pypi("e8/21/7e9e523537991d145ab8a0a2fd98548d67646dc2aaaf6091c31ad883e7c1/mypy-1.13.0.tar.gz"), "0291a61b6fbf3e6673e3405cfcc0e7650bebc7939659fdca2702958038bd835e"),
    Sdist("dask", "2024.11.2", "BSD-3-Clause", _pypi("9d/a1/6d06c4cc93349377a9f318f2ebff5b637e6ffee373e38f363123b4b1afa7/dask-2024.11.2.tar.gz"), "9a72bee3f149ff89bc492340d4bcba33d5dd3e3a9d471d2b4b3872f2d71ddaae"),
    Sdist("sphinx", "8.1.3", "BSD-2-Clause", _pypi("6f/6d/be0b61178fe2cdcb67e2a92fc9ebb488e3c51c4f74a36a7824c0adf23425/sphinx-8.1.3.tar.gz"), "43c1911eecb0d3e161ad78611bc905d1ad0e523e4ddc202a58a821773dc4c927"),
    Sdist("keras", "3.6.0", "Apache-2.0", _pypi("47/22/448401abc7deaee90592c48c5dcc27ad93518b605655bef7ec5eb9544fe5/keras-3.6.0.tar.gz"), "405727525a3522ed8f9ec0b46e0667e4c65fcf714a067322c16a00d902ded41d"),
    Sdist("pip", "24.3.1", "MIT", _pypi("f4/b1/b422acd212ad7eedddaf7981eee6e5de085154ff726459cf2da7c5a184c1/pip-24.3.1.tar.gz"), "ebcb60557f2aefabc2e0f918751cd24ea0d56d8ec5445fe1807f1d2109660b99"),
    Sdist("setuptools", "75.6.0", "MIT", _pypi("43/54/292f26c208734e9a7f067aea4a7e282c080750c4546559b58e2e45413ca0/setuptools-75.6.0.tar.gz"), "8199222558df7c86216af4f84c30e9b34a61d8ba19366cc914424cdbd28252f6"),
    Sdist("ipython", "8.29.0", "BSD-3-Clause", _pypi("85/e0/a3f36dde97e12121106807d80485423ae4c5b27ce60d40d4ab0bab18a9db/ipython-8.29.0.tar.gz"), "40b60e15b22591450eef73e40a027cf77bd652e757523eebc5bd7c7c498290eb"),
)  # fmt: skip

Status = Callable[[str], None]


class CorpusError(ValueError):
    """A corpus that cannot be built or loaded; the message names the place and the fix."""


def corpus_dir(cache: Path) -> Path:
    return cache / NAME


# ---------------------------------------------------------------------------------------------------
# Documents: sdists -> kept .py files.


def download(sdist: Sdist, downloads: Path, status: Status) -> Path:
    """The sdist's file under `downloads`, fetched unless a copy with the pinned SHA-256 is there."""
    target = downloads / sdist.filename
    if target.is_file() and _sha256_file(target) == sdist.sha256:
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.part")
    status(f"{NAME}: downloading {sdist.filename}")
    try:
        with urllib.request.urlopen(sdist.url, timeout=120) as response, partial.open("wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except (urllib.error.URLError, OSError) as exc:
        partial.unlink(missing_ok=True)
        raise CorpusError(f"{NAME}: downloading {sdist.url} failed ({exc}); check access to that host, "
                          f"or build from a bundle: fp4lab data build {NAME} --from DIR") from None
    except BaseException:  # Ctrl-C mid-download: leave no partial file behind
        partial.unlink(missing_ok=True)
        raise
    digest = _sha256_file(partial)
    if digest != sdist.sha256:
        partial.unlink()
        raise CorpusError(f"{NAME}: {sdist.filename} has SHA-256 {digest}, not the pinned {sdist.sha256}; "
                          "the download is corrupt or the pin is wrong: retry, or fix the pin in PACKAGES")
    os.replace(partial, target)
    return target


def sdist_documents(archive: Path, seen: set[bytes], skipped: Counter) -> Iterator[str]:
    """The kept `.py` files of one sdist, in member-name order; `seen` holds the digests of the
    documents kept so far (exact repeats are left out), `skipped` counts what is left out and why."""
    with tarfile.open(archive) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".py")), key=lambda m: m.name)
        for member in members:
            if member.size > MAX_FILE_BYTES:
                skipped["larger than MAX_FILE_BYTES"] += 1
                continue
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8").replace("\r\n", "\n")
            except UnicodeDecodeError:
                skipped["not UTF-8"] += 1
                continue
            if END_OF_TEXT in text:  # it would encode as the separator token
                skipped["holds the end-of-text marker"] += 1
            elif not text.strip():
                skipped["blank"] += 1
            elif max(len(line) for line in text.split("\n")) > MAX_LINE_CHARS:
                skipped["a line longer than MAX_LINE_CHARS"] += 1
            elif (digest := hashlib.sha256(text.encode()).digest()) in seen:
                skipped["repeats an earlier file"] += 1
            else:
                seen.add(digest)
                yield text


def is_validation(document: str) -> bool:
    """The held-out documents: those whose SHA-256 falls in the lowest VAL_PERCENT %."""
    return int.from_bytes(hashlib.sha256(document.encode()).digest()[:8], "big") % 100 < VAL_PERCENT


# ---------------------------------------------------------------------------------------------------
# Tokens.


def encode_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> np.ndarray:
    """Each document's ids followed by <|endoftext|>, all concatenated, as uint16."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    parts = []
    for first in range(0, len(documents), _ENCODE_CHUNK):
        for encoding in tokenizer.encode_batch(documents[first : first + _ENCODE_CHUNK], add_special_tokens=False):
            parts.append(np.asarray(encoding.ids, dtype=np.uint16))
            parts.append(np.asarray([end], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_tokens(folder: Path, train_docs: Sequence[str], val_docs: Sequence[str], tokenizer: Tokenizer,
                  status: Status) -> dict[str, dict[str, int | str]]:
    files = {}
    for name, docs in zip(TOKEN_FILES, (train_docs, val_docs)):
        status(f"{NAME}: tokenizing {len(docs):,} documents into {name}")
        ids = encode_documents(tokenizer, docs)
        (folder / name).write_bytes(ids.tobytes())
        files[name] = {"tokens": int(ids.size), "sha256": _sha256_file(folder / name)}
    return files


# ---------------------------------------------------------------------------------------------------
# Build, rebuild from a bundle, load.


def build(cache: Path, *, packages: Sequence[Sdist] = PACKAGES, vocab_size: int = VOCAB_SIZE,
          status: Status = lambda message: None) -> dict:
    """Download, filter, split, train the tokenizer, tokenize; the manifest of the new corpus. Replaces
    the folder only when everything is written."""

    seen: set[bytes] = set()
    skipped: Counter = Counter()
    train_docs: list[str] = []
    val_docs: list[str] = []
    sources = []
    for sdist in packages:
        archive = download(sdist, cache / "downloads", status)
        status(f"{NAME}: reading {sdist.filename}")
        kept = list(sdist_documents(archive, seen, skipped))
        for document in kept:
            (val_docs if is_validation(document) else train_docs).append(document)
        sources.append({**asdict(sdist), "documents": len(kept), "characters": sum(map(len, kept))})
    if not train_docs or not val_docs:
        raise CorpusError(f"{NAME}: the packages gave {len(train_docs)} training and {len(val_docs)} validation "
                          "documents; both must be non-empty: add packages")
    status(f"{NAME}: training a {vocab_size}-token byte-level BPE on {len(train_docs):,} documents")
    tokenizer = train_tokenizer(train_docs, vocab_size, special_tokens=(END_OF_TEXT,))
    manifest = {
        "name": NAME, "format_version": FORMAT_VERSION, "vocab_size": tokenizer.get_vocab_size(),
        "end_of_text_id": tokenizer.token_to_id(END_OF_TEXT), "tokenizers_version": tokenizers.__version__,
        "filters": {"max_file_bytes": MAX_FILE_BYTES, "max_line_chars": MAX_LINE_CHARS, "val_percent": VAL_PERCENT},
        "skipped": dict(sorted(skipped.items())), "packages": sources,
        "documents": {"train": len(train_docs), "val": len(val_docs)},
        "characters": {"train": sum(map(len, train_docs)), "val": sum(map(len, val_docs))},
    }  # fmt: skip

    def write(folder: Path) -> None:
        (folder / "tokenizer.json").write_text(tokenizer.to_str())
        manifest["files"] = {
            **_write_tokens(folder, train_docs, val_docs, tokenizer, status),
            "tokenizer.json": {"sha256": _sha256_file(folder / "tokenizer.json")},
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    replace_folder(corpus_dir(cache), write)
    return manifest


def pack(cache: Path, bundle: Path, *, status: Status = lambda message: None) -> dict:
    """Write the built corpus's portable bundle into `bundle`: the manifest, the tokenizer and each
    token file xz-compressed. Files of the same names there are replaced; nothing else is touched."""
    manifest = load(cache)[3]
    folder = corpus_dir(cache)
    bundle.mkdir(parents=True, exist_ok=True)
    for name in TOKEN_FILES:
        status(f"{NAME}: compressing {name}")
        replace_atomically(bundle / f"{name}.xz", lambda out, name=name: _xz(folder / name, out))
    for name in ("tokenizer.json", "manifest.json"):
        replace_atomically(bundle / name, lambda out, name=name: out.write((folder / name).read_bytes()))
    return manifest


def unpack(cache: Path, bundle: Path, *, status: Status = lambda message: None) -> dict:
    """The corpus from a bundle (see `pack`), with no network: every file must match the manifest's
    SHA-256, or nothing is written."""
    missing = [name for name in BUNDLE_FILES if not (bundle / name).is_file()]
    if missing:
        raise CorpusError(f"{bundle}: not a {NAME} bundle, {', '.join(missing)} missing; make one with "
                          f"`fp4lab data pack {NAME} DIR` where the corpus is built")
    manifest = _read_manifest(bundle)

    def write(folder: Path) -> None:
        shutil.copyfile(bundle / "manifest.json", folder / "manifest.json")
        shutil.copyfile(bundle / "tokenizer.json", folder / "tokenizer.json")
        for name in TOKEN_FILES:
            status(f"{NAME}: unpacking {name}")
            try:
                with lzma.open(bundle / f"{name}.xz") as source, (folder / name).open("wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
            except (lzma.LZMAError, EOFError) as exc:
                raise CorpusError(f"{bundle / (name + '.xz')}: not a whole xz file ({exc}); copy the bundle again") from None
        for name in ("tokenizer.json", *TOKEN_FILES):
            if _sha256_file(folder / name) != manifest["files"][name]["sha256"]:
                raise CorpusError(f"{bundle}: {name} differs from the manifest's SHA-256; the bundle is damaged "
                                  "or not of this manifest: copy it again")

    replace_folder(corpus_dir(cache), write)
    return manifest


def _xz(path: Path, out) -> None:
    compressor = lzma.LZMACompressor(preset=6)
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 20), b""):
            out.write(compressor.compress(block))
    out.write(compressor.flush())


def load(cache: Path) -> tuple[np.memmap, np.memmap, Tokenizer, dict]:
    """(train ids, val ids, tokenizer, manifest) of the built corpus."""
    folder = corpus_dir(cache)
    if not all((folder / name).is_file() for name in ("manifest.json", "tokenizer.json", *TOKEN_FILES)):
        raise CorpusError(f"DataConfig.source='{NAME}': the corpus is not built in {folder}; run "
                          f"`fp4lab data build {NAME}` (downloads 157 MB from PyPI) or "
                          f"`fp4lab data build {NAME} --from BUNDLE` (offline)")
    manifest = _read_manifest(folder)
    train, val = (np.memmap(folder / name, dtype=np.uint16, mode="r") for name in TOKEN_FILES)
    return train, val, Tokenizer.from_file(str(folder / "tokenizer.json")), manifest


def _read_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{folder / 'manifest.json'}: unreadable ({exc}); build the corpus again") from None
    if manifest.get("name") != NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise CorpusError(f"{folder / 'manifest.json'}: {manifest.get('name')!r} format {manifest.get('format_version')!r}, "
                          f"not {NAME!r} format {FORMAT_VERSION}; build it again with this fp4lab: "
                          f"fp4lab data build {NAME} --force")
    return manifest
