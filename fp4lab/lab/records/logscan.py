"""Scan one training run's log for anomalies and give it a verdict. Standard library only (no torch,
no numpy), so `fp4lab scan` stays fast.

What it reads (`scan(path, ...)`):

- an fp4lab run folder, or its `metrics.jsonl` directly: one JSON object per step (`step`, `loss`,
  `lr`, `grad_norm`, `tokens_per_s`, optional `val_loss`; on probe steps `attn_entropy`
  [layers][heads], `attn_entropy_mean` [layers], `max_logit` [layers][heads], `max_logit_max`).
  NaN / Infinity tokens are read as floats. `summary.json` beside it, when present, gives the status
  (completed | diverged | time_limit | preempted | stopped) and `diverged_step`.
- a foreign plain-text log, parsed line by line with a regex whose named groups are `step` and
  `loss` (optional `grad_norm`, `val_loss`, `nan_iters`, `skipped_iters`); ANSI colour codes are
  removed first. Built-in presets (`PRESETS`): `nanogpt` (`iter 120: loss 3.2101, time 41.20ms, mfu
  12.00%`; eval lines `step 250: train loss 3.1, val loss 3.2`), `megatron` (`iteration      120/
  1000 | ... | lm loss: 3.210000E+00 | loss scale: 1.0 | grad norm: 0.812 | number of skipped
  iterations:   0 | number of nan iterations:   0 |`; eval lines `validation loss at iteration 1000 |
  lm loss value: 3.2E+00 | ...`), `torchtitan` (`step:  10  loss:  9.8765  grad_norm: ...  memory:
  ...`, each field behind a colour code; eval lines `validate step: 20  loss: ...`) and `fp4lab`
  (what `fp4lab train` prints, i.e. the local worker log `jobs/<sweep>/logs/<id>.local.log`: `step
  3/12 loss 5.0373 lr 0.02 tok/s 14694`, optional ` val_loss 4.4579` after the loss, and the final
  block `status: ...` / `diverged_step: ...` / `steps_completed: ...`, which plays the part of
  summary.json; training lines after a block mean a resumed segment, and clear it). Step numbers
  are the log's own. With neither `regex` nor `preset`, the preset matching the most lines is used;
  when none matches a line, the log is still read for crash/timeout markers and gets `no_loss`.
  Megatron leaves `lm loss` out of its line when the averaged loss is not > 0 (NaN included) and
  counts a NaN in `number of nan iterations` (non-zero `nan_iters` counts as a NaN); some versions
  and settings drop the loss while both counters stay 0: see `loss_missing`.

Corrupt lines (bad JSON, a half-written last line, a JSON value that is not an object, an object
without an integer `step`, a regex match whose numbers do not parse) are skipped and counted in
`counts["skipped_lines"]`, never fatal. A missing file raises `FileNotFoundError`; a bad regex or an
unknown preset raises `ValueError`.

Events (`ScanEvent`: kind, first step, value, threshold, detail; consecutive flagged steps are merged
into one event whose detail gives the number of steps and the peak). Defaults are in `ScanThresholds`:

- `nan`: a NaN/Inf loss, grad norm or val loss (or a Megatron line with nan iterations > 0).
- `loss_missing`: a training line (the format's main pattern; every metrics.jsonl record) without a
  loss after earlier lines had one, not explained by skipped or nan iterations (an interval of fp16
  loss-scale overflows has no loss to average). A live log's half-written last line does not count.
- `loss_spike`, two rules, either fires:
  - ratio, for sparse logs and the first steps: once `spike_ratio_min_count` (1) finite loss is
    logged, loss_t > `spike_ratio` (2.0) x the median of the previous `spike_ratio_baseline` (5)
    finite losses. LLM Foundry's KillLossSpike uses 2x its window mean; a median of the most recent
    points ignores an earlier spike and follows a falling curve, so Megatron's one line per 100
    iterations is checked from iteration 100 on (a 2.5x jump at iteration 2,500 is caught; the sigma
    rule needs 3,200). One earlier loss suffices: a healthy loss falls from its first value, and an
    AdamW rate of 1.0 (sweeps/ledger_stress_adamw.toml) took it from 8.3 to 46 at step 1.
  - sigma, for dense logs: once the trailing window of the previous `spike_window` (128) finite
    losses holds `spike_min_count` (32) values, loss_t > mean + `spike_sigma` (6) x std of the window
    (OLMo-core's StabilityMonitor rule; skipped while std < 1e-10).
- `loss_above_start`: the loss has run away and not come back: from some step to the end of the log,
  the median of the last `spike_ratio_baseline` (5) finite losses stays above `diverge_ratio` (1.5) x
  the first finite loss logged (the event's step is the first of that final streak, its value the
  median there). A model's first loss is about the highest a healthy run sits (ln(vocab) at
  initialisation); a run that ends far above it has diverged, NaN or not: in the ledger's AdamW
  stress runs the loss climbed to 180-3,600 and stayed finite. A loss that runs away and recovers
  (AdamW lr 0.1 there: 10.5 -> 31 by step 8, 3.6 at the end) is not flagged.
- `grad_spike`: the mean + k x std rule on grad_norm (OLMo-core checks both); informational.
- `entropy_collapse`: on a probe step, one layer's mean attention entropy (nats; mean over heads)
  below `entropy_floor` (0.05 nats), or, once that layer has `entropy_min_probes` (1) earlier probes,
  below `entropy_drop_factor` (0.2) x the median of its earlier probes. One earlier probe suffices:
  in the ledger's stress runs (docs/LEDGER.md) a layer fell from 5.9 nats at step 0 to 0.46 by step 10
  and stayed above the floor, which a baseline of three probes would have made its own median.
- `max_logit`: any head's max attention logit above `max_logit_tau` (100, Kimi K2's QK-Clip tau).
- `stalled`: time-based: the run has not finished and its log was last written more than
  `stall_seconds` (600) before `now` (value = age in seconds). Emitted when `running=True` was passed
  (the scheduler says the job is alive but it is not logging: hung) or for an fp4lab run with no
  summary (it died without writing one). Progress-based, off by default: with `stall_steps=M`, the
  first step at which the best loss has not improved by more than `stall_min_delta` over the
  previous M steps.

Verdict, first rule that applies wins (precedence top to bottom). Every problem outranks `running`:
a live job with a NaN, a spike or a vanished loss is exactly when the alarm matters (`live` in the
result says whether the job still runs). Only `converged` and `running` are healthy
(`HEALTHY_VERDICTS`); `fp4lab scan` exits 1 on any other.

1. `diverged@STEP`: a `nan` event, a `loss_above_start` event, or summary status `diverged`. STEP
   = summary `diverged_step`, else the first `nan` event's step, else the `loss_above_start` step.
2. `entropy_collapse@STEP`: an `entropy_collapse` event; STEP = its first step.
3. `loss_vanished@STEP`: a `loss_missing` event; STEP = its first step.
4. `crashed`: a text log with a crash marker (`Traceback (most recent call last)`, `CUDA error`,
   `out of memory`, `Segmentation fault`, `NCCL error`) and no timeout marker.
5. `timeout`: summary status `time_limit`, `preempted` or `stopped` (fp4lab writes `preempted` for
   Slurm's SIGTERM/SIGUSR1, which it also sends at the time limit: the run stopped cleanly with a
   checkpoint and can be resumed), or a Slurm marker `DUE TO TIME LIMIT` / `DUE TO PREEMPTION` in a text
   log. Not when `running=True` (a resumed segment is under way).
6. `crashed`: an fp4lab run with no summary that is not live (`running=False`, or a stale log).
7. `no_loss`: no loss value was parsed at all (an empty log, no line in a known format, or lines of
   the format that never carry the loss); the reason says which and what to pass.
8. `unstable`: any event whose kind is in `unstable_kinds` (default: `loss_spike` only; `max_logit`
   and `grad_spike` are warnings, since a QK-Clip run's pre-clip logits exceed tau by design).
9. `stalled`: `running=True` but the log is older than `stall_seconds`: hung.
10. `running`: live and nothing wrong. Live = `running=True`, or (`running=None`) not finished and
   the log written within `stall_seconds` of `now`. "Finished" = a summary (or a text log's summary
   block) with a terminal status; a text log without one is never known to be finished, so it is
   live while fresh. A summary whose `steps_completed` is behind the metrics (stale, from an earlier
   preempted segment) is ignored.
11. `converged`: otherwise (including a stale text log with no markers, i.e. a finished one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4lab.train.config import ENDED_STATUSES, STOPPED_STATUSES, summary_value
from fp4lab.train.jsonl import read_metrics_file

__all__ = [
    "PRESETS",
    "LogFormat",
    "ScanEvent",
    "ScanResult",
    "ScanThresholds",
    "format_result",
    "result_fields",
    "scan",
]

VERDICTS = (
    "converged", "diverged", "entropy_collapse", "loss_vanished", "no_loss", "unstable", "crashed", "timeout",
    "interrupted", "stalled", "running",
)
HEALTHY_VERDICTS = ("converged", "running")  # every other verdict is an alarm (`fp4lab scan` exits 1)
EVENT_KINDS = ("nan", "loss_missing", "loss_spike", "loss_above_start", "grad_spike", "entropy_collapse", "max_logit", "stalled")

# A number as training code prints it, NaN and Inf included (Python "nan", "inf"; C/C++ "-nan", "NaN").
NUM = r"[-+]?(?:nan|inf(?:inity)?|(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"

CRASH_MARKERS = re.compile(
    r"Traceback \(most recent call last\)|CUDA error|out of memory|OutOfMemoryError|Segmentation fault|NCCL error",
)
TIMEOUT_MARKERS = re.compile(r"DUE TO TIME LIMIT|DUE TO PREEMPTION")
# A run stopped before its end: "timeout" when its time ran out (its budget, Slurm's time limit), else
# "interrupted" (Ctrl-C, a terminated sweep, a preemption); either resumes from its checkpoint.
TIME_LIMIT_STATUSES = ("time_limit",)
# Colour codes (torchtitan colours every field) are removed before a line is matched.
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TERMINAL_STATUSES = ENDED_STATUSES + STOPPED_STATUSES


# Earlier names of thresholds, still accepted in overrides (--threshold, [scan] tables of old specs).
RENAMED_THRESHOLDS = {"spike_k": "spike_sigma", "grad_spike_k": "grad_spike_sigma"}


@dataclass(frozen=True)
class ScanThresholds:
    """Every rule's knobs. Override with `dataclasses.replace`, or `with_overrides({...})` (which also
    takes the strings a CLI or sweep spec passes and rejects unknown names)."""

    spike_window: int = 128  # trailing window of previous finite losses (OLMo-core: 128)
    spike_sigma: float = 6.0  # loss > mean + sigma * std of the window (OLMo-core: 6)
    spike_min_count: int = 32  # no spike test until the window holds this many values
    spike_ratio: float | None = 2.0  # loss > ratio * median of the recent losses; None turns the rule off
    spike_ratio_baseline: int = 5  # the ratio rule's baseline: median of this many previous finite losses
    spike_ratio_min_count: int = 1  # ... tested once this many are logged (sparse logs: Megatron logs every 100)
    diverge_ratio: float | None = 1.5  # the loss ends (median of the last few) above ratio x its first value; None: off
    grad_spike_sigma: float | None = 6.0  # same mean + sigma * std rule on grad_norm; None: off
    entropy_floor: float = 0.05  # nats; a layer's mean attention entropy below this collapses
    entropy_drop_factor: float | None = 0.2  # ... or below factor * median of its earlier probes
    entropy_min_probes: int = 1  # earlier probes of that layer needed for the relative rule
    max_logit_tau: float = 100.0  # any head's max attention logit above tau
    stall_seconds: float = 600.0  # a log older than this (by mtime) is not running
    stall_steps: int | None = None  # no best-loss improvement over this many steps; None: off
    stall_min_delta: float = 0.0  # an improvement must exceed this (absolute, in loss units)
    unstable_kinds: tuple[str, ...] = ("loss_spike",)  # events that make a finished run "unstable"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name}: {value!r} must be a finite number >= 0")
        if self.spike_window < 1 or self.spike_min_count < 2 or self.spike_min_count > self.spike_window:
            raise ValueError("need spike_window >= 1 and 2 <= spike_min_count <= spike_window")
        if self.diverge_ratio is not None and self.diverge_ratio < 1:
            raise ValueError(f"diverge_ratio: {self.diverge_ratio!r} must be >= 1 (a healthy loss falls below its first value)")
        if not 1 <= self.spike_ratio_min_count <= self.spike_ratio_baseline:
            raise ValueError("need 1 <= spike_ratio_min_count <= spike_ratio_baseline")
        unknown = set(self.unstable_kinds) - set(EVENT_KINDS)
        if unknown:
            raise ValueError(f"unstable_kinds: unknown kind(s) {sorted(unknown)}; choose from {', '.join(EVENT_KINDS)}")

    def with_overrides(self, overrides: Mapping[str, Any] | Iterable[str]) -> ScanThresholds:
        """A copy with some fields changed: a mapping {name: value}, or "name=value" strings.
        Strings are converted to the field's type ("none"/"off" gives None where allowed,
        unstable_kinds takes a comma-separated list)."""
        if not isinstance(overrides, Mapping):
            pairs = {}
            for item in overrides:
                name, sep, value = str(item).partition("=")
                if not sep:
                    raise ValueError(f"threshold override {item!r}: expected NAME=VALUE")
                pairs[name.strip()] = value.strip()
            overrides = pairs
        changes = dict(threshold_value(name, value) for name, value in overrides.items())
        if "spike_window" in changes and "spike_min_count" not in changes:  # a short window must not demand more history than it holds
            changes["spike_min_count"] = min(self.spike_min_count, max(2, int(changes["spike_window"])))
        return dataclasses.replace(self, **changes)


def threshold_value(name: str, value: Any) -> tuple[str, Any]:
    """(field, value) of one override: the name checked (earlier names accepted, `-` for `_`) and the
    value converted to the field's type; ValueError naming the problem otherwise."""
    key = name.replace("-", "_")
    key = RENAMED_THRESHOLDS.get(key, key)
    fields = [f.name for f in dataclasses.fields(ScanThresholds)]
    if key not in fields:
        raise ValueError(f"unknown threshold {name!r}; allowed: {', '.join(fields)}")
    return key, _coerce(key, value)


_INT_THRESHOLDS = ("spike_window", "spike_min_count", "spike_ratio_baseline", "spike_ratio_min_count", "entropy_min_probes", "stall_steps")


def _coerce(name: str, value: Any) -> Any:
    if name == "unstable_kinds":
        return tuple(k.strip() for k in value.split(",") if k.strip()) if isinstance(value, str) else tuple(value)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("none", "off", "null", ""):
            return None
        try:
            return int(text) if name in _INT_THRESHOLDS else float(text)
        except ValueError:
            raise ValueError(f"threshold {name}: {value!r} is not a number") from None
    if name in _INT_THRESHOLDS and isinstance(value, int) and not isinstance(value, bool):
        return value
    if name not in _INT_THRESHOLDS and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"threshold {name}: {value!r} is not {'an integer' if name in _INT_THRESHOLDS else 'a number'}")


@dataclass
class ScanEvent:
    """One anomaly episode: `step` is its first step; `value` the value there (loss, entropy, logit,
    age in seconds); `threshold` what it was compared with; `steps` how many consecutive flagged steps
    (or probes) the episode spans; `peak` the worst value in it."""

    kind: str
    step: int
    value: float
    threshold: float | None = None
    detail: str = ""
    steps: int = 1
    peak: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "value": _json_float(self.value),
            "threshold": _json_float(self.threshold),
            "steps": self.steps,
            "peak": _json_float(self.peak),
            "detail": self.detail,
        }


@dataclass
class ScanResult:
    path: str
    verdict: str  # a VERDICTS entry; diverged, entropy_collapse and loss_vanished carry "@STEP"
    status: str  # the verdict without "@STEP"
    verdict_step: int | None
    events: list[ScanEvent] = field(default_factory=list)
    first_step: dict[str, int] = field(default_factory=dict)  # kind -> first step of that kind
    counts: dict[str, int] = field(default_factory=dict)  # lines, skipped_lines, steps, and flagged steps per kind
    last_step: int | None = None
    final_train_loss: float | None = None  # the loss of the last training step (None when NaN/Inf or missing there)
    best_train_loss: float | None = None
    final_val_loss: float | None = None
    last_finite_loss: float | None = None  # the last finite loss and its step: where a diverged run stood
    last_finite_step: int | None = None
    source: str = ""  # "fp4lab", the preset or "regex" used for a text log, "unknown" when none matched
    summary_status: str | None = None
    live: bool = False  # the job is alive (running=True, or an unfinished log written within stall_seconds)
    reasons: list[str] = field(default_factory=list)  # why this verdict, in words

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (strict JSON): non-finite event values become the strings "nan", "inf", "-inf"."""
        return {
            "path": self.path,
            "verdict": self.verdict,
            "status": self.status,
            "verdict_step": self.verdict_step,
            "events": [e.to_dict() for e in self.events],
            "first_step": dict(self.first_step),
            "counts": dict(self.counts),
            "last_step": self.last_step,
            "final_train_loss": _parse_finite(self.final_train_loss),
            "best_train_loss": _parse_finite(self.best_train_loss),
            "final_val_loss": _parse_finite(self.final_val_loss),
            "last_finite_loss": _parse_finite(self.last_finite_loss),
            "last_finite_step": self.last_finite_step,
            "source": self.source,
            "summary_status": self.summary_status,
            "live": self.live,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class LogFormat:
    """How to read a text log: `pattern` matches a training line (named groups step and loss; optional
    grad_norm, val_loss, nan_iters, skipped_iters) and optional extra patterns match other line kinds
    (e.g. evaluation lines with step and val_loss). A line is tried against each pattern in order; the
    first that matches wins. A training line whose loss group did not match has lost its loss.
    `summary` (groups key and value) reads a final status block such as `fp4lab train` prints."""

    name: str
    pattern: re.Pattern
    extra: tuple[re.Pattern, ...] = ()
    summary: re.Pattern | None = None

    @classmethod
    def from_regex(cls, regex: str | re.Pattern, name: str = "regex") -> LogFormat:
        try:
            pattern = re.compile(regex) if isinstance(regex, str) else regex
        except re.error as error:
            raise ValueError(f"bad log regex {regex!r}: {error}") from None
        missing = {"step", "loss"} - set(pattern.groupindex)
        if missing:
            raise ValueError(f"log regex {pattern.pattern!r} needs named groups (?P<step>...) and (?P<loss>...); missing: {', '.join(sorted(missing))}")
        return cls(name, pattern)

    def patterns(self) -> tuple[re.Pattern, ...]:
        return (self.pattern, *self.extra)


PRESETS: dict[str, LogFormat] = {
    # karpathy/nanoGPT train.py: print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
    # and the eval line print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    "nanogpt": LogFormat(
        "nanogpt",
        re.compile(rf"\biter (?P<step>\d+): loss (?P<loss>{NUM})", re.IGNORECASE),
        (re.compile(rf"\bstep (?P<step>\d+): train loss {NUM}, val loss (?P<val_loss>{NUM})", re.IGNORECASE),),
    ),
    # NVIDIA/Megatron-LM training_log: ' iteration {:8d}/{:8d} |' ... ' lm loss: {:.6E} |' ... ' grad norm: {:.3f} |'
    # ... ' number of nan iterations: {:3d} |'; evaluate_and_print_results: 'validation loss at iteration N | lm loss value: ...'
    "megatron": LogFormat(
        "megatron",
        re.compile(
            rf"\biteration\s+(?P<step>\d+)\s*/\s*\d+\s*\|"
            rf"(?:.*?\blm loss:\s*(?P<loss>{NUM}))?"
            rf"(?:.*?\bgrad norm:\s*(?P<grad_norm>{NUM}))?"
            rf"(?:.*?\bnumber of skipped iterations:\s*(?P<skipped_iters>\d+))?"
            rf"(?:.*?\bnumber of nan iterations:\s*(?P<nan_iters>\d+))?",
            re.IGNORECASE,
        ),
        (re.compile(rf"\bvalidation loss at iteration (?P<step>\d+)\b.*?\blm loss value:\s*(?P<val_loss>{NUM})", re.IGNORECASE),),
    ),
    # pytorch/torchtitan MetricsProcessor.log, every field behind an ANSI colour code:
    # f"{color.red}step: {step:2}  {color.green}loss: {loss:7.4f}  {color.orange}grad_norm: {grad_norm:7.4f}  ..."
    # and log_validation: f"{color.yellow}validate step: {step:2}  {color.green}loss: {loss:7.4f}  ..."
    "torchtitan": LogFormat(
        "torchtitan",
        re.compile(rf"(?<!validate )\bstep:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>{NUM})(?:\s+grad_norm:\s*(?P<grad_norm>{NUM}))?"),
        (re.compile(rf"\bvalidate step:\s*(?P<step>\d+)\s+loss:\s*(?P<val_loss>{NUM})"),),
    ),
    # fp4lab's own `fp4lab train` output (the local worker log jobs/<sweep>/logs/<id>.local.log): progress
    # lines f"step {step}/{steps} loss {loss:.4f}[ val_loss {val:.4f}] lr ... tok/s ..." (step counted from
    # 1; a NaN step is not printed), then after "---" the summary block "status: diverged",
    # "diverged_step: 57", ... A resumed run appends to the same log, so the last block counts.
    "fp4lab": LogFormat(
        "fp4lab",
        re.compile(rf"\bstep (?P<step>\d+)/\d+ loss (?P<loss>{NUM})(?: val_loss (?P<val_loss>{NUM}))?"),
        summary=re.compile(r"^(?P<key>status|diverged_step|steps_completed): (?P<value>\S+)\s*$"),
    ),
}


# --- the scan --------------------------------------------------------------------------------------


def scan(
    path: str | os.PathLike,
    thresholds: ScanThresholds | None = None,
    *,
    regex: str | re.Pattern | None = None,
    preset: str | None = None,
    running: bool | None = None,
    now: float | None = None,
) -> ScanResult:
    """Scan a run folder (its metrics.jsonl and summary.json), a metrics.jsonl, or a text log.

    thresholds: `ScanThresholds()` when None. regex / preset: how to read a text log (regex wins;
    neither: the preset matching the most lines). running: what the scheduler knows (True: the job is
    alive; False: it is not; None: judge by the log's mtime against `now`, default time.time()).
    """
    th = thresholds or ScanThresholds()
    target = Path(path)
    log, kind, summary = _locate_log(target, regex, preset)

    counts = {"lines": 0, "skipped_lines": 0, "steps": 0}
    text = _TextState()
    if kind == "fp4lab":
        records = read_metrics_file(log, counts)
        source = "fp4lab"
    else:
        fmt = _text_format(log, regex, preset)
        records = _read_text(log, fmt, counts, text) if fmt is not None else _markers_only(log, counts, text)
        source = fmt.name if fmt is not None else "unknown"

    detector = _Detector(th)
    for record in records:
        detector.feed(record)
    detector.finish()
    counts["steps"] = detector.steps
    if kind == "text":
        summary = text.summary or None  # known only once the log has been read

    now = time.time() if now is None else now
    age = now - log.stat().st_mtime
    status = summary.get("status") if summary else None
    if kind == "fp4lab" and summary and status in STOPPED_STATUSES:
        completed = summary.get("steps_completed")
        if isinstance(completed, int) and detector.last_step is not None and detector.last_step + 1 > completed:
            summary, status = None, None  # stale: written by an earlier segment of a resumed run
    finished = status in TERMINAL_STATUSES
    live = running is True or (running is None and not finished and age <= th.stall_seconds)
    hung = running is True and not finished and age > th.stall_seconds

    if not finished and age > th.stall_seconds and (running is True or (kind == "fp4lab" and running is None)):
        step = detector.last_step if detector.last_step is not None else 0
        detector.events.append(ScanEvent("stalled", step, age, th.stall_seconds, f"log last written {age:.0f} s ago (> {th.stall_seconds:.0f} s)"))
        detector.flagged["stalled"] = 1

    first_step: dict[str, int] = {}
    for event in detector.events:
        first_step[event.kind] = min(first_step.get(event.kind, event.step), event.step)
    evidence = _Evidence(kind=kind, source=source, summary=summary, status=status, detector=detector, text=text, counts=counts,
                         first_step=first_step, running=running, age=age, finished=finished, live=live, hung=hung)  # fmt: skip
    return _result(target, evidence, *_verdict(evidence, th))


def _locate_log(target: Path, regex, preset: str | None) -> tuple[Path, str, dict[str, Any] | None]:
    """(the log to read, its kind: "fp4lab" for a metrics.jsonl or "text", the summary.json beside a
    metrics.jsonl); FileNotFoundError for a missing path or a folder that is no fp4lab run folder."""
    if not target.exists():
        raise FileNotFoundError(f"no such run folder or log: {target}")
    if target.is_dir():
        log = target / "metrics.jsonl"
        if not log.exists():
            raise FileNotFoundError(f"{target} is a folder without metrics.jsonl (not an fp4lab run folder)")
        return log, "fp4lab", _read_summary(target / "summary.json")
    if regex is None and preset is None and _looks_like_jsonl(target):
        return target, "fp4lab", _read_summary(target.parent / "summary.json")
    return target, "text", None


@dataclass
class _Evidence:
    """What the verdict rules read, gathered by `scan`: the log, its summary, what the detector found,
    and how long ago the log was written set against what is known of the job."""

    kind: str  # "fp4lab" (a metrics.jsonl) or "text"
    source: str  # as ScanResult.source
    summary: dict[str, Any] | None  # summary.json or a text log's summary block; None when absent or stale
    status: str | None  # the summary's status
    detector: _Detector
    text: _TextState
    counts: dict[str, int]
    first_step: dict[str, int]  # event kind -> the first step of that kind
    running: bool | None  # as scan's argument
    age: float  # seconds since the log was last written
    finished: bool  # the summary's status is terminal
    live: bool  # the job is alive (running=True, or an unfinished log written within stall_seconds)
    hung: bool  # running=True, unfinished, and the log idle past stall_seconds


def _verdict(evidence: _Evidence, th: ScanThresholds) -> tuple[str, int | None, str]:
    """(verdict, its step, why in words), by precedence: alarms first, so a live job with a problem is
    never "running"; then how the job ended; then whether it is still going."""
    first_step, status, summary = evidence.first_step, evidence.status, evidence.summary
    detector, text, running, age = evidence.detector, evidence.text, evidence.running, evidence.age
    still = " (the job is still running)" if evidence.live else ""
    if "nan" in first_step or "loss_above_start" in first_step or status == "diverged":
        step = summary.get("diverged_step") if status == "diverged" and isinstance(summary.get("diverged_step"), int) else None
        if step is None:
            step = first_step.get("nan", first_step.get("loss_above_start", detector.last_step))
        if status == "diverged":
            return "diverged", step, "summary status diverged" + still
        if "nan" in first_step:
            return "diverged", step, f"non-finite value at step {first_step['nan']}" + still
        return "diverged", step, f"the loss has stayed above {th.diverge_ratio:g} x its first value since step {first_step['loss_above_start']}" + still
    if "entropy_collapse" in first_step:
        step = first_step["entropy_collapse"]
        return "entropy_collapse", step, f"attention entropy collapsed at step {step}{still}"
    if "loss_missing" in first_step:
        step = first_step["loss_missing"]
        return "loss_vanished", step, (
            f"training lines from step {step} carry no loss and no nan/skipped iteration count (Megatron "
            f"leaves a NaN 'lm loss' out of its line); last finite loss at step {detector.last_finite_step}{still}"
        )
    if text.crash is not None and text.timeout is None:
        return "crashed", None, f"crash marker in log: {text.crash!r}"
    if running is not True and (status in STOPPED_STATUSES or text.timeout is not None):
        ran_out = status in TIME_LIMIT_STATUSES if status else "TIME LIMIT" in text.timeout
        return "timeout" if ran_out else "interrupted", None, f"summary status {status}" if status else f"marker in log: {text.timeout}"
    if evidence.kind == "fp4lab" and not evidence.finished and not evidence.live:
        return "crashed", None, "no summary.json" + (" and running=False" if running is False else f" and log idle {age:.0f} s")
    if not detector.losses_seen:
        return "no_loss", None, _no_loss_reason(evidence.counts, evidence.source, evidence.live)
    if any(k in first_step for k in th.unstable_kinds):
        return "unstable", None, "events: " + ", ".join(k for k in th.unstable_kinds if k in first_step) + still
    if evidence.hung:
        return "stalled", None, f"running=True but the log was last written {age:.0f} s ago (> stall_seconds {th.stall_seconds:g}): hung?"
    if evidence.live:
        return "running", None, "running=True" if running is True else f"not finished and log written {age:.0f} s ago"
    return "converged", None, f"summary status {status}" if status else "finished without anomalies"


def _result(target: Path, evidence: _Evidence, verdict: str, verdict_step: int | None, reason: str) -> ScanResult:
    """The ScanResult of a verdict: the detector's losses, or the summary's where the metrics were lost."""
    detector, summary, counts = evidence.detector, evidence.summary, evidence.counts
    for kind_name in EVENT_KINDS:
        counts[kind_name] = detector.flagged.get(kind_name, 0)
    final_loss, best_loss, final_val = detector.final_loss, detector.best_loss, detector.final_val_loss
    if evidence.kind == "fp4lab" and summary:  # a folder whose metrics were lost still has its summary
        final_loss = final_loss if detector.steps else summary_value(summary, "final_train_loss")
        best_loss = best_loss if best_loss is not None else _parse_finite(summary_value(summary, "best_train_loss"))
        final_val = final_val if final_val is not None else _parse_finite(summary.get("final_val_loss"))
    last_step = detector.last_step
    if last_step is None and summary and isinstance(summary.get("steps_completed"), int) and summary["steps_completed"] > 0:
        last_step = summary["steps_completed"] - 1
    return ScanResult(
        path=str(target),
        verdict=f"{verdict}@{verdict_step}" if verdict in ("diverged", "entropy_collapse", "loss_vanished") else verdict,
        status=verdict,
        verdict_step=verdict_step,
        events=sorted(detector.events, key=lambda e: (e.step, EVENT_KINDS.index(e.kind))),
        first_step=evidence.first_step,
        counts=counts,
        last_step=last_step,
        final_train_loss=_parse_finite(final_loss),
        best_train_loss=_parse_finite(best_loss),
        final_val_loss=_parse_finite(final_val),
        last_finite_loss=detector.last_finite_loss,
        last_finite_step=detector.last_finite_step,
        source=evidence.source,
        summary_status=evidence.status,
        live=evidence.live,
        reasons=[reason],
    )


def _no_loss_reason(counts: dict[str, int], source: str, live: bool) -> str:
    if not counts["lines"]:
        where = "the log is empty"
    elif source == "unknown":
        where = f"no line of {counts['lines']} matches a known log format ({', '.join(PRESETS)}); name a preset or give a regex"
    else:
        where = f"no loss value parsed from {counts['lines']} line(s) read as {source}; check the preset or regex"
    return where + ("; if the job just started, scan again after its first log interval" if live else "")


def result_fields(result: ScanResult) -> dict[str, str]:
    """A scan result as a person reads it, field by field (format_result's line, `fp4lab scan`'s table):
    verdict (and "live" while the job runs), step, loss (a diverged run: its last finite loss and the step
    it diverged at), val, and notes (events, skipped lines, why no loss was found)."""
    fields = {"verdict": result.verdict + (" (live)" if result.live and result.status != "running" else ""),
              "step": "" if result.last_step is None else str(result.last_step), "loss": "", "val": "", "notes": ""}
    if result.status in ("diverged", "loss_vanished"):
        what = "diverged" if result.status == "diverged" else "loss missing from"
        if result.last_finite_loss is not None:
            fields["loss"] = f"last finite loss {result.last_finite_loss:.4f} at step {result.last_finite_step}, {what} step {result.verdict_step}"
        else:
            fields["loss"] = f"no finite loss; {what} step {result.verdict_step}"
    elif result.final_train_loss is not None:
        best = f" (best {result.best_train_loss:.4f})" if result.best_train_loss is not None and result.best_train_loss != result.final_train_loss else ""
        fields["loss"] = f"{result.final_train_loss:.4f}{best}"
    elif result.best_train_loss is not None:
        fields["loss"] = f"best {result.best_train_loss:.4f}"
    if result.final_val_loss is not None:
        fields["val"] = f"{result.final_val_loss:.4f}"
    notes = []
    if result.events:
        summary = []
        for kind in EVENT_KINDS:
            if kind in result.first_step:
                n = sum(1 for e in result.events if e.kind == kind)
                summary.append(f"{kind}@{result.first_step[kind]}" + (f" x{n}" if n > 1 else ""))
        notes.append("events: " + ", ".join(summary))
    else:
        notes.append("no events")
    if result.status == "no_loss":
        notes.append(result.reasons[0])
    if result.counts.get("skipped_lines"):
        notes.append(f"{result.counts['skipped_lines']} bad lines skipped")
    fields["notes"] = "; ".join(notes)
    return fields


def format_result(result: ScanResult) -> str:
    """One line for a human: path, verdict, progress, losses, events, skipped lines (result_fields)."""
    fields = result_fields(result)
    parts = [f"{result.path}: {fields['verdict']}"]
    if fields["step"]:
        parts.append(f"step {fields['step']}")
    loss = fields["loss"]
    if loss:
        parts.append(f"best loss {loss[5:]}" if loss.startswith("best ") else loss if loss.startswith(("last finite", "no finite")) else f"loss {loss}")
    if fields["val"]:
        parts.append(f"val {fields['val']}")
    parts += fields["notes"].split("; ")
    return " | ".join(parts)


# --- readers ---------------------------------------------------------------------------------------


def _read_summary(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # fp4lab writes it atomically; anything else is treated as absent
    return value if isinstance(value, dict) else None


def _looks_like_jsonl(path: Path) -> bool:
    if path.suffix == ".jsonl":
        return True
    with open(path, errors="replace") as handle:
        for line in handle:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _lines(path: Path) -> Iterator[str]:
    with open(path, errors="replace") as handle:
        yield from handle


@dataclass
class _TextState:
    """What a text log says besides its metrics: the first crash and timeout marker lines, and the
    last summary block (cleared when training lines follow it: a resumed segment is under way)."""

    crash: str | None = None
    timeout: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def note_markers(self, line: str) -> None:
        if self.crash is None and CRASH_MARKERS.search(line):
            self.crash = line.strip()[:200]
        if self.timeout is None and TIMEOUT_MARKERS.search(line):
            self.timeout = line.strip()[:200]


def _text_format(path: Path, regex, preset: str | None) -> LogFormat | None:
    """The format to read a text log with; None when no preset matches a line (nothing to read)."""
    if regex is not None:
        return LogFormat.from_regex(regex)
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown log preset {preset!r}; choose from {', '.join(PRESETS)} or pass a regex")
        return PRESETS[preset]
    hits = dict.fromkeys(PRESETS, 0)
    for n, line in enumerate(_lines(path)):
        line = ANSI_CODES.sub("", line)
        for name, fmt in PRESETS.items():
            if fmt.pattern.search(line):
                hits[name] += 1
        if n > 20000:
            break
    best = max(hits, key=hits.get)
    return PRESETS[best] if hits[best] else None


def _markers_only(path: Path, counts: dict[str, int], state: _TextState) -> list[dict[str, Any]]:
    for line in _lines(path):
        counts["lines"] += 1
        state.note_markers(line)
    return []


def _read_text(path: Path, fmt: LogFormat, counts: dict[str, int], state: _TextState) -> Iterator[dict[str, Any]]:
    for line in _lines(path):
        counts["lines"] += 1
        line = ANSI_CODES.sub("", line)
        state.note_markers(line)
        if fmt.summary is not None and (m := fmt.summary.search(line)):
            if m["key"] == "status":
                state.summary = {}
            value = m["value"]
            state.summary[m["key"]] = int(value) if value.isdigit() else None if value == "None" else value
            continue
        for pattern in fmt.patterns():
            m = pattern.search(line)
            if not m:
                continue
            groups = m.groupdict()
            training = pattern is fmt.pattern
            if training and groups.get("loss") is None and not line.endswith("\n"):
                counts["skipped_lines"] += 1  # the live log's half-written last line, not a lost loss
                break
            try:
                record: dict[str, Any] = {"step": int(groups["step"]), "training": training}
                for name in ("loss", "grad_norm", "val_loss"):
                    if groups.get(name) is not None:
                        record[name] = float(groups[name])
                for name in ("nan_iters", "skipped_iters"):
                    if groups.get(name) is not None:
                        record[name] = int(groups[name])
            except (TypeError, ValueError, KeyError):
                counts["skipped_lines"] += 1
                break
            if training:
                state.summary = {}  # training after a summary block: a resumed segment
            yield record
            break


# --- detection -------------------------------------------------------------------------------------


def _parse_float(value: Any) -> float | None:
    """A float from a JSON value (NaN/Infinity tokens arrive as floats; "nan" strings are accepted)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


class _Window:
    """The last `size` values with a running sum and sum of squares (recomputed exactly every `size`
    pushes, so rounding never drifts): mean and std in O(1) per step."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)
        self.total = 0.0
        self.squares = 0.0
        self.pushes = 0

    def __len__(self) -> int:
        return len(self.values)

    def append(self, x: float) -> None:
        if len(self.values) == self.values.maxlen:
            old = self.values[0]
            self.total -= old
            self.squares -= old * old
        self.values.append(x)
        self.total += x
        self.squares += x * x
        self.pushes += 1
        if self.pushes % self.values.maxlen == 0:
            self.total = math.fsum(self.values)
            self.squares = math.fsum(v * v for v in self.values)

    def mean_std(self) -> tuple[float, float]:
        n = len(self.values)
        mean = self.total / n
        # E[x^2] - mean^2 loses digits when std << mean: then sum the squared deviations exactly
        var = max(0.0, self.squares / n - mean * mean)
        if var < 1e-6 * mean * mean:  # cancellation may dominate: compute it exactly
            var = math.fsum((v - mean) ** 2 for v in self.values) / n
        return mean, math.sqrt(var)


class _Detector:
    """Feeds records in log order; keeps the trailing windows and merges flagged steps into episodes."""

    def __init__(self, th: ScanThresholds):
        self.th = th
        self.events: list[ScanEvent] = []
        self.flagged: dict[str, int] = {}
        self.steps = 0
        self.last_step: int | None = None
        self.final_loss: float | None = None
        self.best_loss: float | None = None
        self.final_val_loss: float | None = None
        self.losses_seen = 0  # training records with a loss value, finite or not
        self.last_finite_loss: float | None = None
        self.last_finite_step: int | None = None
        self.losses = _Window(th.spike_window)
        self.recent_losses: deque[float] = deque(maxlen=th.spike_ratio_baseline)
        self.grads = _Window(th.spike_window)
        self.entropy: dict[int, list[float]] = {}
        self.open: dict[str, ScanEvent] = {}  # kind (or kind/layer) -> the episode still running
        self.best_history: deque[tuple[int, float]] = deque()
        self.stall_reported = False
        self.previous_training_step: int | None = None
        self.first_loss: float | None = None
        self.above_start: ScanEvent | None = None  # the streak of losses above the start, while unbroken
        self.last_median: float | None = None

    def _restart_baselines(self) -> None:
        """A training step at or below the last one starts another run (or a restart from an earlier
        checkpoint) in the same log: its first losses are judged against its own history, not the
        previous run's low final losses."""
        self.losses = _Window(self.th.spike_window)
        self.recent_losses.clear()
        self.grads = _Window(self.th.spike_window)
        self.best_history.clear()
        self.open.pop("loss_spike", None)
        self.open.pop("grad_spike", None)

    def _flag(self, key: str, kind: str, step: int, value: float, threshold: float | None, detail: str, worse) -> None:
        self.flagged[kind] = self.flagged.get(kind, 0) + 1
        event = self.open.get(key)
        if event is not None:
            event.steps += 1
            if event.peak is None or worse(value, event.peak):
                event.peak = value
            return
        event = ScanEvent(kind, step, value, threshold, detail, 1, value)
        self.events.append(event)
        self.open[key] = event

    def _clear(self, key: str) -> None:
        self.open.pop(key, None)

    def feed(self, record: dict[str, Any]) -> None:
        th = self.th
        step = record["step"]
        training = record.get("training", True)  # evaluation lines of text logs are not steps
        self.steps += training
        if training:
            if self.previous_training_step is not None and step <= self.previous_training_step:
                self._restart_baselines()
            self.previous_training_step = step
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        loss = _parse_float(record.get("loss"))
        grad = _parse_float(record.get("grad_norm"))
        val = _parse_float(record.get("val_loss"))

        nan_iters = record.get("nan_iters") or 0
        if training and loss is None and self.losses_seen and not nan_iters and not record.get("skipped_iters"):
            # Skipped iterations (fp16 loss-scale overflows) legitimately leave no loss to average.
            self._flag("loss_missing", "loss_missing", step, math.nan, None,
                       f"training line without a loss after {self.losses_seen} with one", lambda a, b: False)
        else:
            self._clear("loss_missing")
        bad = []
        for name, v in (("loss", loss), ("grad_norm", grad), ("val_loss", val)):
            if v is not None and (v - v != 0):  # NaN or +-Inf
                bad.append((name, v))
        if bad or nan_iters:
            name, value = bad[0] if bad else ("loss", math.nan)
            detail = f"{name} = {value}" if bad else f"{nan_iters} nan iteration(s) reported"
            self._flag("nan", "nan", step, value, None, detail, lambda a, b: False)
        else:
            self._clear("nan")

        if training:
            self.final_loss = loss
        if loss is not None:
            self.losses_seen += 1
        if loss is not None and math.isfinite(loss):
            self.last_finite_loss, self.last_finite_step = loss, step
            self._spike("loss_spike", self.losses, step, loss, th.spike_sigma, th.spike_ratio)
            self.losses.append(loss)
            self.recent_losses.append(loss)
            self._runaway(step)
            self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
            self._plateau(step)
        if grad is not None and math.isfinite(grad) and th.grad_spike_sigma is not None:
            self._spike("grad_spike", self.grads, step, grad, th.grad_spike_sigma, None)
            self.grads.append(grad)
        if val is not None:
            self.final_val_loss = val
        self._probes(step, record)

    def _spike(self, kind: str, window: _Window, step: int, x: float, k: float, ratio: float | None) -> None:
        reasons = []
        if len(window) >= self.th.spike_min_count:
            mean, std = window.mean_std()
            if std >= 1e-10 and x > mean + k * std:
                reasons.append((mean + k * std, f"{x:.4g} > mean {mean:.4g} + {k:g} x std {std:.3g} of last {len(window)}"))
        # The ratio rule needs only a handful of points, so sparse logs (one line per 100 iterations)
        # are checked from their first lines; a median of the most recent ones follows a falling curve.
        recent = self.recent_losses
        if ratio is not None and len(recent) >= self.th.spike_ratio_min_count:
            median = statistics.median(recent)
            if x > ratio * median:
                reasons.append((ratio * median, f"{x:.4g} > {ratio:g} x median {median:.4g} of the last {len(recent)} losses"))
        if reasons:
            threshold, detail = min(reasons, key=lambda r: r[0])
            self._flag(kind, kind, step, x, threshold, detail, lambda a, b: a > b)
        else:
            self._clear(kind)

    def _runaway(self, step: int) -> None:
        """Keep the current streak of steps whose recent median loss is above diverge_ratio x the first
        loss; `finish` reports it if the log ends inside it."""
        if self.first_loss is None:
            self.first_loss = self.recent_losses[-1]
        ratio = self.th.diverge_ratio
        median = statistics.median(self.recent_losses)
        if ratio is None or self.first_loss <= 0 or median <= ratio * self.first_loss:
            self.above_start = None
            return
        if self.above_start is None:
            limit = ratio * self.first_loss
            self.above_start = ScanEvent("loss_above_start", step, median, limit,
                                         f"median of the last losses above {ratio:g} x the first loss {self.first_loss:.4g}", 0, median)
        self.above_start.steps += 1
        self.above_start.peak = max(self.above_start.peak, median)
        self.last_median = median

    def _plateau(self, step: int) -> None:
        m = self.th.stall_steps
        if m is None or self.stall_reported:
            return
        self.best_history.append((step, self.best_loss))
        while self.best_history and self.best_history[0][0] <= step - m:
            before = self.best_history.popleft()
            if step - before[0] >= m and before[1] - self.best_loss <= self.th.stall_min_delta:
                self.events.append(
                    ScanEvent("stalled", step, self.best_loss, self.th.stall_min_delta,
                              f"best loss {self.best_loss:.4g} improved by {before[1] - self.best_loss:.3g} <= {self.th.stall_min_delta:g} over {step - before[0]} steps (since step {before[0]})")
                )
                self.flagged["stalled"] = self.flagged.get("stalled", 0) + 1
                self.stall_reported = True
                return

    def _probes(self, step: int, record: dict[str, Any]) -> None:
        th = self.th
        layers = record.get("attn_entropy_mean")
        if not isinstance(layers, list) and isinstance(record.get("attn_entropy"), list):
            layers = [_mean_of_parsed(h) if isinstance(h, list) else h for h in record["attn_entropy"]]
        if isinstance(layers, list):
            for layer, raw in enumerate(layers):
                value = _parse_float(raw)
                if value is None or not math.isfinite(value):
                    continue
                history = self.entropy.setdefault(layer, [])
                key = f"entropy_collapse/{layer}"
                floor = th.entropy_floor
                median = statistics.median(history) if len(history) >= th.entropy_min_probes else None
                if value < floor:
                    self._flag(key, "entropy_collapse", step, value, floor, f"layer {layer}: mean entropy {value:.4g} < floor {floor:g} nats", lambda a, b: a < b)
                elif median is not None and th.entropy_drop_factor is not None and value < th.entropy_drop_factor * median:
                    limit = th.entropy_drop_factor * median
                    self._flag(key, "entropy_collapse", step, value, limit, f"layer {layer}: mean entropy {value:.4g} < {th.entropy_drop_factor:g} x median {median:.4g} of its earlier probes", lambda a, b: a < b)
                else:
                    self._clear(key)
                history.append(value)

        heads = record.get("max_logit")
        peak, where, above = None, "", 0
        if isinstance(heads, list):
            for layer, row in enumerate(heads):
                for head, raw in enumerate(row if isinstance(row, list) else [row]):
                    value = _parse_float(raw)
                    if value is None or math.isnan(value):
                        continue
                    if value > th.max_logit_tau:
                        above += 1
                    if peak is None or value > peak:
                        peak, where = value, f"layer {layer} head {head}"
        elif _parse_float(record.get("max_logit_max")) is not None:
            peak = _parse_float(record["max_logit_max"])
            above = int(peak > th.max_logit_tau)
        if peak is None:
            return
        if peak > th.max_logit_tau:
            self._flag("max_logit", "max_logit", step, peak, th.max_logit_tau, f"max logit {peak:.4g} > tau {th.max_logit_tau:g}" + (f" at {where}; {above} head(s) above tau" if where else ""), lambda a, b: a > b)
        else:
            self._clear("max_logit")

    def finish(self) -> None:
        self.open.clear()
        streak = self.above_start
        if streak is not None:
            streak.detail = f"median loss {self.last_median:.4g} at the end, above {self.th.diverge_ratio:g} x the first loss {self.first_loss:.4g} since step {streak.step} ({streak.steps} steps)"
            self.events.append(streak)
            self.flagged["loss_above_start"] = streak.steps


def _mean_of_parsed(values: list) -> float | None:
    """The mean of the values that parse as floats (`_parse_float`), None where none does."""
    nums = [v for v in (_parse_float(x) for x in values) if v is not None]
    return sum(nums) / len(nums) if nums else None


def _parse_finite(value: Any) -> float | None:
    """`_parse_float` where the result is finite, else None."""
    v = _parse_float(value)
    return v if v is not None and math.isfinite(v) else None


def _json_float(value: float | None) -> float | str | None:
    if value is None:
        return None
    return value if math.isfinite(value) else str(value)
