"""Corpora of your own (fp4lab/train/user_corpus.py, corpus.py): a few KB of text written here, built
with bpe:SIZE, embedded and hf: tokenizers and from a dataset saved with save_to_disk, all through the
real tokenizers, datasets and transformers. The manifest is checked against the files (SHA-256
recomputed, tokens counted), the split against its rule written out here, the tokens by decoding them
back to the documents; a different build is refused with nothing changed, an interrupted one
continues, and the corpus loads as a data source."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from fp4lab.train import user_corpus
from fp4lab.train.bpe import END_OF_TEXT
from fp4lab.train.config import corpus_name_problem
from fp4lab.train.corpus import CorpusError, own_corpus_dir, token_dtype
from fp4lab.train.data import DataConfig, load_dataset

ADJECTIVES = ("quick", "lazy", "silent", "golden", "narrow", "bright", "patient", "hollow")
# 260 notes (round(260 * 1 %) = 3 held out), one in French and Japanese so bytes beyond ASCII round-trip.
NOTES = [f"Note {i}: the {ADJECTIVES[i % 8]} fox counted {i * 13} stones by the river.\nIt slept at {i % 24}h.\n"
         for i in range(259)] + ["Éte au bord de l'eau, 日本の川 — fin.\n"]
VOCAB = 300


def write_texts(folder: Path) -> Path:
    """The notes as files (each one document), a copy of one in a subfolder, an empty file and a hidden one."""
    folder.mkdir(parents=True)
    for i, note in enumerate(NOTES):
        (folder / f"note_{i:03d}.txt").write_text(note, encoding="utf-8")
    (folder / "sub").mkdir()
    (folder / "sub" / "copy_of_7.txt").write_text(NOTES[7], encoding="utf-8")
    (folder / "zz_empty.txt").write_text("")
    (folder / ".hidden.txt").write_text("never read\n")
    return folder


# The documents in build order: files sorted by path (note_*, sub/copy_of_7, zz_empty), hidden left out.
ORDER = [*NOTES, NOTES[7], ""]


def split_by_rule(documents: list[str], fraction: float = 0.01) -> tuple[list[str], list[str]]:
    """The documented split, written out: of the distinct non-empty documents, round(fraction * n) (at least
    1, at most n - 1) with the smallest SHA-256 (first 8 bytes) are validation; copies follow them."""
    key = lambda d: int.from_bytes(hashlib.sha256(d.encode()).digest()[:8], "big")
    distinct = sorted({key(d) for d in documents if d})
    held = set(distinct[: min(len(distinct) - 1, max(1, round(len(distinct) * fraction)))])
    return [d for d in documents if d and key(d) not in held], [d for d in documents if d and key(d) in held]


TRAIN_DOCS, VAL_DOCS = split_by_rule(ORDER)


def build(cache: Path, name: str, source: Path | user_corpus.Inputs, tokenizer: str, **options) -> dict:
    inputs = user_corpus.text_inputs([source]) if isinstance(source, Path) else source
    return user_corpus.build(cache, name, inputs, tokenizer, **options)[0]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def ids_of(folder: Path, name: str, manifest: dict) -> np.ndarray:
    return np.fromfile(folder / name, dtype=np.dtype(manifest["token_dtype"]).newbyteorder("<"))


def documents_of(ids: np.ndarray, tokenizer: Tokenizer, end: int) -> list[str]:
    cuts = np.flatnonzero(ids == end)
    assert cuts.size and cuts[-1] == ids.size - 1, "every document ends with the end-of-text token"
    return [tokenizer.decode(part.tolist()) for part in np.split(ids, cuts + 1)[:-1]]


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> Path:
    return write_texts(tmp_path_factory.mktemp("texts") / "notes")


@pytest.fixture(scope="module")
def bpe_built(texts, tmp_path_factory) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("cache")
    return cache, build(cache, "notes", texts, f"bpe:{VOCAB}")


def check_manifest_against_files(folder: Path, manifest: dict) -> None:
    """Every SHA-256 recomputed, every token count from the file's size, the dtype from the vocabulary."""
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert manifest["token_dtype"] == ("uint16" if manifest["vocab_size"] <= 65536 else "uint32")
    width = np.dtype(manifest["token_dtype"]).itemsize
    for name in ("train.bin", "val.bin"):
        blob = (folder / name).read_bytes()
        assert manifest["files"][name] == {"tokens": len(blob) // width, "sha256": hashlib.sha256(blob).hexdigest()}
        assert len(blob) % width == 0 and len(blob) > 0
    tokenizer_blob = (folder / "tokenizer.json").read_bytes()
    assert manifest["files"]["tokenizer.json"] == {"sha256": hashlib.sha256(tokenizer_blob).hexdigest()}
    assert Tokenizer.from_str(tokenizer_blob.decode()).get_vocab_size(with_added_tokens=True) == manifest["vocab_size"]
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "tokenizer.json", "train.bin", "val.bin"]
    assert not [p.name for p in folder.parent.iterdir() if p.name.startswith(".")], "no staging folder left"


def test_a_bpe_build_holds_the_split_documents_and_its_manifest_matches_the_files(bpe_built, texts):
    cache, manifest = bpe_built
    folder = own_corpus_dir(cache, "notes")
    check_manifest_against_files(folder, manifest)
    # The inputs: each file's SHA-256, and the inputs' SHA-256 over the documents' in order.
    listed = manifest["inputs"]["files"]
    assert [Path(f["path"]).relative_to(texts.resolve()).as_posix() for f in listed] == (
        [f"note_{i:03d}.txt" for i in range(len(NOTES))] + ["sub/copy_of_7.txt", "zz_empty.txt"])
    for entry in listed:
        blob = Path(entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(blob).hexdigest() and entry["bytes"] == len(blob)
    documents_digest = hashlib.sha256(b"".join(hashlib.sha256(d.encode()).digest() for d in ORDER)).hexdigest()
    assert manifest["inputs"]["sha256"] == documents_digest
    # The split: 3 of 260 distinct notes held out, the copy of note 7 with it; the empty file counted.
    assert len({*VAL_DOCS}) == 3 and manifest["documents"] == {"train": len(TRAIN_DOCS), "val": len(VAL_DOCS), "empty": 1}
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert manifest["document_end"] == [0] and tokenizer.id_to_token(0) == END_OF_TEXT
    assert manifest["vocab_size"] == VOCAB and manifest["token_dtype"] == "uint16"
    assert documents_of(ids_of(folder, "train.bin", manifest), tokenizer, 0) == TRAIN_DOCS
    assert documents_of(ids_of(folder, "val.bin", manifest), tokenizer, 0) == VAL_DOCS
    assert manifest["files"]["train.bin"]["tokens"] < sum(map(len, TRAIN_DOCS)) / 2  # merges were learned


def test_the_split_does_not_depend_on_the_documents_order(bpe_built, tmp_path):
    shuffled = tmp_path / "shuffled"
    shuffled.mkdir()
    for i, note in enumerate(reversed(NOTES)):
        (shuffled / f"{i:03d}.txt").write_text(note, encoding="utf-8")
    manifest = build(tmp_path / "cache", "shuffled", shuffled, f"bpe:{VOCAB}")
    folder = own_corpus_dir(tmp_path / "cache", "shuffled")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert documents_of(ids_of(folder, "val.bin", manifest), tokenizer, 0) == [d for d in reversed(NOTES) if d in VAL_DOCS]


def test_an_embedded_build_uses_the_shakespeare_tokenizer_and_ends_documents_with_a_blank_line(texts, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path))
    manifest = build(tmp_path, "notes-embedded", texts, "embedded")
    folder = own_corpus_dir(tmp_path, "notes-embedded")
    check_manifest_against_files(folder, manifest)
    shakespeare = load_dataset(DataConfig(source="shakespeare")).tokenizer
    assert (folder / "tokenizer.json").read_text() == shakespeare.to_str()
    assert manifest["vocab_size"] == 4096 and manifest["tokenizer"]["spec"] == "embedded"
    assert manifest["document_end"] == shakespeare.encode("\n\n").ids
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.decode(ids_of(folder, "train.bin", manifest).tolist()) == "".join(d + "\n\n" for d in TRAIN_DOCS)
    assert tokenizer.decode(ids_of(folder, "val.bin", manifest).tolist()) == "".join(d + "\n\n" for d in VAL_DOCS)


def test_a_saved_dataset_builds_the_same_tokens_as_the_same_text_files(bpe_built, tmp_path):
    import datasets

    cache, text_manifest = bpe_built
    rows = datasets.Dataset.from_dict({"text": ORDER, "number": list(range(len(ORDER)))})
    rows.save_to_disk(str(tmp_path / "rows"))
    manifest = build(tmp_path / "cache", "rows", user_corpus.hf_inputs(str(tmp_path / "rows")), f"bpe:{VOCAB}")
    folder = own_corpus_dir(tmp_path / "cache", "rows")
    check_manifest_against_files(folder, manifest)
    assert manifest["inputs"] == {"kind": "hf", "dataset": str((tmp_path / "rows").resolve()), "split": "train",
                                  "column": "text", "rows": len(ORDER), "sha256": text_manifest["inputs"]["sha256"]}
    assert files_of(folder) | {"manifest.json": b""} == files_of(own_corpus_dir(cache, "notes")) | {"manifest.json": b""}
    # A split of a saved DatasetDict, and the one-line errors of a wrong split or column.
    datasets.DatasetDict({"train": rows.select(range(3)), "extra": rows}).save_to_disk(str(tmp_path / "splits"))
    assert user_corpus.hf_inputs(f"{tmp_path / 'splits'}:extra").count == len(ORDER)
    with pytest.raises(CorpusError, match=r"no split 'test'; it has train, extra: name one as .*:SPLIT"):
        user_corpus.hf_inputs(f"{tmp_path / 'splits'}:test")
    with pytest.raises(CorpusError, match=r"no column 'body'; it has text, number: pick one with --column"):
        user_corpus.hf_inputs(str(tmp_path / "rows"), "body")
    with pytest.raises(CorpusError, match=r"row 0 of column 'number' holds int, not text"):
        build(tmp_path / "cache", "numbers", user_corpus.hf_inputs(str(tmp_path / "rows"), "number"), f"bpe:{VOCAB}")
    with pytest.raises(CorpusError, match=r"one dataset without splits; leave out ':train'"):
        user_corpus.hf_inputs(f"{tmp_path / 'rows'}:train")
    (tmp_path / "not-saved").mkdir()
    with pytest.raises(CorpusError, match=r"not-saved: cannot load it \(.*\); pass a folder written by Dataset.save_to_disk"):
        user_corpus.hf_inputs(str(tmp_path / "not-saved"))


def save_hf_tokenizer(tokenizer: Tokenizer, folder: Path, **special) -> Path:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(str(folder))
    return folder


def test_an_hf_tokenizer_from_a_folder_gives_the_tokens_of_the_same_bpe_never_truncated(bpe_built, texts, tmp_path):
    cache, bpe_manifest = bpe_built
    bpe = Tokenizer.from_file(str(own_corpus_dir(cache, "notes") / "tokenizer.json"))
    bpe.enable_truncation(max_length=4)  # as a model's tokenizer may come: it must not cut documents short
    saved = save_hf_tokenizer(bpe, tmp_path / "hf-tokenizer", eos_token=END_OF_TEXT)
    manifest = build(tmp_path / "cache", "notes-hf", texts, f"hf:{saved}")
    folder = own_corpus_dir(tmp_path / "cache", "notes-hf")
    check_manifest_against_files(folder, manifest)
    assert manifest["document_end"] == [0] and manifest["tokenizer"]["spec"] == f"hf:{saved}"
    for name in ("train.bin", "val.bin"):
        assert (folder / name).read_bytes() == (own_corpus_dir(cache, "notes") / name).read_bytes()
        assert manifest["files"][name] == bpe_manifest["files"][name]


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    words = {"[UNK]": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    saved = save_hf_tokenizer(tokenizer, tmp_path / "wide", eos_token="<eos>", unk_token="[UNK]")
    texts = tmp_path / "texts"
    texts.mkdir()
    documents = [[i * 997 % 70_000 + 2, 69_999 + 2, i + 2] for i in range(120)]
    for i, ids in enumerate(documents):
        (texts / f"{i:03d}.txt").write_text(" ".join(f"w{n - 2}" for n in ids))
    manifest = build(tmp_path / "cache", "wide", texts, f"hf:{saved}")
    assert manifest["vocab_size"] == 70_002 and manifest["token_dtype"] == "uint32" == token_dtype(70_002)
    check_manifest_against_files(own_corpus_dir(tmp_path / "cache", "wide"), manifest)
    dataset = _loaded(tmp_path / "cache", "wide")
    assert dataset.train.dtype == np.dtype("<u4") and dataset.vocab_size == 70_002
    ids = np.concatenate([dataset.train, dataset.val]).tolist()
    assert sorted(tuple(ids[i : i + 4]) for i in range(0, len(ids), 4)) == sorted(tuple(d + [1]) for d in documents)
    assert token_dtype(65_536) == "uint16"


def _loaded(cache: Path, name: str):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FP4LAB_CACHE", str(cache))
        return load_dataset(DataConfig(source=name))


# --- the same name, another build; interrupted builds -------------------------------------------------


def test_another_build_under_the_same_name_is_refused_with_nothing_changed(bpe_built, texts, tmp_path):
    cache = tmp_path / "cache"
    first = build(cache, "notes", texts, f"bpe:{VOCAB}")
    folder = own_corpus_dir(cache, "notes")
    before = files_of(folder)
    again, built_now = user_corpus.build(cache, "notes", user_corpus.text_inputs([texts]), f"bpe:{VOCAB}")
    assert again == first and not built_now and files_of(folder) == before
    with pytest.raises(CorpusError, match=r"^data build notes: another tokenizer \(bpe:400, not bpe:300\) than the "
                                          r"corpus built in .*; add --force to replace it, or choose another name$"):
        build(cache, "notes", texts, "bpe:400")
    more = tmp_path / "more"
    write_texts(more)
    (more / "extra.txt").write_text("One more note.\n")
    with pytest.raises(CorpusError, match=r"^data build notes: other inputs \(SHA-256 [0-9a-f]{12}\.\., not "
                                          rf"{first['inputs']['sha256'][:12]}\.\.\) than the corpus built in"):
        build(cache, "notes", more, f"bpe:{VOCAB}")
    assert files_of(folder) == before and sorted(p.name for p in folder.parent.iterdir()) == ["notes"]
    replaced = build(cache, "notes", more, f"bpe:{VOCAB}", force=True)
    assert replaced["documents"]["train"] + replaced["documents"]["val"] == len(TRAIN_DOCS) + len(VAL_DOCS) + 1
    check_manifest_against_files(folder, replaced)


class Interrupt(Exception):
    pass


def interrupt_at(fragment: str):
    def status(message: str, done: int | None = None, total: int | None = None) -> None:
        if fragment in message:
            raise Interrupt(message)

    return status


def test_an_interrupted_build_continues_from_what_it_finished(bpe_built, texts, tmp_path):
    cache, manifest = bpe_built
    other = tmp_path / "cache"
    with pytest.raises(Interrupt):
        build(other, "notes", texts, f"bpe:{VOCAB}", status=interrupt_at("into val.bin"))
    staging = other / "corpora" / ".notes.building"
    assert not own_corpus_dir(other, "notes").exists()
    assert sorted(p.name for p in staging.iterdir()) == ["identity.json", "tokenizer.json", "train.bin"]
    (staging / ".val.bin.0123456789abcdef.tmp").write_bytes(b"\x01\x02\x03")  # a write killed mid-way
    seen = []
    resumed = build(other, "notes", texts, f"bpe:{VOCAB}", status=lambda message, *counts: seen.append(message))
    assert "notes: the tokenizer of the interrupted build is kept" in seen
    assert "notes: train.bin of the interrupted build is kept" in seen
    assert not [m for m in seen if "training a" in m or "into train.bin" in m] and any("into val.bin" in m for m in seen)
    assert resumed == manifest and files_of(own_corpus_dir(other, "notes")) == files_of(own_corpus_dir(cache, "notes"))
    assert not staging.exists()


def test_a_staging_folder_of_another_build_is_not_reused(bpe_built, texts, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(Interrupt):
        build(cache, "notes", texts, "bpe:400", status=interrupt_at("into val.bin"))
    seen = []
    manifest = build(cache, "notes", texts, f"bpe:{VOCAB}", status=lambda message, *counts: seen.append(message))
    assert not [m for m in seen if "kept" in m] and any("training a" in m for m in seen)
    assert files_of(own_corpus_dir(cache, "notes")) == files_of(own_corpus_dir(bpe_built[0], "notes"))
    assert manifest == bpe_built[1]


def test_an_interrupted_rebuild_keeps_the_corpus_in_place(bpe_built, texts, tmp_path):
    cache = tmp_path / "cache"
    build(cache, "notes", texts, f"bpe:{VOCAB}")
    before = files_of(own_corpus_dir(cache, "notes"))
    with pytest.raises(Interrupt):
        build(cache, "notes", texts, "bpe:400", force=True, status=interrupt_at("training a"))
    assert files_of(own_corpus_dir(cache, "notes")) == before


# --- as a data source ---------------------------------------------------------------------------------


def test_a_built_corpus_is_a_data_source_by_its_name(bpe_built):
    cache, manifest = bpe_built
    dataset = _loaded(cache, "notes")
    folder = own_corpus_dir(cache, "notes")
    assert dataset.name == "notes" and dataset.vocab_size == VOCAB
    assert np.array_equal(dataset.train, ids_of(folder, "train.bin", manifest))
    assert np.array_equal(dataset.val, ids_of(folder, "val.bin", manifest))
    assert dataset.decode(dataset.val[: manifest["files"]["val.bin"]["tokens"]]).startswith(VAL_DOCS[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FP4LAB_CACHE", str(cache))
        with pytest.raises(ValueError, match="vocab_size=512: the notes corpus has a 300-token vocabulary"):
            load_dataset(DataConfig(source="notes", vocab_size=512))
        with pytest.raises(ValueError, match=r"source='poems': no corpus 'poems' is built in .*corpora; build it: "
                                             r"`fp4lab data build poems --text FILES\|DIR\.\.\."):
            load_dataset(DataConfig(source="poems"))
        with pytest.raises(ValueError, match=r"source='My.Poems' is not valid: use .* the name of a corpus built"):
            load_dataset(DataConfig(source="My.Poems"))


def test_a_corpus_of_another_format_asks_to_be_built_again(bpe_built, tmp_path):
    import shutil

    folder = own_corpus_dir(tmp_path, "notes")
    shutil.copytree(own_corpus_dir(bpe_built[0], "notes"), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"format_version": 0}))
    with pytest.raises(ValueError, match=r"format_version 0, not name 'notes' format_version 1; build it again .*--force"):
        _loaded(tmp_path, "notes")


@pytest.mark.parametrize("name, problem", [
    ("pycode", "built-in data source"), ("shakespeare", "built-in data source"), ("Notes", "not a corpus name"),
    ("notes.bin", "not a corpus name"), ("data/notes", "not a corpus name"), ("", "not a corpus name"),
    ("7notes", "not a corpus name"), ("n" * 65, "not a corpus name"), ("my-notes_2", None),
])  # fmt: skip
def test_corpus_names_cannot_be_paths_or_built_in_sources(name, problem):
    found = corpus_name_problem(name)
    assert (found is None) if problem is None else (problem in found)


@pytest.mark.parametrize("spec, message", [
    ("bpe", "is not supported; use embedded, bpe:SIZE"), ("bpe:100", "at least 257 tokens"),
    ("gpt2", "is not supported"), ("hf:", "is not supported"),
])  # fmt: skip
def test_bad_tokenizer_specs_are_refused(spec, message):
    with pytest.raises(CorpusError, match=message):
        user_corpus.parse_tokenizer(spec)


def test_unreadable_inputs_are_refused_naming_the_file(tmp_path):
    with pytest.raises(CorpusError, match=r"--text .*nowhere: no such file or folder"):
        user_corpus.text_inputs([tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match=r"the folder holds no files"):
        user_corpus.text_inputs([tmp_path / "empty"])
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("fine\n")
    with pytest.raises(CorpusError, match=r"latin1\.txt: not UTF-8 text \(byte 3\)"):
        build(tmp_path / "cache", "x", user_corpus.text_inputs([tmp_path / "ok.txt", tmp_path / "latin1.txt"]), "bpe:300")
    with pytest.raises(CorpusError, match=r"1 distinct non-empty document\(s\); training and validation need at least 2"):
        build(tmp_path / "cache", "x", user_corpus.text_inputs([tmp_path / "ok.txt"]), "bpe:300")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))
