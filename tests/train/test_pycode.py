"""The pycode corpus builder (fp4lab/train/pycode.py), offline: small sdists made here and served as
file:// URLs go through the real download, filter, split, BPE and tokenization; a packed bundle gives
the same files elsewhere; damaged inputs are refused with nothing left behind."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from fp4lab.train import pycode
from fp4lab.train.data import DataConfig, load_dataset

VOCAB = 300
# Documents the filters keep: enough that the 1 % hash split holds some out.
KEPT = [f"def function_{i}(value):\n    total = value * {i}\n    return total + {i * 7}\n" for i in range(400)]
HELD_OUT = [d for d in KEPT if pycode.is_validation(d)]
# One file for each reason a file is left out.
LEFT_OUT = {
    "larger than MAX_FILE_BYTES": "x = 1\n" * (pycode.MAX_FILE_BYTES // 6 + 1),
    "not UTF-8": b"name = '\xff\xfe'\n",
    "holds the end-of-text marker": "TOKEN = '<|endoftext|>'\n",
    "blank": "\n  \n",
    "a line longer than MAX_LINE_CHARS": "DATA = [" + "1, " * pycode.MAX_LINE_CHARS + "]\n",
    "repeats an earlier file": KEPT[3],
}


def make_sdist(folder: Path, name: str, files: dict[str, str | bytes]) -> pycode.Sdist:
    archive = folder / f"{name}-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, content in files.items():
            raw = content if isinstance(content, bytes) else content.encode()
            member = tarfile.TarInfo(f"{name}-1.0/{path}")
            member.size = len(raw)
            tar.addfile(member, io.BytesIO(raw))
    return pycode.Sdist(name, "1.0", "MIT", archive.as_uri(), hashlib.sha256(archive.read_bytes()).hexdigest())


@pytest.fixture(scope="module")
def sdists(tmp_path_factory) -> list[pycode.Sdist]:
    folder = tmp_path_factory.mktemp("sdists")
    first = {f"alpha/mod_{i:03d}.py": doc for i, doc in enumerate(KEPT[:200])}
    first["alpha/README.txt"] = "not Python: never read\n"
    second = {f"beta/mod_{i:03d}.py": doc for i, doc in enumerate(KEPT[200:])}
    second.update({f"beta/zz_left_out_{i}.py": content for i, content in enumerate(LEFT_OUT.values())})
    second["beta/windows.py"] = "x = 1\r\ny = 2\r\n"
    return [make_sdist(folder, "alpha", first), make_sdist(folder, "beta", second)]


@pytest.fixture(scope="module")
def built(sdists, tmp_path_factory) -> tuple[Path, dict]:
    cache = tmp_path_factory.mktemp("cache")
    return cache, pycode.build(cache, packages=sdists, vocab_size=VOCAB)


def documents_of(ids: np.ndarray, tokenizer, end: int) -> list[str]:
    cuts = np.flatnonzero(ids == end)
    assert cuts.size and cuts[-1] == ids.size - 1, "every document ends with <|endoftext|>"
    return [tokenizer.decode(part.tolist()) for part in np.split(ids, cuts + 1)[:-1]]


def test_the_build_keeps_the_right_files_splits_by_hash_and_tokenizes_every_document(built):
    cache, manifest = built
    train, val, tokenizer, loaded = pycode.load(cache)
    assert loaded == manifest
    assert manifest["skipped"] == {reason: 1 for reason in LEFT_OUT}
    kept = [*KEPT, "x = 1\ny = 2\n"]  # Windows newlines made Unix
    expected_val = [d for d in kept if pycode.is_validation(d)]
    expected_train = [d for d in kept if not pycode.is_validation(d)]
    assert 0 < len(HELD_OUT) == len(expected_val) < 20
    assert manifest["documents"] == {"train": len(expected_train), "val": len(expected_val)}
    end = manifest["end_of_text_id"]
    assert end == 0 and tokenizer.id_to_token(end) == pycode.END_OF_TEXT and manifest["vocab_size"] == VOCAB
    # The kept files in package order, then member-name order, each once, each ended by <|endoftext|>.
    assert documents_of(np.asarray(train), tokenizer, end) == expected_train
    assert documents_of(np.asarray(val), tokenizer, end) == expected_val
    assert len(train) < manifest["characters"]["train"] / 2  # merges were learned
    for name in pycode.TOKEN_FILES:
        blob = (pycode.corpus_dir(cache) / name).read_bytes()
        assert manifest["files"][name] == {"tokens": len(blob) // 2, "sha256": hashlib.sha256(blob).hexdigest()}
    assert [(p["name"], p["documents"]) for p in manifest["packages"]] == [("alpha", 200), ("beta", 201)]
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".")]  # no staging folder left


CORPUS_FILES = ("manifest.json", "tokenizer.json", *pycode.TOKEN_FILES)


def test_a_packed_bundle_unpacks_to_the_same_files_offline(built, tmp_path):
    cache, manifest = built
    bundle = tmp_path / "bundle"
    assert pycode.pack(cache, bundle) == manifest
    assert sorted(p.name for p in bundle.iterdir()) == sorted(pycode.BUNDLE_FILES)
    assert lzma.decompress((bundle / "train.bin.xz").read_bytes()) == (pycode.corpus_dir(cache) / "train.bin").read_bytes()
    other = tmp_path / "other-machine"
    assert pycode.unpack(other, bundle) == manifest
    for name in CORPUS_FILES:
        assert (pycode.corpus_dir(other) / name).read_bytes() == (pycode.corpus_dir(cache) / name).read_bytes()
    assert sorted(p.name for p in other.iterdir()) == ["pycode"]


def test_a_damaged_bundle_is_refused_and_the_corpus_in_place_is_kept(built, tmp_path):
    cache, _ = built
    bundle, other = tmp_path / "bundle", tmp_path / "other"
    pycode.pack(cache, bundle)
    pycode.unpack(other, bundle)
    before = {p.name: p.read_bytes() for p in pycode.corpus_dir(other).iterdir()}
    tokens = bytearray(lzma.decompress((bundle / "train.bin.xz").read_bytes()))
    tokens[2] ^= 1  # one token changed, the file a whole xz stream
    (bundle / "train.bin.xz").write_bytes(lzma.compress(bytes(tokens)))
    with pytest.raises(pycode.CorpusError, match=r"train\.bin differs from the manifest's SHA-256"):
        pycode.unpack(other, bundle)
    (bundle / "train.bin.xz").write_bytes(lzma.compress(bytes(tokens))[:-20])  # cut short in transit
    with pytest.raises(pycode.CorpusError, match=r"train\.bin\.xz: not a whole xz file"):
        pycode.unpack(other, bundle)
    (bundle / "tokenizer.json").unlink()
    with pytest.raises(pycode.CorpusError, match="not a pycode bundle, tokenizer.json missing; make one with `fp4lab data pack"):
        pycode.unpack(other, bundle)
    assert {p.name: p.read_bytes() for p in pycode.corpus_dir(other).iterdir()} == before
    assert sorted(p.name for p in other.iterdir()) == ["pycode"]


def test_a_download_that_does_not_match_its_pin_is_refused_with_nothing_kept(sdists, tmp_path):
    wrong = pycode.Sdist(sdists[0].name, "1.0", "MIT", sdists[0].url, "0" * 64)
    with pytest.raises(pycode.CorpusError, match=f"has SHA-256 {sdists[0].sha256}, not the pinned 0000"):
        pycode.build(tmp_path, packages=[wrong, sdists[1]], vocab_size=VOCAB)
    missing = pycode.Sdist("gone", "1.0", "MIT", (tmp_path / "gone-1.0.tar.gz").as_uri(), "0" * 64)
    with pytest.raises(pycode.CorpusError, match=r"downloading file:.*gone-1\.0\.tar\.gz failed .* --from DIR"):
        pycode.build(tmp_path, packages=[missing], vocab_size=VOCAB)
    assert list((tmp_path / "downloads").iterdir()) == [] and not pycode.corpus_dir(tmp_path).exists()


def test_a_download_stopped_by_ctrl_c_leaves_no_partial_file(sdists, tmp_path, monkeypatch):
    def interrupted(source, target, length):
        target.write(source.read(10))
        raise KeyboardInterrupt

    monkeypatch.setattr(pycode.shutil, "copyfileobj", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pycode.download(sdists[0], tmp_path / "downloads", lambda message: None)
    assert list((tmp_path / "downloads").iterdir()) == []


def test_a_pinned_download_is_not_fetched_twice(sdists, tmp_path):
    downloads = tmp_path / "downloads"
    first = pycode.download(sdists[0], downloads, lambda message: None)
    seen = []
    assert pycode.download(sdists[0], downloads, seen.append) == first and seen == []
    first.write_bytes(b"damaged")
    pycode.download(sdists[0], downloads, seen.append)
    assert seen == ["pycode: downloading alpha-1.0.tar.gz"] and hashlib.sha256(first.read_bytes()).hexdigest() == sdists[0].sha256


def test_the_pins_are_well_formed():
    names = [p.name for p in pycode.PACKAGES]
    assert len(names) == len(set(names)) == 21
    for sdist in pycode.PACKAGES:
        assert re.fullmatch(r"[0-9a-f]{64}", sdist.sha256), sdist
        assert sdist.url.startswith("https://files.pythonhosted.org/packages/") and sdist.filename.endswith(".tar.gz")
        assert sdist.version in sdist.filename and sdist.license in {"MIT", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause"}


def test_pycode_is_a_data_source_once_built(built, tmp_path, monkeypatch):
    cache, manifest = built
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"not built in .*run `fp4lab data build pycode`.* --from BUNDLE"):
        load_dataset(DataConfig(source="pycode"))
    monkeypatch.setenv("FP4LAB_CACHE", str(cache))
    dataset = load_dataset(DataConfig(source="pycode"))
    assert dataset.name == "pycode" and dataset.vocab_size == VOCAB
    assert dataset.train.size == manifest["files"]["train.bin"]["tokens"]
    assert dataset.val.size == manifest["files"]["val.bin"]["tokens"]
    assert dataset.decode(dataset.val[:40]).startswith(HELD_OUT[0][:20])
    with pytest.raises(ValueError, match=f"vocab_size=512: the pycode corpus has a {VOCAB}-token vocabulary"):
        load_dataset(DataConfig(source="pycode", vocab_size=512))


def test_cli_packs_unpacks_and_trains_on_it(built, run_cli, tmp_path, monkeypatch):
    cache, manifest = built
    bundle = tmp_path / "bundle"
    monkeypatch.setenv("FP4LAB_CACHE", str(cache))
    packed = run_cli("data", "pack", "pycode", str(bundle))
    assert packed.returncode == 0 and f"in {bundle}" in packed.stdout and (bundle / "train.bin.xz").is_file()
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    assert run_cli("data", "pack", "pycode", str(tmp_path / "b2")).returncode == 2 and not (tmp_path / "b2").exists()
    out = run_cli("data", "build", "pycode", "--from", str(bundle))
    assert out.returncode == 0, out.stderr
    train_tokens = manifest["files"]["train.bin"]["tokens"]
    assert f"{train_tokens:,} training and" in out.stdout and f"vocabulary {VOCAB}" in out.stdout
    again = run_cli("data", "build", "pycode", "--json")  # built: reports it, builds nothing
    assert again.returncode == 0 and json.loads(again.stdout)["files"] == manifest["files"]
    run = run_cli("train", "--data", "pycode", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
                  "--eval-every", "3", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and np.isfinite(summary["final_val_loss"])
    bad = run_cli("data", "build", "pycode", "--from", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "not a pycode bundle" in bad.stderr


def test_the_round_scripts_corpus_step_builds_pycode_from_a_carried_bundle_where_runs_train_on_it(built, tmp_path):
    """scripts/build_corpus.py, which ledger_round.sh and ratchet_round.sh call on a machine that keeps
    nothing: a program or spec that trains on pycode gets it from .corpus/pycode (no network); one that
    does not gets nothing built."""
    cache, manifest = built
    project = tmp_path / "project"
    pycode.pack(cache, project / ".corpus" / "pycode")
    program = "# p\n\n```toml ratchet\nmetric = \"val_loss\"\ndirection = \"minimize\"\n\n[run]\nkind = \"fp4lab\"\nsteps = 2\n\n[run.base]\nmodel = \"tiny\"\n{data}\n[search_space]\nlr = {{ type = \"float\", low = 0.001, high = 0.01 }}\n```\n"
    (project / "synthetic.md").write_text(program.format(data='data = { source = "synthetic" }'))
    (project / "pycode.md").write_text(program.format(data='data = { source = "pycode" }'))
    (project / "spec.toml").write_text('name = "s"\n[base]\nmodel = "tiny"\nsteps = 2\n[base.data]\nsource = "synthetic"\n')
    fresh = tmp_path / "fresh-cache"
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_corpus.py"

    def corpus_step(*files: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), *files], cwd=project, env=dict(os.environ, FP4LAB_CACHE=str(fresh)),
                              capture_output=True, text=True, timeout=300)

    done = corpus_step("synthetic.md", "spec.toml")
    assert done.returncode == 0 and not fresh.exists(), done.stderr
    done = corpus_step("spec.toml", "pycode.md")
    assert done.returncode == 0, done.stderr
    assert pycode.load(fresh)[3]["files"] == manifest["files"]
    assert corpus_step().returncode == 2
    (project / "bad.md").write_text("# no ratchet block\n")
    done = corpus_step("bad.md")
    assert done.returncode == 2 and done.stderr.startswith("build_corpus: bad.md") and "Traceback" not in done.stderr


PILOT = """# pilot on pycode

```toml ratchet
metric = "val_loss"
direction = "minimize"

[run]
kind = "fp4lab"
steps = 2

[run.base]
model = "tiny"
batch_size = 2
seq_len = 16
eval_every = 2
eval_batches = 1
device = "cpu"
compile = "off"
data = { source = "pycode" }

[search_space]
lr = { type = "float", low = 0.001, high = 0.01 }
```
"""


def test_a_ratchet_round_on_a_bare_machine_trains_on_pycode_from_the_carried_bundle(built, tmp_path):
    """ratchet_round.sh with no corpus in $FP4LAB_CACHE and the bundle carried in as .corpus/pycode:
    its runs train on pycode (they fail without the corpus step)."""
    from fp4lab.lab.records.catalog import Catalog
    from tests.lab.test_ratchet import git, make_repo
    from tests.lab.test_ratchet_round import install_round_script

    cache, manifest = built
    repo = make_repo(tmp_path)
    install_round_script(repo)
    (repo / "pilot.md").write_text(PILOT)
    (repo / ".gitignore").write_text("sweep_catalog.json*\n.corpus/\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a pilot on pycode")
    pycode.pack(cache, repo / ".corpus" / "pycode")
    fresh, out = tmp_path / "fresh-cache", tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, FP4LAB_CACHE=str(fresh))
    done = subprocess.run(["bash", "scripts/ratchet_round.sh", "240", str(out), "pilot.md", "1"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert pycode.load(fresh)[3]["files"] == manifest["files"]
    records = [r for r in Catalog(out / "sweep_catalog.json").records(sweep="ratchet/pilot") if "iteration" in r["extra"]]
    baseline = next(r for r in records if r["extra"]["iteration"] == 0)
    assert baseline["extra"]["phase"] == "done" and baseline["extra"]["metric"] is not None, baseline
