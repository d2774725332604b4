"""`fp4lab data build NAME --text ... | --hf ... --tokenizer ...`: a corpus of your own built, refused
when another build holds its name, trained on for a few steps, and named by a sweep spec; usage
mistakes are one line and exit 2 with nothing written; without network, a missing Hugging Face
dataset or tokenizer says what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4lab.train.corpus import own_corpus_dir
from tests.train.test_user_corpus import NOTES, files_of, write_texts

SWEEP = """
name = "own"
[base]
model = "tiny"
steps = 2
batch_size = 2
seq_len = 16
warmup_steps = 1
eval_every = 2
eval_batches = 1
[base.data]
source = "notes"
[axes]
recipe = ["bf16", "nvfp4"]
"""


@pytest.fixture
def texts(tmp_path):
    return write_texts(tmp_path / "notes")


def test_build_refuse_train_and_sweep_on_your_own_corpus(run_cli, texts, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FP4LAB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    built = run_cli("data", "build", "notes", "--text", str(texts), "--tokenizer", "bpe:300")
    assert built.returncode == 0, built.stderr
    manifest = json.loads((own_corpus_dir(cache, "notes") / "manifest.json").read_text())
    train_tokens, val_tokens = (manifest["files"][name]["tokens"] for name in ("train.bin", "val.bin"))
    assert built.stdout.splitlines() == [
        f"notes: {train_tokens:,} training and {val_tokens:,} validation tokens ({manifest['documents']['train']} + "
        f"{manifest['documents']['val']} documents from {len(NOTES) + 2} files), vocabulary 300 (bpe:300, uint16)",
        f"in {own_corpus_dir(cache, 'notes')}",
    ]
    before = files_of(own_corpus_dir(cache, "notes"))
    again = run_cli("data", "build", "notes", "--text", str(texts), "--tokenizer", "bpe:300", "--json")
    assert again.returncode == 0 and json.loads(again.stdout) == {"path": str(own_corpus_dir(cache, "notes")), **manifest}
    refused = run_cli("data", "build", "notes", "--text", str(texts), "--tokenizer", "embedded")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        f"fp4lab: error: data build notes: another tokenizer (embedded, not bpe:300) than the corpus built in "
        f"{own_corpus_dir(cache, 'notes')}; add --force to replace it, or choose another name"
    ]
    assert files_of(own_corpus_dir(cache, "notes")) == before
    # A few steps of the tiny model on it: its vocabulary is the corpus's.
    run = run_cli("train", "--data", "notes", "--steps", "3", "--seq-len", "16", "--batch-size", "2",
                  "--eval-every", "3", "--out", str(tmp_path / "run"))
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and 0 < summary["final_val_loss"] < 10
    checkpoint = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert checkpoint["model"]["tok_embeddings.weight"].shape[0] == manifest["vocab_size"]
    # A sweep spec naming it: the dry run finds nothing that would fail; with the corpus not built it would.
    (tmp_path / "own.toml").write_text(SWEEP)
    plan = run_cli("sweep", "own.toml", "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    plan = json.loads(plan.stdout)
    assert plan["problems"] == [] and len(plan["runs"]) == 2
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "empty-cache"))
    plan = json.loads(run_cli("sweep", "own.toml", "--dry-run", "--json").stdout)
    assert len(plan["problems"]) == 1 and "no corpus 'notes' is built" in plan["problems"][0]
    assert "`fp4lab data build notes --text FILES|DIR..." in plan["problems"][0]
    refused = run_cli("sweep", "own.toml")
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
    assert "no corpus 'notes' is built" in refused.stderr and not (tmp_path / "runs").exists()


def test_build_from_a_saved_dataset(run_cli, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    datasets.Dataset.from_dict({"body": NOTES}).save_to_disk(str(tmp_path / "rows"))
    out = run_cli("data", "build", "rows", "--hf", str(tmp_path / "rows"), "--column", "body", "--tokenizer", "bpe:300")
    assert out.returncode == 0, out.stderr
    assert f"documents from {tmp_path / 'rows'} train), vocabulary 300 (bpe:300, uint16)" in out.stdout
    manifest = json.loads((own_corpus_dir(tmp_path / "cache", "rows") / "manifest.json").read_text())
    assert manifest["inputs"]["column"] == "body" and manifest["documents"]["train"] + manifest["documents"]["val"] == len(NOTES)


@pytest.mark.parametrize("args, message", [
    (["notes", "--tokenizer", "bpe:300"], "give either --text FILES|DIR... or --hf DATASET[:split]"),
    (["notes", "--text", "--tokenizer", "bpe:300"], "--text needs the text files or folders"),
    (["notes", "TEXTS", "--tokenizer", "bpe:300"], "given without --text; add --text"),
    (["notes", "--text", "TEXTS", "--hf", "x", "--tokenizer", "bpe:300"], "give either --text"),
    (["notes", "--text", "TEXTS"], "--tokenizer is missing; use embedded, bpe:SIZE"),
    (["notes", "--text", "TEXTS", "--tokenizer", "bpe:12"], "at least 257 tokens"),
    (["notes", "--text", "TEXTS", "--tokenizer", "bpe:300", "--column", "body"], "--column picks the column of an --hf"),
    (["Notes", "--text", "TEXTS", "--tokenizer", "bpe:300"], "'Notes' is not a corpus name"),
    (["shakespeare", "--text", "TEXTS", "--tokenizer", "bpe:300"], "'shakespeare' is a built-in data source"),
    (["pycode", "--text", "TEXTS", "--tokenizer", "bpe:300"], "data build pycode: PATHS, --text, --tokenizer build a corpus of your own"),
    (["notes", "--from", "TEXTS"], "--from unpacks a pycode bundle"),
    (["notes", "--text", "TEXTS/nowhere", "--tokenizer", "bpe:300"], "nowhere: no such file or folder"),
])  # fmt: skip
def test_usage_mistakes_are_one_line_and_write_nothing(run_cli, texts, tmp_path, monkeypatch, args, message):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    out = run_cli("data", "build", *(arg.replace("TEXTS", str(texts)) for arg in args))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp4lab: error: ") and message in lines[0], out.stderr
    assert not (tmp_path / "cache").exists()


OFFLINE = """
from fp4lab.train import user_corpus
for attempt in (lambda: user_corpus.hf_inputs("fp4lab-nobody/no-such-dataset"),
                lambda: user_corpus.resolve_tokenizer(user_corpus.parse_tokenizer("hf:fp4lab-nobody/no-such-tokenizer"))):
    try:
        attempt()
    except user_corpus.CorpusError as exc:
        print(exc)
"""


def test_without_network_a_missing_dataset_or_tokenizer_says_what_is_missing(tmp_path):
    # A fresh process: the Hugging Face libraries read HF_HUB_OFFLINE when they are imported.
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", OFFLINE], capture_output=True, text=True, timeout=120, env=env, check=True)
    dataset, tokenizer = out.stdout.splitlines()
    hub = tmp_path / "hf" / "hub"
    assert dataset.startswith("--hf fp4lab-nobody/no-such-dataset: cannot load it (")
    assert f"with no network it must be in the local Hugging Face cache ({hub})" in dataset and "save_to_disk" in dataset
    assert tokenizer.startswith("--tokenizer hf:fp4lab-nobody/no-such-tokenizer: cannot load it (")
    assert f"the local Hugging Face cache ({hub})" in tokenizer and "folder holding its tokenizer.json" in tokenizer
