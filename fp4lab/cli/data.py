"""`fp4lab data`: build the corpora that are made once, and pack them for a machine without network."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import Corpus
from fp4lab.cli.conventions import Commands, fail, print_json, rich_console

group = typer.Typer(cls=Commands, help="Build the training corpora that are made once (the embedded Shakespeare builds itself).", no_args_is_help=True)


@group.command("build")
def data_build(
    name: Annotated[Corpus, typer.Argument(help="The corpus to build.")],
    bundle: Annotated[Optional[Path], typer.Option("--from", help="Unpack a bundle made by `fp4lab data pack` instead of building (no network); every file must match the bundle's manifest.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Build again even if the corpus is already built.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the corpus's manifest as JSON instead of a summary.")] = False,
) -> None:
    """Build a corpus into $FP4LAB_CACHE (default ~/.cache/fp4lab): pycode downloads 21 pinned sdists
    from PyPI (157 MB), keeps their .py files, trains a 32768-token BPE and tokenizes (~3 minutes on
    2 cores). Training configs then name it as data source ("pycode")."""
    from fp4lab.train import pycode
    from fp4lab.train.data import cache_dir, status_line

    cache = cache_dir()
    try:
        if bundle is None and not force and (pycode.corpus_dir(cache) / "manifest.json").is_file():
            manifest = pycode.load(cache)[3]
        else:
            with status_line(not as_json) as status:
                manifest = pycode.unpack(cache, bundle, status=status) if bundle else pycode.build(cache, status=status)
    except pycode.CorpusError as exc:
        fail(str(exc))
    _print_corpus(name, pycode.corpus_dir(cache), manifest, as_json)


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
    from fp4lab.train.data import cache_dir, status_line

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
    files = manifest["files"]
    rich_console().print(
        f"{name}: {files['train.bin']['tokens']:,} training and {files['val.bin']['tokens']:,} validation tokens "
        f"({manifest['documents']['train']:,} + {manifest['documents']['val']:,} documents from "
        f"{len(manifest['packages'])} packages), vocabulary {manifest['vocab_size']}\nin {folder}",
        highlight=False,
    )
