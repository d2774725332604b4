"""`fp4lab export`: a run's model as a checkpoint other software loads (fp4lab.train.export)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fp4lab.cli.choices import ExportDtype, ExportFormat
from fp4lab.cli.conventions import fail, print_json, rich_console


def export(
    run: Annotated[str, typer.Argument(metavar="RUN", help="A run folder (runs/<sweep>/<id>, or the out_dir of fp4lab train), or a run id of the catalog.")],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="The folder to write: created, or replaced whole with --force.")],
    export_format: Annotated[ExportFormat, typer.Option("--format", help="hf: a Hugging Face Llama folder (model.safetensors, config.json, the tokenizer) that transformers' LlamaForCausalLM.from_pretrained loads.")] = "hf",
    dtype: Annotated[ExportDtype, typer.Option(help="float32 keeps the fp32 master weights bit for bit; bfloat16 rounds each one, halving the files.")] = "float32",
    tokenizer: Annotated[bool, typer.Option("--tokenizer/--no-tokenizer", help="Also write the BPE fp4lab trained for the run's corpus (shakespeare, pycode), for AutoTokenizer.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT when it is not empty.")] = False,
    catalog: Annotated[Path, typer.Option(help="The results catalog, where a RUN that is not a folder is looked up as a run id.")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written (recipe, step, files, tokenizer) as JSON.")] = False,
) -> None:
    """Export a run's newest checkpoint: its master weights (the fp32 parameters, not quantized), named
    by the recipe that trained them. Nothing is written to OUT unless all of it is."""
    from fp4lab.train.export import ExportError, export_hf

    try:
        exported = export_hf(_run_folder(run, catalog), out, dtype=dtype, force=force, tokenizer=tokenizer,
                             progress=not as_json)  # fmt: skip
    except ExportError as exc:
        fail(f"export: {exc}")
    if as_json:
        print_json(exported.to_dict())
        return
    _print_export(exported, tokenizer)


def _print_export(exported, tokenizer_asked: bool) -> None:
    console = rich_console()

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)  # paths may hold brackets

    say(f"exported {exported.run} (recipe {exported.recipe}, step {exported.step}) to {exported.out} as a Hugging Face "
        f"Llama: master weights in {exported.dtype}, {exported.parameters:,} parameters")  # fmt: skip
    say(f"  files: {', '.join(exported.files)}")
    if exported.tokenizer is not None:
        say(f"  tokenizer: {exported.tokenizer}")
    else:
        say("  tokenizer: left out (--no-tokenizer)" if not tokenizer_asked else f"  tokenizer: none, the {exported.corpus} corpus is token ids")
    for what in exported.left_out:
        say(f"  left out: {what}")
    if exported.training is not None:
        say(f"  note: the run is still being trained (by {exported.training}); this is its step-{exported.step} checkpoint")
    say(f"load it: transformers.LlamaForCausalLM.from_pretrained({str(exported.out)!r})")


def _run_folder(run: str, catalog: Path) -> Path:
    """RUN as a folder, or the run folder the catalog records for the run id RUN."""
    folder = Path(run)
    if folder.is_dir():
        return folder
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    try:
        recorded = Catalog(catalog).run_dir(run) if catalog.exists() else None
    except CatalogError as exc:
        fail(f"export: {str(exc).splitlines()[0]}")
    if recorded is None:
        where = f"a run id in {catalog}" if catalog.exists() else f"a run id (no catalog at {catalog})"
        fail(f"export: {run!r} is neither a run folder nor {where}; give runs/<sweep>/<id> or the out_dir of fp4lab train")
    return recorded
