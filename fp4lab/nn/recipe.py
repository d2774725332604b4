"""Recipes: which number format every GEMM operand of every linear uses, as validated data.

A recipe is a TOML file (the built-in ones live in fp4lab/recipes/). It names a format spec for each
of the six operands of a linear layer y = x W^T:

    Fprop  y  = x  W^T     operands fprop_x  [M, K] and fprop_w  [N, K]   (contraction over K)
    Dgrad  dx = dy W       operands dgrad_dy [M, N] and dgrad_w  [K, N]   (contraction over N)
    Wgrad  dW = dy^T x     operands wgrad_dy [N, M] and wgrad_x  [K, M]   (contraction over M)

Every operand is quantized along its contraction dim. Recipes compose: `extends` names a parent whose
tables are merged under this file's; `[[blocks]]` entries override the linear recipe of chosen
transformer blocks (depth hybrids); group tables (`all`, `weight`, `activation`, `grad_output`,
`fprop`, `dgrad`, `wgrad`) set several operands at once (operand hybrids override single operands).
docs/RECIPES.md documents every key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from fp4lab.validation import Checks, did_you_mean, read_toml

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "recipes"

OPERAND_FORMATS = ("bf16", "fp32", "mxfp4", "nvfp4", "nvfp4_cta", "fp8")
FP4_FORMATS = ("mxfp4", "nvfp4", "nvfp4_cta")
QUANTIZED_FORMATS = (*FP4_FORMATS, "fp8")
FP8_ELEMENTS = ("e4m3", "e5m2")  # numerics.fp8.FP8_ELEMENTS
FP8_SCALINGS = ("tensor", "row")  # numerics.fp8.FP8_SCALINGS
FP8_KEYS = ("element", "scaling", "pow2_scale")
MX_SCALE_MODES = ("floor", "ceil", "even", "rceil")
ROUNDINGS = ("rtn", "sr")
HADAMARD_SIZES = (16, 32, 64, 128)
# rhtfull: random signs over the whole contraction dim, zero-padded to a power of two (OptiTrain-FP4).
TRANSFORMS = ("none",) + tuple(
    f"{kind}{size}" for kind in ("h", "hplain", "rht") for size in HADAMARD_SIZES
) + ("rhtfull",)
OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
GEMMS = {"fprop": ("fprop_x", "fprop_w"), "dgrad": ("dgrad_dy", "dgrad_w"), "wgrad": ("wgrad_dy", "wgrad_x")}
WEIGHT_OPERANDS = ("fprop_w", "dgrad_w")
# Group tables, applied in this order so the more specific one wins; a single operand beats all.
OPERAND_GROUPS = {
    "all": OPERANDS,
    "weight": WEIGHT_OPERANDS,
    "activation": ("fprop_x", "wgrad_x"),
    "grad_output": ("dgrad_dy", "wgrad_dy"),
    **GEMMS,
}
BLOCK_SELECTORS = ("first", "last", "first_fraction", "last_fraction", "range")
HEAD_FORMATS = ("bf16", "fp32", "fp4")
EMBEDDING_FORMATS = ("bf16", "fp32")
ATTENTION_FORMATS = ("bf16", "nvfp4", "mxfp4")
OPTIMIZERS = ("adamw", "muon")
QK_CLIPS = ("none", "kimi", "update_cap")
NS_FORMATS = ("bf16", "nvfp4")
NS_POLYNOMIALS = ("quintic", "cubic")  # the names; optim.muon.NS_POLYNOMIALS holds their coefficients
ADAM_V_FORMATS = ("fp32", "nvfp4")


class RecipeError(ValueError):
    """A recipe file or reference that does not validate; the message names the file and key."""


@dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand is represented. `transform` is applied along the contraction dim:
    hN = fixed-sign Hadamard (TE's signs), hplainN = unsigned Hadamard, rhtN = random signs drawn
    per GEMM call from the layer's generator; rhtfull = random signs over the whole contraction dim,
    zero-padded to a power of two. `element`, `scaling` and `pow2_scale` are fp8's (E4M3 / E5M2,
    per-tensor or per-row current scale, optionally rounded down to a power of two)."""

    format: str = "bf16"
    scale_mode: str | None = None
    rounding: str = "rtn"
    transform: str = "none"
    tile: tuple[int, int] | None = None
    adaptive: bool = False
    cta_tile: int | None = None
    element: str | None = None
    scaling: str | None = None
    pow2_scale: bool | None = None

    @property
    def is_fp4(self) -> bool:
        return self.format in FP4_FORMATS

    @property
    def is_quantized(self) -> bool:
        """FP4 or FP8: the GEMM reads an encoding, not the value rounded to bf16 / fp32."""
        return self.format in QUANTIZED_FORMATS

    @property
    def full_transform(self) -> bool:
        """The transform spans the whole contraction dim (its length is known per GEMM call)."""
        return self.transform.endswith("full")

    @property
    def transform_size(self) -> int | None:
        """The Hadamard block: 0 without a transform, None for a full-dimension one."""
        if self.full_transform:
            return None
        return 0 if self.transform == "none" else int(self.transform.lstrip("hplainrt"))

    @property
    def transform_signs(self) -> str:
        kind = self.transform.removesuffix("full").rstrip("0123456789")
        return {"h": "fixed", "hplain": "none", "rht": "random"}[kind]

    def describe(self) -> str:
        if self.format == "fp8":
            parts = [self.format, self.element, self.scaling + ("+pow2" if self.pow2_scale else "")]
            return " ".join(parts + ([self.transform] if self.transform != "none" else []))
        if not self.is_fp4:
            return self.format
        parts = [self.format]
        if self.scale_mode:
            parts.append(self.scale_mode + ("+adaptive" if self.adaptive else ""))
        if self.tile:
            parts.append(f"2D{self.tile[0]}x{self.tile[1]}")
        if self.cta_tile:
            parts.append(f"cta{self.cta_tile}")
        parts.append(self.rounding)
        if self.transform != "none":
            parts.append(self.transform)
        return " ".join(parts)


@dataclass(frozen=True)
class LinearRecipe:
    fprop_x: OperandSpec = OperandSpec()
    fprop_w: OperandSpec = OperandSpec()
    dgrad_dy: OperandSpec = OperandSpec()
    dgrad_w: OperandSpec = OperandSpec()
    wgrad_dy: OperandSpec = OperandSpec()
    wgrad_x: OperandSpec = OperandSpec()

    def operand(self, name: str) -> OperandSpec:
        return getattr(self, name)

    @property
    def is_high_precision(self) -> bool:
        return not any(self.operand(name).is_quantized for name in OPERANDS)

    @property
    def is_plain_bf16(self) -> bool:
        """Every operand bf16 with no transform: an ordinary bf16 linear."""
        return all(self.operand(name) == OperandSpec("bf16") for name in OPERANDS)

    @property
    def shares_weight_encoding(self) -> bool:
        """Fprop and Dgrad decode the same weight: 2D tiles with one spec, so Q(W^T) = Q(W)^T."""
        return self.fprop_w.tile is not None and self.fprop_w == self.dgrad_w and self.fprop_w.transform == "none"


@dataclass(frozen=True)
class BlockOverride:
    selector: str
    value: Any
    linear: LinearRecipe

    def blocks(self, n_layers: int) -> range | list[int]:
        if self.selector == "first":
            return range(min(self.value, n_layers))
        if self.selector == "last":
            return range(max(0, n_layers - self.value), n_layers)
        if self.selector == "range":
            start, stop = self.value
            return range(start, min(stop, n_layers - 1) + 1)
        count = math.floor(self.value * n_layers + 0.5)
        return range(count) if self.selector == "first_fraction" else range(n_layers - count, n_layers)


@dataclass(frozen=True)
class AttentionRecipe:
    format: str = "bf16"
    ds_rounding: str = "sr"


@dataclass(frozen=True)
class OptimizerRecipe:
    name: str | None = None
    qk_clip: str = "none"
    qk_clip_tau: float = 100.0
    update_cap_alpha: float = 0.05
    update_cap_alpha_qk: float = 0.02
    ns_format: str = "bf16"
    ns_polynomial: str = "quintic"
    adam_v_format: str = "fp32"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    source: str = ""
    linear: LinearRecipe = LinearRecipe()
    blocks: tuple[BlockOverride, ...] = ()
    head: str = "bf16"
    embedding: str = "bf16"
    lora_svd_rank: int = 0
    lora_svd_every: int = 4000
    attention: AttentionRecipe = AttentionRecipe()
    optimizer: OptimizerRecipe = OptimizerRecipe()
    path: str = field(default="", compare=False)

    def linear_for_block(self, block: int, n_layers: int) -> LinearRecipe:
        chosen = self.linear
        for override in self.blocks:
            if block in override.blocks(n_layers):
                chosen = override.linear
        return chosen

    def head_linear(self) -> LinearRecipe:
        uniform = OperandSpec(format="fp32" if self.head == "fp32" else "bf16")
        return self.linear if self.head == "fp4" else LinearRecipe(*(uniform,) * len(OPERANDS))

    def ledger(self, n_layers: int) -> list[tuple[str, LinearRecipe]]:
        """(blocks label, linear recipe) rows, consecutive blocks with one recipe merged."""
        rows: list[tuple[list[int], LinearRecipe]] = []
        for block in range(n_layers):
            linear = self.linear_for_block(block, n_layers)
            if rows and rows[-1][1] == linear:
                rows[-1][0].append(block)
            else:
                rows.append(([block], linear))
        labeled = [(f"{b[0]}" if len(b) == 1 else f"{b[0]}-{b[-1]}", linear) for b, linear in rows]
        return labeled + [("head", self.head_linear())]


def list_recipes() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name, or a recipe TOML file by path."""
    try:
        return _build(_resolve(name_or_path), name_or_path)
    except RecursionError:
        raise RecipeError(f"recipe {name_or_path!r}: [[blocks]] recipe = ... references form a cycle") from None


def _locate(name_or_path: str, referrer: Path | None = None) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".toml":
        if not candidate.is_absolute() and referrer is not None and not candidate.exists():
            candidate = referrer.parent / candidate
        if not candidate.is_file():
            raise RecipeError(f"recipe file {str(candidate)!r} does not exist")
        return candidate
    builtin = BUILTIN_DIR / f"{name_or_path}.toml"
    if not builtin.is_file():
        where = f" (extends in {referrer})" if referrer else ""
        raise RecipeError(
            f"unknown recipe {name_or_path!r}{where}{did_you_mean(name_or_path, list_recipes())}; built-in recipes: {', '.join(list_recipes())}; "
            "or pass a path to a .toml file"
        )
    return builtin


def _resolve(name_or_path: str, referrer: Path | None = None, seen: tuple[Path, ...] = ()) -> tuple[dict, Path]:
    """Load a recipe file and merge it over its `extends` chain. Returns (merged table, own path)."""
    path = _locate(name_or_path, referrer)
    if path.resolve() in seen:
        chain = " -> ".join(str(p.name) for p in (*seen, path))
        raise RecipeError(f"{path}: extends forms a cycle ({chain})")
    table = read_toml(path, RecipeError, "recipe file")
    parent = table.pop("extends", None)
    if parent is None:
        return table, path
    if not isinstance(parent, str):
        raise RecipeError(f"{path}: extends must be a recipe name or a .toml path, got {parent!r}")
    base, _ = _resolve(parent, path, (*seen, path.resolve()))
    for key in ("name", "description", "source"):
        base.pop(key, None)
    return _merge(base, table), path


def _merge(base: dict, override: dict) -> dict:
    """Tables merge recursively; any other value (arrays such as [[blocks]] included) is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


_TOP_KEYS = ("name", "description", "source", "linear", "blocks", "model", "attention", "optimizer")


def _build(resolved: tuple[dict, Path], reference: str) -> Recipe:
    table, path = resolved
    where = str(path)
    _reject_unknown(table, _TOP_KEYS, where, "")
    name = table.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise RecipeError(f"{where}: name must be a non-empty string")
    linear = _build_linear(table.get("linear", {}), where, "linear")
    blocks = tuple(_build_block(entry, i, linear, where) for i, entry in enumerate(_list(table, "blocks", where)))
    model = _table(table, "model", where)
    _reject_unknown(model, ("head", "embedding", "lora_svd_rank", "lora_svd_every"), where, "model.")
    attention = _table(table, "attention", where)
    _reject_unknown(attention, ("format", "ds_rounding"), where, "attention.")
    optimizer = _table(table, "optimizer", where)
    _reject_unknown(optimizer, [f.name for f in fields(OptimizerRecipe)], where, "optimizer.")
    return Recipe(
        name=name,
        description=_typed(table, "description", str, "", where, ""),
        source=_typed(table, "source", str, "", where, ""),
        linear=linear,
        blocks=blocks,
        head=_choice(model, "head", HEAD_FORMATS, "bf16", where, "model."),
        embedding=_choice(model, "embedding", EMBEDDING_FORMATS, "bf16", where, "model."),
        lora_svd_rank=_positive(model, "lora_svd_rank", 0, where, "model.", allow_zero=True),
        lora_svd_every=_positive(model, "lora_svd_every", 4000, where, "model."),
        attention=AttentionRecipe(
            format=_choice(attention, "format", ATTENTION_FORMATS, "bf16", where, "attention."),
            ds_rounding=_choice(attention, "ds_rounding", ROUNDINGS, "sr", where, "attention."),
        ),
        optimizer=OptimizerRecipe(
            name=_choice(optimizer, "name", OPTIMIZERS, None, where, "optimizer."),
            qk_clip=_choice(optimizer, "qk_clip", QK_CLIPS, "none", where, "optimizer."),
            qk_clip_tau=_number(optimizer, "qk_clip_tau", 100.0, where, "optimizer."),
            update_cap_alpha=_number(optimizer, "update_cap_alpha", 0.05, where, "optimizer."),
            update_cap_alpha_qk=_number(optimizer, "update_cap_alpha_qk", 0.02, where, "optimizer."),
            ns_format=_choice(optimizer, "ns_format", NS_FORMATS, "bf16", where, "optimizer."),
            ns_polynomial=_choice(optimizer, "ns_polynomial", NS_POLYNOMIALS, "quintic", where, "optimizer."),
            adam_v_format=_choice(optimizer, "adam_v_format", ADAM_V_FORMATS, "fp32", where, "optimizer."),
        ),
        path=where,
    )


def _build_linear(table: Any, where: str, prefix: str, base: LinearRecipe | None = None) -> LinearRecipe:
    if not isinstance(table, dict):
        raise RecipeError(f"{where}: {prefix} must be a table of operand specs")
    _reject_unknown(table, (*OPERAND_GROUPS, *OPERANDS), where, prefix + ".")
    raw: dict[str, dict] = {name: {} for name in OPERANDS}
    if base is not None:
        raw = {name: _spec_to_table(base.operand(name)) for name in OPERANDS}
    for key in (*OPERAND_GROUPS, *OPERANDS):
        if key not in table:
            continue
        if not isinstance(table[key], dict):
            raise RecipeError(f"{where}: {prefix}.{key} must be a table such as {{ format = \"nvfp4\" }}")
        for operand in OPERAND_GROUPS.get(key, (key,)):
            # A table that names a format defines the operand afresh (so an NVFP4 override does not
            # inherit MXFP4's scale_mode); one without a format adjusts what is there.
            raw[operand] = dict(table[key]) if "format" in table[key] else raw[operand] | table[key]
    specs = {name: _build_operand(raw[name], where, f"{prefix}.{name}", name) for name in OPERANDS}
    linear = LinearRecipe(**specs)
    for gemm, (a, b) in GEMMS.items():
        if specs[a].transform != specs[b].transform:
            raise RecipeError(
                f"{where}: {prefix}.{a}.transform = {specs[a].transform!r} but {prefix}.{b}.transform = "
                f"{specs[b].transform!r}; the two operands of {gemm} need the same transform (paired, so the "
                "product is unchanged)"
            )
    return linear


def _spec_to_table(spec: OperandSpec) -> dict:
    table = {f.name: getattr(spec, f.name) for f in fields(OperandSpec) if getattr(spec, f.name) is not None}
    if spec.tile is not None:
        table["tile"] = list(spec.tile)
    return table


def _build_operand(table: dict, where: str, key: str, operand: str) -> OperandSpec:
    prefix = key + "."
    _reject_unknown(table, [f.name for f in fields(OperandSpec)], where, prefix)
    fmt = _choice(table, "format", OPERAND_FORMATS, "bf16", where, prefix)
    spec = OperandSpec(
        format=fmt,
        scale_mode=_choice(table, "scale_mode", MX_SCALE_MODES, None, where, prefix),
        rounding=_choice(table, "rounding", ROUNDINGS, "rtn", where, prefix),
        transform=_choice(table, "transform", TRANSFORMS, "none", where, prefix),
        tile=_tile(table, where, prefix),
        adaptive=_typed(table, "adaptive", bool, False, where, prefix),
        cta_tile=_positive(table, "cta_tile", None, where, prefix) if "cta_tile" in table else None,
        element=_choice(table, "element", FP8_ELEMENTS, None, where, prefix),
        scaling=_choice(table, "scaling", FP8_SCALINGS, None, where, prefix),
        pow2_scale=_typed(table, "pow2_scale", bool, False, where, prefix) if "pow2_scale" in table else None,
    )
    if spec.full_transform and spec.tile is not None:
        raise RecipeError(f"{where}: {prefix}tile cannot be combined with transform = {spec.transform!r} (its padded length is known per call)")
    if fmt != "fp8" and any(k in table for k in FP8_KEYS):
        raise RecipeError(f"{where}: {key} is {fmt}; element, scaling and pow2_scale apply to format = \"fp8\" only")
    if not spec.is_fp4:
        options = [k for k in ("scale_mode", "tile", "cta_tile") if table.get(k) is not None]
        if spec.rounding != "rtn" or spec.adaptive or options:
            raise RecipeError(f"{where}: {key} is {fmt}; rounding, scale_mode, tile, adaptive and cta_tile apply to FP4 formats only")
        if fmt == "fp8":
            defaults = {"element": spec.element or "e4m3", "scaling": spec.scaling or "tensor"}
            return replace(spec, **defaults, pow2_scale=bool(spec.pow2_scale))
        return spec
    block = 32 if fmt == "mxfp4" else 16
    if fmt == "mxfp4" and spec.scale_mode is None:
        spec = replace(spec, scale_mode="floor")
    if fmt != "mxfp4" and spec.scale_mode is not None:
        raise RecipeError(f"{where}: {prefix}scale_mode applies to mxfp4 only (got format {fmt!r})")
    if spec.adaptive and spec.scale_mode != "rceil":
        raise RecipeError(f"{where}: {prefix}adaptive = true needs scale_mode = \"rceil\"")
    if spec.cta_tile is not None and fmt != "nvfp4_cta":
        raise RecipeError(f"{where}: {prefix}cta_tile applies to nvfp4_cta only")
    if spec.tile is not None:
        if operand not in WEIGHT_OPERANDS:
            raise RecipeError(f"{where}: {prefix}tile applies to weights (fprop_w, dgrad_w) only")
        if any(t % block for t in spec.tile):
            raise RecipeError(f"{where}: {prefix}tile = {list(spec.tile)} must be multiples of the {fmt} block {block}")
    return spec


def _build_block(entry: Any, index: int, base: LinearRecipe, where: str) -> BlockOverride:
    key = f"blocks[{index}]"
    if not isinstance(entry, dict):
        raise RecipeError(f"{where}: {key} must be a table")
    _reject_unknown(entry, (*BLOCK_SELECTORS, "recipe", "linear"), where, key + ".")
    chosen = [s for s in BLOCK_SELECTORS if s in entry]
    if len(chosen) != 1:
        raise RecipeError(f"{where}: {key} needs exactly one selector of {', '.join(BLOCK_SELECTORS)}")
    selector, value = chosen[0], entry[chosen[0]]
    if selector in ("first", "last") and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise RecipeError(f"{where}: {key}.{selector} must be a block count >= 0")
    if selector.endswith("fraction") and (not isinstance(value, (int, float)) or not 0 <= value <= 1):
        raise RecipeError(f"{where}: {key}.{selector} must be a fraction in [0, 1]")
    if selector == "range" and (
        not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) for v in value) or value[0] > value[1] or value[0] < 0
    ):
        raise RecipeError(f"{where}: {key}.range must be [first, last] block indices (0-based, inclusive)")
    linear = base
    if "recipe" in entry:
        if not isinstance(entry["recipe"], str):
            raise RecipeError(f"{where}: {key}.recipe must be a recipe name")
        linear = _build(_resolve(entry["recipe"], Path(where)), entry["recipe"]).linear
    if "linear" in entry:
        linear = _build_linear(entry["linear"], where, f"{key}.linear", base=linear)
    if "recipe" not in entry and "linear" not in entry:
        raise RecipeError(f"{where}: {key} needs recipe = \"name\" or a linear table")
    return BlockOverride(selector, tuple(value) if selector == "range" else value, linear)


def _checks(where: str) -> Checks:
    return Checks(lambda message: RecipeError(f"{where}: {message}"))


def _reject_unknown(table: dict, allowed, where: str, prefix: str) -> None:
    _checks(where).known_keys(table, allowed, prefix.rstrip("."))


def _table(table: dict, key: str, where: str) -> dict:
    value = table.get(key, {})
    if not isinstance(value, dict):
        raise RecipeError(f"{where}: {key} must be a table")
    return value


def _list(table: dict, key: str, where: str) -> list:
    value = table.get(key, [])
    if not isinstance(value, list):
        raise RecipeError(f"{where}: {key} must be an array of tables ([[{key}]])")
    return value


def _choice(table: dict, key: str, allowed, default, where: str, prefix: str):
    value = table.get(key, default)
    return value if value is default else _checks(where).choice(prefix + key, value, allowed)


def _typed(table: dict, key: str, kind: type, default, where: str, prefix: str):
    value = table.get(key, default)
    if not isinstance(value, kind):
        raise RecipeError(f"{where}: {prefix}{key} must be a {kind.__name__}, got {value!r}")
    return value


def _number(table: dict, key: str, default: float, where: str, prefix: str) -> float:
    return float(_checks(where).number(prefix + key, table.get(key, default), positive=True))


def _positive(table: dict, key: str, default, where: str, prefix: str, allow_zero: bool = False):
    return _checks(where).integer(prefix + key, table.get(key, default), minimum=0 if allow_zero else 1, optional=True)


def _tile(table: dict, where: str, prefix: str) -> tuple[int, int] | None:
    value = table.get("tile")
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
        raise RecipeError(f"{where}: {prefix}tile must be [rows, cols], e.g. [16, 16]")
    return (value[0], value[1])
