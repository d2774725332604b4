"""`fp4lab numerics`: the quantization error of one tensor under every FP4 format, or of the backward
GEMMs on the operands a run captured."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import Distribution
from fp4lab.cli.conventions import UserError, fail, print_json, rich_console
from fp4lab.train.gemm_formats import DEFAULT_FORMATS
from fp4lab.train.gemm_formats import FORMATS as GEMM_FORMATS


def numerics(
    tensor: Annotated[
        Optional[Path], typer.Option(help="A .pt file holding a tensor (or a dict of tensors: pick one with --key).")
    ] = None,
    key: Annotated[Optional[str], typer.Option(help="Entry of a dict/state_dict in --tensor.")] = None,
    dist: Annotated[
        Optional[Distribution], typer.Option(help="Synthesize the tensor instead (default normal when no --tensor).")
    ] = None,
    shape: Annotated[str, typer.Option(help="ROWSxCOLS of a synthesized tensor.")] = "512x1024",
    seed: Annotated[int, typer.Option(help="Seed for synthesis, stochastic rounding and random signs.")] = 0,
    capture: Annotated[
        Optional[Path], typer.Option(help="A run folder trained with capture_steps (or one capture .pt file): the Dgrad and Wgrad output error of each format on its captured real operands.")
    ] = None,
    gemm_format: Annotated[
        Optional[list[str]], typer.Option("--format", help=f"With --capture: an operand format to compare, one of {', '.join(GEMM_FORMATS)} (repeatable; default bf16 and every FP4 one, or none when --recipe is given).")
    ] = None,
    recipe: Annotated[
        Optional[list[str]], typer.Option(help="With --capture: a recipe whose own Dgrad and Wgrad operand specs to compare (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """Quantization error of one tensor under every FP4 format x scale mode x rounding x transform;
    with --capture, the error of the backward GEMM outputs on the real operands a run captured."""
    if capture is not None:
        if tensor is not None or dist is not None or key is not None:
            fail("numerics: --capture reads its own tensors; drop --tensor, --key and --dist")
        _numerics_capture(capture, gemm_format, recipe or [], seed, as_json)
        return
    if gemm_format or recipe:
        fail("numerics: --format and --recipe compare GEMM outputs on captured tensors; pass --capture RUN too")

    from fp4lab.numerics.survey import survey_cases

    if tensor is not None and dist is not None:
        fail("numerics: pass either --tensor or --dist, not both")
    if tensor is None and dist is None:
        dist = "normal"
    x, source = _load_tensor(tensor, key) if tensor is not None else _synthesize(dist, shape, seed)

    from fp4lab.numerics.survey import survey

    if as_json:
        rows = [row.as_dict() for row in survey(x, seed=seed)]
        print_json({"source": source, "shape": list(x.shape), "seed": seed, "rows": rows})
        return

    from rich.progress import Progress

    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("quantizing", total=len(survey_cases()))
        rows = list(survey(x, seed=seed, on_case=lambda: progress.advance(task)))
    _print_numerics(rows, title=f"Quantization error of {source}, shape {list(x.shape)}, seed {seed}")


def _numerics_capture(source: Path, formats: list[str] | None, recipes: list[str], seed: int, as_json: bool) -> None:
    """`numerics --capture`: a thin wrapper of fp4lab.train.gemm_error."""
    from fp4lab.nn.recipe import RecipeError, load_recipe
    from fp4lab.train.capture import CaptureError, capture_files
    from fp4lab.train.gemm_error import candidates, measure, summarize
    from fp4lab.validation import Checks

    for name in formats or []:
        Checks(UserError).choice("numerics: --format", name, GEMM_FORMATS)
    try:
        loaded = [load_recipe(name) for name in recipes]
    except RecipeError as exc:
        fail(f"numerics: --recipe: {str(exc).splitlines()[0]}")
    names = list(dict.fromkeys(formats)) if formats is not None else ([] if recipes else list(DEFAULT_FORMATS))
    chosen = candidates(names, list({r.name: r for r in loaded}.values()))
    try:
        files = capture_files(source)
        if as_json:
            rows = measure(files, chosen, seed)
        else:
            from rich.progress import Progress

            with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
                task = progress.add_task("GEMMs on captured operands", total=len(files))
                rows = measure(files, chosen, seed, on_capture=lambda: progress.advance(task))
    except CaptureError as exc:
        fail(f"numerics: --capture: {exc}")
    summary = summarize(rows, chosen)
    if as_json:
        described = [{"name": c.name, "kind": c.kind, "operands": c.describe()} for c in chosen]
        print_json({"source": str(source), "seed": seed, "candidates": described, "captures": [str(f) for f in files],
                    "rows": [row.as_dict() for row in rows], "summary": summary})
        return
    _print_gemm_errors(rows, summary, chosen, title=f"Backward GEMM output error on the operands captured in {source}")


def _print_gemm_errors(rows, summary: dict, chosen, title: str) -> None:
    from rich.table import Table

    by_key = {(r.step, r.layer, r.candidate, r.gemm): r for r in rows}
    table = Table(title=title, caption="rel = ||Y_q - Y|| / ||Y|| against the fp32 product of the same exact tensors; "
                  "bold: the lowest Dgrad error of that capture among quantized (FP4, FP8) candidates")
    for name in ("step", "layer", "candidate"):
        table.add_column(name, no_wrap=True)
    for name in ("Dgrad rel%", "Dgrad cos", "Wgrad rel%", "Wgrad cos"):
        table.add_column(name, justify="right", no_wrap=True)
    contenders = [c.name for c in chosen if c.quantized()] or [c.name for c in chosen]
    captures = list(dict.fromkeys((r.step, r.layer) for r in rows))
    for step, layer in captures:
        best = min(contenders, key=lambda name: by_key[(step, layer, name, "dgrad")].rel)
        for candidate in chosen:
            d, w = (by_key[(step, layer, candidate.name, gemm)] for gemm in ("dgrad", "wgrad"))
            table.add_row(str(step), layer, candidate.name, f"{100 * d.rel:.2f}", f"{d.cosine:.5f}", f"{100 * w.rel:.2f}",
                          f"{w.cosine:.5f}", style="bold" if candidate.name == best else None)
        table.add_section()
    means = Table(title=f"Mean over {len(captures)} captures; E/E_best: geometric mean of the error energy over the best quantized candidate's",
                  caption="bold: the lowest mean error of that GEMM among quantized candidates")
    for name in ("candidate", "operands"):
        means.add_column(name)
    for name in ("Dgrad rel%", "Dgrad E/E_best", "Wgrad rel%", "Wgrad E/E_best"):
        means.add_column(name, justify="right", no_wrap=True)
    for candidate in chosen:
        cells = []
        for gemm in ("dgrad", "wgrad"):
            stats = summary["candidates"][candidate.name][gemm]
            text = f"{100 * stats['mean_rel']:.2f}"
            cells += [f"[bold]{text}[/]" if summary["best"][gemm] == candidate.name else text, f"{stats['energy_vs_best']:.3f}"]
        means.add_row(candidate.name, candidate.describe(), *cells)
    console = rich_console()
    console.print(table)
    console.print(means)
    pair = summary.get("mx_vs_cta")
    if pair:
        console.print(f"E_MX / E_CTA (Dgrad error energy, {pair['mx']} over {pair['cta']}, geometric mean over the same tensors): "
                      f"{pair['energy_ratio_geomean']:.3f}; {pair['cta']} lower in {pair['cta_lower']} of {pair['captures']} captures",
                      markup=False)


def _print_numerics(rows, title: str) -> None:
    from rich.table import Table

    best = {}
    for row in rows:
        group = (row.format, row.scale_mode, row.rounding)
        if group not in best or row.stats.rel_rms < best[group].stats.rel_rms:
            best[group] = row
    table = Table(title=title, caption="bold: lowest error over transforms for that format, scale and rounding")
    for name in ("format", "scale", "round", "transform"):
        table.add_column(name, no_wrap=True)
    for name in ("relRMS%", "SNR dB", "bias%", "satur%", "flush%"):
        table.add_column(name, justify="right", no_wrap=True)
    previous = None
    for row in rows:
        s = row.stats
        if previous is not None and previous != (row.format, row.scale_mode):
            table.add_section()
        previous = (row.format, row.scale_mode)
        table.add_row(
            row.format, row.scale_mode, row.rounding, row.transform,
            f"{100 * s.rel_rms:.2f}", f"{s.snr_db:.2f}", f"{100 * s.bias:+.3f}",
            f"{100 * s.saturated:.3f}", f"{100 * s.flushed:.2f}",
            style="bold" if best[(row.format, row.scale_mode, row.rounding)] is row else None,
        )
    effect = Table(title="Transform effect: change of rel RMS vs no transform (RTN); negative is better")
    effect.add_column("format")
    effect.add_column("scale")
    transforms = [r.transform for r in rows if r.transform != "none"]
    transforms = list(dict.fromkeys(transforms))
    for name in transforms:
        effect.add_column(name, justify="right")
    base = {(r.format, r.scale_mode): r.stats.rel_rms for r in rows if r.rounding == "rtn" and r.transform == "none"}
    for (fmt, mode), none_error in base.items():
        cells = []
        for name in transforms:
            err = next(r.stats.rel_rms for r in rows if (r.format, r.scale_mode, r.rounding, r.transform) == (fmt, mode, "rtn", name))
            change = 100 * (err / none_error - 1) if none_error else 0.0
            cells.append(f"[green]{change:+.1f}%[/]" if change < 0 else f"[red]{change:+.1f}%[/]")
        effect.add_row(fmt, mode, *cells)
    console = rich_console()
    console.print(table)
    console.print(effect)


def parse_shape(text: str, where: str) -> tuple[int, int]:
    """ROWSxCOLS of a tensor quantized along its rows: COLS must hold whole MXFP4 blocks."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        fail(f"{where} {text!r} is not ROWSxCOLS with positive sizes (e.g. 512x1024)")
    if int(parts[1]) % 32:
        fail(f"{where} {text!r} needs COLS a multiple of 32 (the MXFP4 block)")
    return int(parts[0]), int(parts[1])


def _synthesize(dist: str, shape: str, seed: int):
    from fp4lab.numerics.survey import synthesize

    rows, cols = parse_shape(shape, "numerics: --shape")
    return synthesize(dist, rows, cols, seed), f"--dist {dist}"


def _load_tensor(path: Path, key: str | None):
    import pickle

    import torch

    if not path.is_file():
        fail(f"numerics: --tensor {str(path)!r} is not a file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as exc:  # what torch.load raises for a file it cannot read
        fail(f"numerics: --tensor {str(path)!r} is not a loadable torch file ({type(exc).__name__}: {exc})".split("\n")[0])
    if isinstance(obj, dict):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if key is None:
            fail(f"numerics: {str(path)!r} holds a dict; pick a tensor with --key (one of: {', '.join(list(tensors)[:8])})")
        if key not in tensors:
            fail(f"numerics: --key {key!r} is not a tensor in {str(path)!r}; tensors: {', '.join(list(tensors)[:8])}")
        obj = tensors[key]
    elif key is not None:
        fail(f"numerics: --key was given but {str(path)!r} holds a single tensor")
    if not isinstance(obj, torch.Tensor) or not obj.is_floating_point() or obj.dim() == 0:
        fail(f"numerics: {str(path)!r} must hold a floating-point tensor with at least one dim")
    if obj.shape[-1] % 32:
        fail(f"numerics: the last dim of the tensor ({obj.shape[-1]}) must be a multiple of 32 (the MXFP4 block)")
    label = f"{path.name}" + (f"[{key}]" if key else "")
    return obj.detach().to(torch.float32), label
