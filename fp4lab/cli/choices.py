"""The types of fp4lab's enumerated options. typer turns a Literal into a choice: --help shows <a|b|c>,
any other value is a usage error (exit 2). Each set of values is imported from the module that owns
it, a module that imports no torch, pydantic or numpy (`fp4lab --help` must stay fast)."""

from __future__ import annotations

from typing import Literal

from fp4lab.lab.choices import PROPOSERS, RATCHET_EXECUTORS, SWEEP_EXECUTORS
from fp4lab.lab.records.logscan import PRESETS as LOG_PRESETS
from fp4lab.nn.recipe import NS_POLYNOMIALS
from fp4lab.numerics_choices import DISTRIBUTIONS
from fp4lab.train.config import (
    ATTENTION_KERNELS,
    COMPILES,
    COMPUTES,
    CORPORA,
    CUDA_GRAPHS,
    DEVICES,
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    GATHER_WEIGHTS,
    LR_SCHEDULES,
    MODEL_PRESETS,
    MX_GEMMS,
    OPTIMIZERS,
    PARALLELS,
    PRODUCER_FUSIONS,
    QK_CLIPS,
    RECOMPUTES,
    TOKEN_DTYPES,
)

# What `fp4lab bench` times: the command's own choice.
BENCH_WHAT = ("all", "kernels", "steps", "gemm", "attention", "fusion")

ModelPreset = Literal[MODEL_PRESETS]
Optimizer = Literal[OPTIMIZERS]
LrSchedule = Literal[LR_SCHEDULES]
QkClip = Literal[QK_CLIPS]
NsPolynomial = Literal[NS_POLYNOMIALS]
Device = Literal[DEVICES]
Compute = Literal[COMPUTES]
Compile = Literal[COMPILES]
CudaGraphs = Literal[CUDA_GRAPHS]
AttentionKernel = Literal[ATTENTION_KERNELS]
MxGemm = Literal[MX_GEMMS]
ProducerFusion = Literal[PRODUCER_FUSIONS]
Recompute = Literal[RECOMPUTES]
Parallel = Literal[PARALLELS]
GatherWeights = Literal[GATHER_WEIGHTS]
TokenDtype = Literal[TOKEN_DTYPES]
Distribution = Literal[DISTRIBUTIONS]
LogPreset = Literal[tuple(LOG_PRESETS)]
SweepExecutor = Literal[SWEEP_EXECUTORS]
RatchetExecutor = Literal[RATCHET_EXECUTORS]
Proposer = Literal[PROPOSERS]
BenchWhat = Literal[BENCH_WHAT]
Corpus = Literal[CORPORA]
ExportFormat = Literal[EXPORT_FORMATS]
ExportDtype = Literal[EXPORT_DTYPES]


# Shell completion (`fp4lab --install-completion`) of the values that are names rather than choices.


def complete_recipe(incomplete: str) -> list[str]:
    """Built-in recipe names starting with what was typed; none (the shell then completes file names)
    for a path to a recipe .toml."""
    from fp4lab.nn.recipe import list_recipes

    return [name for name in list_recipes() if name.startswith(incomplete)]


def complete_sweep(ctx, incomplete: str) -> list[str]:
    """The names of the sweeps in the catalog (the command's --catalog, else ./sweep_catalog.json)
    starting with what was typed; none where there is no readable catalog."""
    from pathlib import Path

    from fp4lab.lab.records.catalog import Catalog, CatalogError

    path = Path(ctx.params.get("catalog") or "sweep_catalog.json")
    if not path.is_file():
        return []
    try:
        names = Catalog(path).sweeps()
    except (CatalogError, OSError):
        return []
    return [name for name in names if name.startswith(incomplete)]
