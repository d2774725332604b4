"""The byte-level BPE tokenizer every corpus trains (shakespeare in data.py, pycode in pycode.py, your
own corpora in user_corpus.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# The special token that ends every document of pycode and of a corpus of your own trained with bpe:SIZE
# (id 0: special tokens come first).
END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(pieces: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ()) -> Tokenizer:
    """A GPT-2-style byte-level BPE with `vocab_size` tokens (special tokens first, then the 256 bytes
    and merges), trained on `pieces`: many pieces, not one string, because the trainer counts words in
    parallel over them; a piece boundary must be one the pre-tokenizer would split at anyway.

    Deterministic: the trainer breaks ties between equally frequent pairs by token ids, so training
    twice gives the same vocabulary and merges (checked across processes and thread counts too).
    """
    if isinstance(pieces, str):  # a str is an iterable of characters: it would train on single letters
        raise TypeError("train_tokenizer: pass an iterable of text pieces, not one string")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=list(special_tokens),
    )
    tokenizer.train_from_iterator(pieces, trainer=trainer)
    return tokenizer
