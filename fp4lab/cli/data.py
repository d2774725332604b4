"""`fp4lab data`: build the corpora that are made once, and pack them for a machine without network."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import Corpus
from fp4lab.cli.conventions import Commands, fail, print_json, rich_console
from fp4lab.train.config import PYCODE

group = typer.Typer(cls=Commands, help="Build the training corpora that are made once (the embedded Shakespeare builds itself).", no_args_is_help=True)


@group.command("build")
def data_build(
    name: Annotated[str, typer.Argument(help="pycode, or a name for a corpus of your own (lowercase letters, digits, '-', '_'; first a letter): training configs then name it as their data source.")],
    paths: Annotated[Optional[list[Path]], typer.Argument(help="With --text: the text files and folders (every file under a folder) of your own corpus.", show_default=False)] = None,
    text: Annotated[bool, typer.Option("--text", help="Your own corpus from text files: PATHS are files or folders, each file one document (UTF-8).")] = False,
    hf: Annotated[Optional[str], typer.Option("--hf", metavar="DATASET[:split]", help="Your own corpus from a Hugging Face dataset: a folder written by save_to_disk, or a name datasets.load_dataset finds (the local cache when there is no network); default split train.")] = None,
    column: Annotated[Optional[str], typer.Option("--column", help="With --hf: the column of text, each row one document (default text).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", metavar="embedded|bpe:SIZE|hf:NAME", help="Your own corpus's tokenizer: embedded (the shakespeare source's 4096-token BPE), bpe:SIZE (a byte-level BPE trained on your documents) or hf:NAME (a Hugging Face tokenizer: a Hub name or a folder).")] = None,
    bundle: Annotated[Optional[Path], typer.Option("--from", help="pycode: unpack a bundle made by `fp4lab data pack` instead of building (no network); every file must match the bundle's manifest.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Build again even if the corpus is already built (your own: replace a corpus built from other inputs or with another tokenizer).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the corpus's manifest as JSON instead of a summary.")] = False,
) -> None:
    """Build a corpus into $FP4LAB_CACHE (default ~/.cache/fp4lab): pycode downloads 21 pinned sdists
    from PyPI (157 MB), keeps their .py files, trains a 32768-token BPE and tokenizes (~3 minutes on
    2 cores). Your own: `fp4lab data build NAME --text FILES|DIR... --tokenizer bpe:8192` (or --hf
    DATASET) holds out 1 % of the documents for validation and tokenizes the rest; an interrupted build
    continues where it stopped. Training configs then name it as data source ("pycode", "NAME")."""
    from fp4lab.train.corpus import CorpusError, cache_dir, status_line

    cache = cache_dir()
    try:
        if name == PYCODE:
            _refuse_own_options(paths, text, hf, column, tokenizer)
            folder, manifest = _build_pycode(cache, bundle, force, as_json)
        else:
            if bundle is not None:
                fail(f"data build {name}: --from unpacks a pycode bundle; your own corpus builds from --text or --hf "
                     "(copy $FP4LAB_CACHE/corpora/NAME to move a built one)")
            from fp4lab.train import user_corpus

            inputs = _own_inputs(name, paths or [], text, hf, column, tokenizer)
            with status_line(not as_json) as status:
                manifest, built_now = user_corpus.build(cache, name, inputs, tokenizer, force=force, status=status)
            folder = user_corpus.corpus_dir(cache, name)
            if not built_now and not as_json:
                rich_console(stderr=True).print(f"{name}: already built from these inputs with this tokenizer "
                                                "(--force builds it again)", highlight=False)
    except CorpusError as exc:
        fail(str(exc))
    _print_corpus(name, folder, manifest, as_json)


def _refuse_own_options(paths, text: bool, hf: str | None, column: str | None, tokenizer: str | None) -> None:
    given = [option for option, value in (("PATHS", paths), ("--text", text), ("--hf", hf), ("--column", column),
                                          ("--tokenizer", tokenizer)) if value]
    if given:
        fail(f"data build {PYCODE}: {', '.join(given)} build a corpus of your own; pycode builds from its pinned "
             f"PyPI packages: give your corpus another name (fp4lab data build NAME --text FILES --tokenizer bpe:8192)")


def _build_pycode(cache: Path, bundle: Path | None, force: bool, as_json: bool) -> tuple[Path, dict]:
    from fp4lab.train import pycode
    from fp4lab.train.corpus import MANIFEST, status_line

    folder = pycode.corpus_dir(cache)
    if bundle is None and not force and (folder / MANIFEST).is_file():
        return folder, pycode.load(cache)[3]
    with status_line(not as_json) as status:
        return folder, pycode.unpack(cache, bundle, status=status) if bundle else pycode.build(cache, status=status)


def _own_inputs(name: str, paths: list[Path], text: bool, hf: str | None, column: str | None, tokenizer: str | None):
    """The inputs of your own corpus, once the options are consistent."""
    from fp4lab.train import user_corpus

    if paths and not text:
        fail(f"data build {name}: {paths[0]} given without --text; add --text to build from text files")
    if text and not paths:
        fail(f"data build {name}: --text needs the text files or folders, e.g. --text notes/ book.txt")
    if text == (hf is not None):
        fail(f"data build {name}: give either --text FILES|DIR... or --hf DATASET[:split] (one source of documents)")
    if column is not None and hf is None:
        fail(f"data build {name}: --column picks the column of an --hf dataset; leave it out with --text")
    if tokenizer is None:
        fail(f"data build {name}: --tokenizer is missing; use embedded, bpe:SIZE (e.g. bpe:8192) or hf:NAME")
    user_corpus.check_name(name)  # name and tokenizer checked before any input is read
    user_corpus.parse_tokenizer(tokenizer)
    return user_corpus.text_inputs(paths) if text else user_corpus.hf_inputs(hf, column or "text")


@group.command("pack")
def data_pack(
    name: Annotated[Corpus, typer.Argument(help="The built corpus to pack.")],
    folder: Annotated[Path, typer.Argument(help="Where the bundle goes (created if missing; its files of the same names are replaced).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the corpus's manifest as JSON instead of a summary.")] = False,
) -> None:
    """Write a built corpus as a portable bundle (its manifest, tokenizer and xz-compressed token
    files: 34 MB for pycode), for a machine without network access: `fp4lab data build NAME --from
    FOLDER` there."""
    from fp4lab.train import pycode
    from fp4lab.train.corpus import cache_dir, status_line

    try:
        with status_line(not as_json) as status:
            manifest = pycode.pack(cache_dir(), folder, status=status)
    except pycode.CorpusError as exc:
        fail(str(exc))
    _print_corpus(name, folder, manifest, as_json)


def _print_corpus(name: str, folder: Path, manifest: dict, as_json: bool) -> None:
    if as_json:
        print_json({"path": str(folder), **manifest})
        return
    files, documents, inputs = manifest["files"], manifest["documents"], manifest.get("inputs")
    if inputs is None:
        source = f"{len(manifest['packages'])} packages"
    elif inputs["kind"] == "text":
        source = f"{len(inputs['files'])} files"
    else:
        source = f"{inputs['dataset']} {inputs['split']}"
    tokenizer = f" ({manifest['tokenizer']['spec']}, {manifest['token_dtype']})" if inputs else ""
    rich_console().print(
        f"{name}: {files['train.bin']['tokens']:,} training and {files['val.bin']['tokens']:,} validation tokens "
        f"({documents['train']:,} + {documents['val']:,} documents from {source}), vocabulary "
        f"{manifest['vocab_size']}{tokenizer}\nin {folder}",
        highlight=False, soft_wrap=True,
    )
