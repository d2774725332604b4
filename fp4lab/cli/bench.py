"""`fp4lab bench`: fp4lab timed against its anchors (quantizers vs a copy, training steps vs a plain
PyTorch loop, the CUDA kernels vs cuBLAS and SDPA)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import (
    AttentionKernel,
    BenchWhat,
    Compile,
    CudaGraphs,
    Device,
    ModelPreset,
    MxGemm,
    Optimizer,
    ProducerFusion,
    Recompute,
)
from fp4lab.cli.conventions import fail, print_json
from fp4lab.cli.numerics import parse_shape

# (model, batch, seq, timed steps, warmup, kernel shape) when not given: a GPU-sized run on CUDA, a
# smoke-sized one on the CPU.
SUITES = ("kernels", "gemm", "attention", "fusion", "steps")  # in the order `all` runs them
DEFAULT_SUITES = ("kernels", "steps")
BENCH_DEFAULTS = {"cuda": ("125m", 16, 1024, 20, 5, "8192x8192"), "cpu": ("tiny", 8, 128, 10, 2, "1024x1024")}


def bench(
    what: Annotated[Optional[BenchWhat], typer.Argument(help="What to time (default: kernels and steps): kernels (quantizers vs a copy), steps (training steps vs the plain PyTorch loop), gemm (the MXFP4 GEMM on FP8 tensor cores vs bf16 cuBLAS, the 125m and 350m GEMMs at --batch-size x --seq-len), attention (Triton flash attention with the fused probes vs SDPA, fwd + bwd, head dims 64 and 128, seq 1024-8192), fusion (each fused FP4 producer vs its torch ops, eager and compiled, at the --model's widths and --batch-size x --seq-len tokens) or all (the five). gemm, attention and fusion need CUDA. Each table prints as its suite ends.")] = None,
    recipes: Annotated[str, typer.Option(help="Comma-separated recipes to time beside the anchor; torchao-float8 and torchao-float8-rowwise time the anchor under torchao's float8 training.", rich_help_panel="What is timed")] = "bf16,nvfp4,nvfp4-all,mxfp4-rowsr-h32",
    model: Annotated[Optional[ModelPreset], typer.Option(help="Model preset (default 125m on CUDA, tiny on the CPU).", rich_help_panel="What is timed")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per step (default 16 on CUDA, 8 on the CPU).", rich_help_panel="What is timed")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default 1024 on CUDA, 128 on the CPU).", rich_help_panel="What is timed")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Timed steps per configuration (default 20 on CUDA, 10 on the CPU).", rich_help_panel="What is timed")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed steps first, compilation included (default 5 on CUDA, 2 on the CPU).", rich_help_panel="What is timed")] = None,
    optimizer: Annotated[Optimizer, typer.Option(help="adamw (as the anchor) or muon.", rich_help_panel="What is timed")] = "adamw",
    compile: Annotated[Compile, typer.Option(help="torch.compile of fp4lab and the anchor (auto: on CUDA).", rich_help_panel="Fast path")] = "auto",
    cuda_graphs: Annotated[CudaGraphs, typer.Option(help="Replay fp4lab's steps from a CUDA graph (auto: where possible on CUDA).", rich_help_panel="Fast path")] = "auto",
    attention_kernel: Annotated[AttentionKernel, typer.Option(help="fp4lab's attention: triton (flash kernels: fused probes, FP4 attention with dS quantized in the kernels) or sdpa (PyTorch's; FP4 attention chunked) (auto: triton on CUDA).", rich_help_panel="Fast path")] = "auto",
    mx_gemm: Annotated[MxGemm, typer.Option(help="fp4lab's MXFP4 GEMMs: fp8 or bf16 tensor cores (auto: bf16, the faster on an H200).", rich_help_panel="Fast path")] = "auto",
    producer_fusion: Annotated[ProducerFusion, typer.Option(help="on: fp4lab's feed-forwards fuse the SwiGLU into W2's GEMMs; all: also the residual add and RMSNorm into W1's and W3's operands (time them against off).", rich_help_panel="Fast path")] = "off",
    recompute: Annotated[Recompute, typer.Option(help="gate-up: fp4lab's FP4 feed-forwards make gate and up again in the backward instead of keeping them (time and memory against off).", rich_help_panel="Fast path")] = "off",
    shape: Annotated[Optional[str], typer.Option(help="ROWSxCOLS of the quantized tensor (default 8192x8192 on CUDA, 1024x1024 on the CPU).", rich_help_panel="What is timed")] = None,
    device: Annotated[Device, typer.Option(help="Where to time (auto: CUDA if there is one).", rich_help_panel="Where and output")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's).", rich_help_panel="Where and output")] = None,
    profile: Annotated[Optional[Path], typer.Option(help="Also profile 3 steps of each run; kernel tables into this folder.", rich_help_panel="Where and output")] = None,
    memory: Annotated[Optional[Path], typer.Option(help="CUDA: record the allocator's history through each run's steps and write what holds its peak into this folder (slows the steps: time without it).", rich_help_panel="Where and output")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.", rich_help_panel="Where and output")] = False,
) -> None:
    """Time fp4lab against its anchors: quantizers vs a copy, training steps vs a plain PyTorch loop (and,
    asked by name or with `all`, the GEMM, attention and fused-producer kernels)."""
    import torch
    from rich.console import Console

    target = _device(device)
    if memory is not None and target.type != "cuda":
        fail("bench: --memory records the CUDA allocator's history; it needs --device cuda (drop --memory on the CPU)")
    names = _recipe_names(recipes)
    d_model, d_batch, d_seq, d_steps, d_warmup, d_shape = BENCH_DEFAULTS[target.type]
    model, batch_size, seq_len = model or d_model, batch_size or d_batch, seq_len or d_seq
    steps, warmup = steps or d_steps, d_warmup if warmup is None else warmup
    model_shape = _model_shape_on_paths_that_run(target, model, batch_size, seq_len, steps, attention_kernel, mx_gemm,
                                                 producer_fusion, recompute)
    rows, cols = parse_shape(shape or d_shape, "bench: --shape")
    if threads is not None:
        torch.set_num_threads(threads)
    console = Console(stderr=True, quiet=as_json)
    tables = Console()
    chosen = DEFAULT_SUITES if what is None else SUITES if what == "all" else (what,)
    report: dict = {"device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu", "torch": torch.__version__}
    for suite in (s for s in SUITES if s in chosen):  # each table as soon as its suite ends: an interrupt keeps them
        if suite == "kernels":
            report["kernels"] = _time_quantizers(rows, cols, target, console, report["device"])
        elif suite == "gemm":
            report["gemm"], report["tile_gemm"] = _time_gemms(batch_size, seq_len, target, console, report["device"])
        elif suite == "attention":
            report["attention"] = _time_attention(target, console, report["device"])
        elif suite == "fusion":
            report["fusion"] = _time_producer_fusion(model, model_shape, batch_size * seq_len, target, console, report["device"])
        else:
            console.print(f"training steps: {model}, {batch_size} x {seq_len}, {steps} timed after {warmup} warm-up")
            report["steps"], report["ratios"] = _time_steps(
                names, console, model=model, batch_size=batch_size, seq_len=seq_len, device=target, steps=steps, warmup=warmup,
                compile=compile, cuda_graphs=cuda_graphs, attention_kernel=attention_kernel, mx_gemm=mx_gemm,
                producer_fusion=producer_fusion, recompute=recompute, optimizer=optimizer, profile_dir=profile, memory_dir=memory,
            )
        if not as_json:
            _print_suite(report, suite, tables)
    if as_json:
        print_json(report)


def _device(device: str):
    """The torch device `--device` names (auto: CUDA if there is one)."""
    from fp4lab.train.build import resolve_device
    from fp4lab.train.config import ConfigError

    try:
        return resolve_device(device)
    except ConfigError:
        fail("bench: --device cuda but CUDA is not available here; use --device cpu")


def _recipe_names(recipes: str) -> list[str]:
    """The recipes of `--recipes`, each checked to load (a torchao float8 anchor: torchao installed)."""
    import importlib.util

    from fp4lab.bench.anchor import TORCHAO_FLOAT8
    from fp4lab.nn.recipe import RecipeError, load_recipe

    names = [r.strip() for r in recipes.split(",") if r.strip()]
    try:
        for name in names:
            if name in TORCHAO_FLOAT8:
                if importlib.util.find_spec("torchao") is None:
                    fail(f"bench: --recipes {name} is the plain loop under torchao's float8 training; install torchao (pip install torchao)")
            else:
                load_recipe(name)
    except RecipeError as exc:
        fail(f"bench: {exc}")
    return names


def _model_shape_on_paths_that_run(target, model: str, batch_size: int, seq_len: int, steps: int, attention_kernel: str,
                                   mx_gemm: str, producer_fusion: str, recompute: str):
    """The model preset's shape, once the compute paths asked for are known to run on `target`: a path
    this device lacks is refused here, not after the anchor ran."""
    from fp4lab.nn.model_config import preset
    from fp4lab.train.config import ConfigError, TrainConfig
    from fp4lab.train.paths import resolve as resolve_paths

    try:
        kernels = TrainConfig(
            model=model, batch_size=batch_size, seq_len=seq_len, steps=steps, device=target.type,
            attention_kernel=attention_kernel, mx_gemm=mx_gemm, producer_fusion=producer_fusion, recompute=recompute,
        )
        model_shape = preset(model, 4096, seq_len)
        resolve_paths(kernels, target, model_shape.head_dim)
    except ConfigError as exc:
        fail(f"bench: {exc}")
    return model_shape


def _time_quantizers(rows: int, cols: int, target, console, device_name: str) -> list[dict]:
    from fp4lab.bench.kernels import bench_kernels

    console.print(f"quantizers on a {rows} x {cols} bf16 tensor ({device_name})")
    kernels = bench_kernels(rows, cols, target, on_result=lambda r: console.print(f"  {r.case}: {r.gb_per_s:,.3g} GB/s"))
    return [k.as_dict() for k in kernels]


def _time_gemms(batch_size: int, seq_len: int, target, console, device_name: str) -> tuple[list[dict], list[dict]]:
    """The MXFP4 GEMM and the CTA-local 2D-weight GEMM vs bf16 cuBLAS, at the 125m and 350m training
    GEMMs' shapes; empty lists where they cannot run."""
    from fp4lab.bench.kernels import bench_mx_gemm, bench_tile_gemm, training_gemm_shapes

    shapes = [shape for name in ("125m", "350m") for shape in training_gemm_shapes(name, batch_size, seq_len)]
    console.print(f"FP4 GEMM kernels vs bf16 cuBLAS ({device_name}): MXFP4 on FP8 tensor cores, CTA-local 2D weights")
    gemms = [bench_mx_gemm(m, n, k, target, label=label) for label, m, n, k in shapes]
    gemm = [g.as_dict() for g in gemms if g is not None]
    tiles = [bench_tile_gemm(m, n, k, target, label=label) for label, m, n, k in shapes if "Wgrad" not in label]
    tile_gemm = [g.as_dict() for g in tiles if g is not None]
    if not gemm:
        console.print("  skipped: the GEMM kernels need CUDA and Triton")
    return gemm, tile_gemm


def _time_attention(target, console, device_name: str) -> list[dict]:
    from fp4lab.bench.attention import ATTENTION_SHAPES, bench_attention

    console.print(f"attention fwd + bwd, fused probes vs SDPA ({device_name})")
    results = [bench_attention(*shape, target) for shape in ATTENTION_SHAPES]
    attention = [r.as_dict() for r in results if r is not None]
    if not attention:
        console.print("  skipped: the Triton attention needs CUDA")
    return attention


def _time_producer_fusion(model: str, model_shape, tokens: int, target, console, device_name: str) -> list[dict]:
    from fp4lab.bench.fusion import bench_producer_fusion

    console.print(f"fused FP4 producers vs their torch ops, eager and compiled: {model}, {tokens} tokens ({device_name})")
    widths = ((model_shape.dim, ("residual_rmsnorm",)), (model_shape.ffn_hidden, ("swiglu", "swiglu_backward")))
    results = [bench_producer_fusion((tokens, width), fmt, target, producers=producers)
               for fmt in ("mxfp4", "nvfp4") for width, producers in widths]  # fmt: skip
    fusion = [r.as_dict() for r in results if r is not None]
    if not fusion:
        console.print("  skipped: the fused producers need CUDA and Triton")
    return fusion


def _step_line(r) -> str:
    """A run's figures as it finishes, whole on one line: a call cut off before the table keeps them."""
    memory = f", peak {r.peak_memory_mb:,.0f} MB" if r.peak_memory_mb is not None else ""
    return f"  {r.name}: {r.tokens_per_s:,.0f} tokens/s, {r.step_ms:.1f} ms a step (spread {r.step_ms_spread:.1%}){memory}"


def _time_steps(names: list[str], console, **settings) -> tuple[list[dict], dict]:
    """Training steps of each recipe beside the plain PyTorch anchor (fp4lab.bench.steps.bench_steps with
    `settings`), and the ratios between them."""
    from fp4lab.bench.steps import bench_steps

    results = bench_steps(names, **settings, on_result=lambda r: console.print(_step_line(r)))
    return [r.as_dict() for r in results], _bench_ratios(results)


def _bench_ratios(results) -> dict:
    """The issue's figures: bf16 tokens/s over the anchor's; each FP4 step time and peak memory over bf16's."""
    by_name = {r.name: r for r in results}
    anchor, bf16 = by_name.get("anchor"), by_name.get("bf16")
    ratios: dict = {}
    if anchor and bf16:
        ratios["bf16_tokens_per_s_vs_anchor"] = bf16.tokens_per_s / anchor.tokens_per_s
    if bf16:
        for r in results:
            if r.name not in ("anchor", "bf16"):
                ratios[f"{r.name}_step_time_vs_bf16"] = r.step_ms / bf16.step_ms
                if r.peak_memory_mb and bf16.peak_memory_mb:
                    ratios[f"{r.name}_peak_memory_vs_bf16"] = r.peak_memory_mb / bf16.peak_memory_mb
    return ratios


def _print_suite(report: dict, suite: str, console) -> None:
    """The table of one suite of `report`, once it has run."""
    from rich import box
    from rich.table import Table

    from fp4lab.bench.fusion import PRODUCERS

    if suite == "kernels" and "kernels" in report:
        table = Table(title=f"Quantizers vs a device-to-device copy ({report['device']})")
        for column in ("case", "implementation", "shape", "ms", "GB/s", "copy GB/s", "fraction of copy"):
            table.add_column(column, justify="left" if column in ("case", "implementation") else "right")
        for k in report["kernels"]:
            table.add_row(k["case"], k["implementation"], f"{k['rows']}x{k['cols']}", f"{k['ms']:.3f}", f"{k['gb_per_s']:,.3g}",
                          f"{k['copy_gb_per_s']:,.3g}", f"{k['fraction_of_copy']:.2f}")
        console.print(table)
    for key, title in (("gemm", "MXFP4 GEMM on FP8 tensor cores"), ("tile_gemm", "Chunk-scaled GEMM of CTA-local 2D weights")):
        if suite != "gemm" or not report.get(key):
            continue
        table = Table(title=f"{title} vs bf16 cuBLAS ({report['device']})")
        for column in ("GEMM", "m x n x k", "ms", "TFLOP/s", "bf16 ms", "bf16 TFLOP/s", "throughput vs bf16"):
            table.add_column(column, justify="left" if column == "GEMM" else "right")
        for g in report[key]:
            table.add_row(g["case"], f"{g['m']}x{g['n']}x{g['k']}", f"{g['ms']:.3f}", f"{g['tflops']:,.0f}", f"{g['bf16_ms']:.3f}",
                          f"{g['bf16_tflops']:,.0f}", f"{g['throughput_vs_bf16']:.2f}")
        console.print(table)
    if suite == "attention" and report.get("attention"):
        table = Table(title=f"Attention fwd + bwd, bf16, causal GQA ({report['device']})")
        for column in ("B x H/Hkv x T x D", "SDPA ms", "fused ms", "fused / SDPA", "poly exp2 / SDPA", "SDPA + probes ms"):
            table.add_column(column, justify="left" if column.startswith("B") else "right")
        for a in report["attention"]:
            table.add_row(f"{a['batch']} x {a['heads']}/{a['kv_heads']} x {a['seq']} x {a['head_dim']}", f"{a['sdpa_ms']:.3f}",
                          f"{a['fused_ms']:.3f}", f"{a['fused_vs_sdpa']:.2f}", f"{a['fused_poly_vs_sdpa']:.2f}", f"{a['sdpa_with_probes_ms']:.3f}")
        console.print(table)
    if suite == "fusion" and report.get("fusion"):
        table = Table(title=f"Fused FP4 producers vs their torch ops ({report['device']})")
        for column in ("producer", "format", "tokens x features", "eager ms", "compiled ms", "fused ms", "eager / fused", "compiled / fused"):
            table.add_column(column, justify="left" if column in ("producer", "format") else "right")
        for bench in report["fusion"]:
            for name in PRODUCERS:
                if name in bench:
                    t = bench[name]
                    table.add_row(name, bench["fmt"], f"{bench['tokens']} x {bench['features']}", f"{t['unfused_ms']:.3f}", f"{t['compiled_ms']:.3f}",
                                  f"{t['fused_ms']:.3f}", f"{t['gain']:.2f}", f"{t['gain_over_compiled']:.2f}")
        console.print(table)
    if suite == "steps" and "steps" in report:
        steps = report["steps"]
        first = steps[0]
        # No vertical rules, two-line headers, each run's compute in the caption: fits 80 columns.
        computes: dict[str, list[str]] = {}
        for r in steps:
            computes.setdefault(r["compute"], []).append(r["name"])
        table = Table(title=f"Training steps, {first['model']} {first['batch_size']} x {first['seq_len']} ({report['device']})",
                      caption="compute: " + "; ".join(f"{', '.join(names)} {compute}" for compute, names in computes.items()),
                      box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
        for column in ("run", "compile\n/graph", "step\nms", "tokens\n/ s", "vs\nanchor", "step\n/ bf16", "peak\nMB", "peak\n/ bf16"):
            table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
        by_name = {r["name"]: r for r in steps}
        anchor, bf16 = by_name.get("anchor"), by_name.get("bf16")
        for r in steps:
            vs_anchor = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}" if anchor else "-"
            vs_bf16 = f"{r['step_ms'] / bf16['step_ms']:.2f}" if bf16 else "-"
            memory = f"{r['peak_memory_mb']:,.0f}" if r["peak_memory_mb"] is not None else "-"
            memory_ratio = (f"{r['peak_memory_mb'] / bf16['peak_memory_mb']:.2f}"
                            if bf16 and r["peak_memory_mb"] and bf16["peak_memory_mb"] else "-")
            table.add_row(r["name"], f"{'yes' if r['compiled'] else 'no'}/{'yes' if r['cuda_graph'] else 'no'}", f"{r['step_ms']:.1f}",
                          f"{r['tokens_per_s']:,.0f}", vs_anchor, vs_bf16, memory, memory_ratio)
        console.print(table)
