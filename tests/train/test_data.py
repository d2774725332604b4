"""The data pipeline: Shakespeare conversion and split, the BPE and its cache, token files, the synthetic
task, and batch samplers that make resumed runs exact."""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4lab.train import atomic, data
from fp4lab.train.data import BatchSampler, DataConfig, load_dataset, val_batches

# sha256 of shakespeare_text(). When the conversion changes on purpose, bump data.FORMAT_VERSION (so
# cached builds are redone) and update this hash.
CORPUS_SHA256 = "8309cc45f89cc34aabffa771150324c9f14bb50d45cbee982ce7c2032da7baf6"

PLAY_MARKDOWN = """# A Play

## ACT I

### SCENE I. A room.

_Enter ALICE and BOB,
with others_

**ALICE**  
Good morrow\\--sir, _\\[Aside]_ how now?  
What news?

_Exit BOB_

Stay awhile.

**BOB**  
[Aside]_  
I come, I come.

*Sound a horn.*

### SCENE II. A heath.

lying asleep.

**First Lord**  
The end.
"""


@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def corpus() -> str:
    return data.shakespeare_text()


@pytest.fixture(scope="module")
def small_tokenizer(corpus):
    return data.train_tokenizer(data.speeches(corpus[:300_000]), 1024)


@pytest.fixture
def one_play(monkeypatch):
    """Shrink the corpus to one real play so a cold build takes a fraction of a second; count BPE trainings."""
    plays = data.shakespeare_plays()[:1]
    monkeypatch.setattr(data, "shakespeare_plays", lambda: plays)
    trainings = []
    real_train = data.train_tokenizer

    def counting_train(pieces, vocab_size, *args, **kwargs):
        trainings.append(vocab_size)
        return real_train(pieces, vocab_size, *args, **kwargs)

    monkeypatch.setattr(data, "train_tokenizer", counting_train)
    return trainings


def write_tokens(path, ids, dtype="uint16"):
    np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tofile(path)
    return str(path)


# --- the corpus -------------------------------------------------------------------------------------


def test_play_markdown_becomes_speaker_blocks():
    # Headings, stage directions (one and several lines, _ and *), the orphaned line after a heading
    # and markdown escapes all go; a speech interrupted by a direction stays one speech.
    assert data.play_to_text(PLAY_MARKDOWN) == (
        "ALICE:\nGood morrow--sir, how now?\nWhat news?\nStay awhile.\n\n"
        "BOB:\nI come, I come.\n\n"
        "First Lord:\nThe end.\n\n"
    )


def test_corpus_is_every_play_in_sorted_order_as_plain_speeches(corpus):
    names = [name for name, _ in data.shakespeare_plays()]
    assert len(names) == 38 and names == sorted(names)
    assert corpus.startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n")  # comedies/a-midsummer-...
    assert 4_700_000 < len(corpus) < 4_900_000
    assert not set("*_#\\") & set(corpus), "markdown left in the text"
    speeches = data.speeches(corpus)
    assert "".join(speeches) == corpus and len(speeches) > 30_000
    assert speeches[-1] == "\n"  # the blank line closing the last speech
    for speech in speeches[:-1]:
        speaker, *lines, blank = speech.lstrip("\n").split("\n")
        assert speaker.endswith(":") and len(speaker) > 1 and lines and all(lines) and blank == ""


def test_corpus_conversion_is_pinned(corpus):
    converted_again = "".join(data.play_to_text(markdown) for _, markdown in data.shakespeare_plays()[:2])
    assert corpus.startswith(converted_again)
    assert hashlib.sha256(corpus.encode()).hexdigest() == CORPUS_SHA256


@pytest.mark.parametrize("val_fraction", [0.1, 0.25, 0.5])
def test_val_split_is_the_contiguous_tail(corpus, val_fraction):
    train, val = data.split_text(corpus, val_fraction)
    assert train + val == corpus
    assert val_fraction - 0.001 < len(val) / len(corpus) <= val_fraction
    # The cut sits between the two newlines ending a speech: no speech is split.
    assert train.endswith("\n") and not train.endswith("\n\n")
    assert val.startswith("\n") and val.split("\n")[1].endswith(":")  # val opens with a speaker line


def test_val_split_needs_a_whole_speech():
    with pytest.raises(ValueError, match="val_fraction"):
        data.split_text("A:\nlong line of text\n\nB:\nx\n\n", 0.01)


# --- the tokenizer ------------------------------------------------------------------------------------


def test_bpe_round_trips_held_out_text_and_compresses(corpus, small_tokenizer):
    held_out = corpus[-50_000:]
    ids = data.encode(small_tokenizer, held_out)
    assert small_tokenizer.get_vocab_size() == 1024
    assert ids.dtype == np.uint16 and int(ids.max()) < 1024
    assert small_tokenizer.decode(ids.tolist()) == held_out
    assert len(ids) < len(held_out) / 2  # merges were learned: more than 2 characters per token


def test_speech_by_speech_encoding_equals_whole_text_encoding(corpus, small_tokenizer):
    text = corpus[1_000_000:1_100_000]
    assert data.encode(small_tokenizer, text).tolist() == small_tokenizer.encode(text).ids


def test_bpe_training_is_deterministic(corpus, small_tokenizer):
    assert data.train_tokenizer(data.speeches(corpus[:300_000]), 1024).to_str() == small_tokenizer.to_str()


# --- the cache ----------------------------------------------------------------------------------------


def test_second_load_hits_the_cache(temp_cache, one_play):
    first = load_dataset(DataConfig(vocab_size=300))
    assert one_play == [300]
    (entry,) = temp_cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["tokenizer.json", "train.bin", "val.bin"]

    second = load_dataset(DataConfig(vocab_size=300))
    assert one_play == [300], "the second load retrained the tokenizer"
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert isinstance(second.train, np.memmap) and not second.train.flags.writeable
    assert second.tokenizer.to_str() == first.tokenizer.to_str()

    load_dataset(DataConfig(vocab_size=320))
    assert one_play == [300, 320], "another vocabulary size must be another cache entry"


def test_cached_tokens_are_the_split_text(temp_cache, one_play):
    dataset = load_dataset(DataConfig(vocab_size=300, val_fraction=0.2))
    text = "".join(data.play_to_text(markdown) for _, markdown in data.shakespeare_plays())
    train_text, val_text = data.split_text(text, 0.2)
    assert dataset.decode(dataset.train) == train_text
    assert dataset.decode(torch.from_numpy(dataset.val.astype(np.int64))) == val_text
    assert dataset.vocab_size == dataset.tokenizer.get_vocab_size() == 300


def test_incomplete_cache_entry_is_rebuilt(temp_cache, one_play):
    built = load_dataset(DataConfig(vocab_size=300))
    (entry,) = temp_cache.iterdir()
    (entry / "train.bin").unlink()
    rebuilt = load_dataset(DataConfig(vocab_size=300))
    assert one_play == [300, 300]
    assert np.array_equal(built.train, rebuilt.train)


def test_loading_prints_nothing_unless_asked(temp_cache, one_play, capfd):
    load_dataset(DataConfig(vocab_size=300))
    load_dataset(DataConfig(vocab_size=300))
    assert capfd.readouterr() == ("", "")


def test_atomic_write_never_exposes_a_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "train.bin"
    target.write_bytes(b"old")
    seen_at_sync = []
    real_fsync = os.fsync

    def fsync_then_look(fd):
        real_fsync(fd)
        seen_at_sync.append(target.read_bytes())

    monkeypatch.setattr(os, "fsync", fsync_then_look)
    atomic.write_atomic(target, b"new contents")
    assert seen_at_sync[0] == b"old", "the new bytes were written into the target itself"
    assert target.read_bytes() == b"new contents"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]


def test_failed_atomic_write_keeps_the_old_file_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "train.bin"
    target.write_bytes(b"old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic.write_atomic(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["train.bin"]


def test_default_shakespeare_build_in_the_real_cache(monkeypatch):
    # The one test on the real default cache: builds once per machine (seconds), then loads it.
    monkeypatch.delenv("FP4LAB_CACHE", raising=False)
    dataset = load_dataset(DataConfig())
    assert data.cache_dir() == Path.home() / ".cache" / "fp4lab"
    assert dataset.name == "shakespeare" and dataset.vocab_size == dataset.tokenizer.get_vocab_size() == 4096
    assert 1_300_000 < len(dataset.train) < 1_500_000
    assert 0.09 < len(dataset.val) / (len(dataset.train) + len(dataset.val)) < 0.11
    assert int(dataset.train.max()) < 4096 and int(dataset.val.max()) < 4096
    assert dataset.decode(dataset.train[:20]).startswith("THESEUS:\nNow, fair Hippolyta")

    trainings = []
    monkeypatch.setattr(data, "train_tokenizer", lambda *args: trainings.append(args))
    again = load_dataset(DataConfig())
    assert trainings == [] and np.array_equal(again.val, dataset.val)


# --- token files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, largest", [("uint16", 65_535), ("uint32", 1_000_000)])
def test_token_files_are_memory_mapped(tmp_path, dtype, largest):
    ids = np.arange(1000) * 7 % 500
    ids[123] = largest
    source = write_tokens(tmp_path / "train.bin", ids, dtype)
    dataset = load_dataset(DataConfig(source=source, token_dtype=dtype, val_fraction=0.25))
    assert isinstance(dataset.train, np.memmap) and isinstance(dataset.val, np.memmap)
    assert not dataset.train.flags.writeable
    assert dataset.train.tolist() == ids[:750].tolist() and dataset.val.tolist() == ids[750:].tolist()
    assert dataset.vocab_size == largest + 1  # inferred: max id + 1
    assert dataset.name == "train.bin" and dataset.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        dataset.decode([1, 2])


def test_explicit_val_file_and_vocab_size(tmp_path):
    source = write_tokens(tmp_path / "train.bin", [1, 2, 3, 4], "uint32")
    val_source = write_tokens(tmp_path / "val.bin", [9, 8], "uint32")
    dataset = load_dataset(DataConfig(source=source, val_source=val_source, token_dtype="uint32", vocab_size=50))
    assert dataset.train.tolist() == [1, 2, 3, 4] and dataset.val.tolist() == [9, 8] and dataset.vocab_size == 50


def token_file_config(directory, ids, **fields):
    return DataConfig(source=write_tokens(directory / "a.bin", ids), **fields)


@pytest.mark.parametrize(
    "make_config, message",
    [
        pytest.param(
            lambda d: DataConfig(source=str(d / "missing.bin")),
            r"DataConfig\.source='.*missing\.bin': no such file",
            id="missing",
        ),
        pytest.param(
            lambda d: token_file_config(d, [1], val_source=str(d / "nope.bin")),
            r"DataConfig\.val_source='.*nope\.bin': no such file",
            id="missing-val",
        ),
        pytest.param(
            lambda d: token_file_config(d, [1, 2, 3], token_dtype="uint32"),
            r"DataConfig\.source=.*: 6 bytes is not a multiple of 4 \(uint32\); check token_dtype",
            id="width",
        ),
        pytest.param(
            lambda d: token_file_config(d, [1, 2, 3], token_dtype="int8"),
            r"DataConfig\.token_dtype='int8' is not valid: allowed: uint16, uint32",
            id="dtype",
        ),
        pytest.param(
            lambda d: token_file_config(d, [300] + [1] * 19, vocab_size=256),
            r"DataConfig\.vocab_size=256: the token files hold id 300; use vocab_size >= 301",
            id="vocab",
        ),
        pytest.param(
            lambda d: token_file_config(d, []),
            r"DataConfig\.source=.*: the file is empty",
            id="empty",
        ),
        pytest.param(
            lambda d: token_file_config(d, [1, 2]),
            r"DataConfig\.val_fraction=0\.1: splitting 2 tokens leaves an empty split",
            id="split",
        ),
    ],
)
def test_token_file_errors_are_one_line_and_name_the_field(tmp_path, make_config, message):
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(make_config(tmp_path))
    assert "\n" not in str(error.value)


def test_file_shorter_than_one_sequence(tmp_path):
    dataset = load_dataset(DataConfig(source=write_tokens(tmp_path / "a.bin", range(20)), val_fraction=0.5))
    with pytest.raises(ValueError, match=r"10 tokens cannot fill one sequence of seq_len \+ 1 = 17"):
        BatchSampler(dataset.train, batch_size=2, seq_len=16, seed=0)
    with pytest.raises(ValueError, match=r"val_batches: 10 tokens cannot fill"):
        val_batches(dataset.val, batch_size=2, seq_len=16, max_batches=1)


@pytest.mark.parametrize(
    "config, message",
    [
        (DataConfig(source="Shakespeare.txt"), r"DataConfig\.source='Shakespeare.txt' is not valid: use 'shakespeare', "),
        (DataConfig(source="shakspeare"), r"DataConfig\.source='shakspeare' \(did you mean 'shakespeare'\?\): no corpus "
                                          r"'shakspeare' is built in .*; build it: `fp4lab data build shakspeare --text"),
        (DataConfig(val_source="val.bin"), r"DataConfig\.val_source='val.bin' .* needs a .bin source"),
        (DataConfig(source="a.bin", val_source="val.txt"), r"DataConfig\.val_source='val.txt'"),
        (DataConfig(val_fraction=0.0), r"DataConfig\.val_fraction=0\.0 .* strictly between 0 and 1"),
        (DataConfig(val_fraction=1.5), r"DataConfig\.val_fraction=1\.5"),
        (DataConfig(vocab_size=100), r"DataConfig\.vocab_size=100 .* for source 'shakespeare': 257\.\.65536"),
        (DataConfig(source="synthetic", vocab_size=70_000), r"vocab_size=70000 .* 4\.\.65536"),
        (DataConfig(seed=-1), r"DataConfig\.seed=-1"),
    ],
)
def test_config_errors_name_the_field_value_and_fix(config, message):
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(config)
    assert "\n" not in str(error.value)


# --- the synthetic task -------------------------------------------------------------------------------


def test_synthetic_task_is_seeded_and_sparse():
    dataset = load_dataset(DataConfig(source="synthetic", seed=3))
    assert dataset.name == "synthetic" and dataset.vocab_size == 256 and dataset.tokenizer is None
    assert len(dataset.train) + len(dataset.val) == data.SYNTHETIC_TOKENS
    assert len(dataset.val) == round(0.1 * data.SYNTHETIC_TOKENS)
    assert int(dataset.train.max()) < 256
    again = load_dataset(DataConfig(source="synthetic", seed=3))
    assert np.array_equal(again.train, dataset.train) and np.array_equal(again.val, dataset.val)
    assert not np.array_equal(load_dataset(DataConfig(source="synthetic", seed=4)).train, dataset.train)

    walk = np.concatenate([dataset.train, dataset.val])
    successors = {}
    for current, following in zip(walk[:-1].tolist(), walk[1:].tolist()):
        successors.setdefault(current, set()).add(following)
    assert max(map(len, successors.values())) == data.SYNTHETIC_SUCCESSORS
    assert len(successors) > 200  # the walk visits most of the vocabulary


def test_synthetic_task_is_learnable_fast(one_thread):
    # A bigram table is enough to learn a first-order chain: plain SGD takes its loss from ln 256 to
    # near the floor ln 4 in 100 steps.
    dataset = load_dataset(DataConfig(source="synthetic"))
    sampler = BatchSampler(dataset.train, batch_size=16, seq_len=64, seed=0)
    logits = torch.zeros(dataset.vocab_size, dataset.vocab_size, requires_grad=True)
    losses = []
    for step in range(100):
        x, y = sampler.batch(step)
        loss = torch.nn.functional.cross_entropy(logits[x].flatten(0, 1), y.flatten())
        loss.backward()
        with torch.no_grad():
            logits -= 200 * logits.grad
            logits.grad = None
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(dataset.vocab_size))
    assert losses[-1] < math.log(data.SYNTHETIC_SUCCESSORS) + 0.3


# --- batches ------------------------------------------------------------------------------------------


def test_batches_are_shifted_windows_of_the_tokens():
    tokens = np.arange(10_000, dtype=np.uint32)
    x, y = BatchSampler(tokens, batch_size=8, seq_len=32, seed=0).batch(5)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, 32)
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    assert torch.equal(x, x[:, :1] + torch.arange(32))  # each row is one contiguous window
    assert int(x.min()) >= 0 and int(y.max()) < 10_000


def test_batch_is_a_pure_function_of_seed_and_step():
    tokens = np.random.default_rng(0).integers(0, 4096, size=50_000).astype(np.uint16)
    uninterrupted = BatchSampler(tokens, batch_size=4, seq_len=16, seed=7)
    drawn = [uninterrupted.batch(step) for step in range(10)]

    resumed = BatchSampler(tokens, batch_size=4, seq_len=16, seed=7)
    for step in (7, 3, 9, 7):
        assert all(torch.equal(a, b) for a, b in zip(resumed.batch(step), drawn[step]))
    from_tensor = BatchSampler(torch.from_numpy(tokens.astype(np.int64)), batch_size=4, seq_len=16, seed=7)
    assert torch.equal(from_tensor.batch(4)[0], drawn[4][0])

    assert not torch.equal(drawn[1][0], drawn[2][0])
    assert not torch.equal(BatchSampler(tokens, batch_size=4, seq_len=16, seed=8).batch(1)[0], drawn[1][0])


def test_batch_sampler_rejects_bad_arguments():
    tokens = np.arange(100, dtype=np.uint16)
    with pytest.raises(ValueError, match=r"step=-1"):
        BatchSampler(tokens, 2, 8, seed=0).batch(-1)
    with pytest.raises(ValueError, match=r"seed=-3"):
        BatchSampler(tokens, 2, 8, seed=-3)
    with pytest.raises(ValueError, match=r"batch_size=0"):
        BatchSampler(tokens, 0, 8, seed=0)
    with pytest.raises(ValueError, match=r"1-D integer array"):
        BatchSampler(tokens.astype(np.float32), 2, 8, seed=0)


def test_val_batches_are_fixed_full_and_spread_over_the_split():
    tokens = np.arange(10_001, dtype=np.uint16)
    batches = val_batches(tokens, batch_size=4, seq_len=10, max_batches=5)
    assert len(batches) == 5 and all(x.shape == y.shape == (4, 10) for x, y in batches)
    again = val_batches(tokens, batch_size=4, seq_len=10, max_batches=5)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(batches, again))

    starts = torch.cat([x[:, 0] for x, _ in batches]).tolist()
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] > 9_000  # the whole split, in order
    assert all(later - earlier >= 10 for earlier, later in itertools.pairwise(starts))  # no overlap
    assert all(torch.equal(y, x + 1) for x, y in batches)


def test_val_batches_of_a_short_split():
    tokens = np.arange(35, dtype=np.uint16)
    assert [x.shape[0] for x, _ in val_batches(tokens, batch_size=8, seq_len=10, max_batches=3)] == [3]
    tokens = np.arange(201, dtype=np.uint16)
    assert [x.shape[0] for x, _ in val_batches(tokens, batch_size=8, seq_len=10, max_batches=3)] == [8, 8]
