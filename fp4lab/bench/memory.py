"""What holds a CUDA step's peak memory: the caching allocator's trace replayed to its highest point.

`recorded(device, path)` wraps the build, warm-up and timed steps of one configuration in
`torch.cuda.memory._record_memory_history` (Python stacks, so every block knows the line that asked for
it). `peak_holders(snapshot, ...)` replays the trace of `torch.cuda.memory._snapshot()`: allocated
bytes go up at each "alloc" and down at each "free_completed" (the allocator's own accounting), and
at the maximum the live blocks are grouped by the fp4lab line that allocated them (the innermost stack
frame inside fp4lab, e.g. a layer's saved operands, the optimizer's state, the step that runs the
compiled graph) and by the innermost frame of all (an inductor kernel's output buffer, autograd's
gradient accumulation). Blocks a CUDA graph allocated while it was captured stay allocated for its
replays, so they are in the replay's live set like any other block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# Events kept by the allocator's ring buffer: a 350m graphed step's build, warm-up and capture takes
# some 10^5; a truncated trace is reported (its earliest blocks are then missing from the peak).
MAX_TRACE_EVENTS = 2_000_000
_PACKAGE_MARK = "/fp4lab/"


@dataclass(frozen=True)
class PeakHolders:
    """The traced peak: bytes live then (beyond those allocated before recording began), grouped."""

    peak_bytes: int
    before_bytes: int  # allocated when recording began (not in the trace)
    by_fp4lab_line: list[tuple[str, int]]  # (site, bytes), largest first
    by_innermost_frame: list[tuple[str, int]]
    events: int
    truncated: bool

    def table(self, top: int = 15) -> str:
        mib = 2**20
        lines = [
            f"traced peak {self.peak_bytes / mib:,.0f} MiB (+ {self.before_bytes / mib:,.0f} MiB allocated before recording), "
            f"{self.events:,} allocator events{' (TRUNCATED: the earliest are missing)' if self.truncated else ''}",
        ]
        for title, groups in (("by the fp4lab line that allocated it", self.by_fp4lab_line),
                              ("by the innermost frame", self.by_innermost_frame)):
            lines.append(f"\nlive at the peak, {title}:")
            lines.extend(f"{size / mib:10,.1f} MiB  {site}" for site, size in groups[:top])
            rest = sum(size for _, size in groups[top:])
            if rest:
                lines.append(f"{rest / mib:10,.1f} MiB  ({len(groups) - top} more sites)")
        return "\n".join(lines) + "\n"


@contextlib.contextmanager
def recorded(device: torch.device, path: Path) -> Iterator[None]:
    """Record the allocator's history on `device` through the block, then write what held its peak to
    `path` (`PeakHolders.table`). Recording stops however the block ends."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=MAX_TRACE_EVENTS, stacks="python", device=device)
    try:
        yield
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(peak_holders(snapshot["device_traces"][index], before).table())


def peak_holders(trace: list[dict], before_bytes: int = 0) -> PeakHolders:
    """Replay one device's trace (`_snapshot()["device_traces"][i]`) to its highest allocated point."""
    peak, peak_at = 0, 0
    for i, total in enumerate(_allocated_after_each(trace, {})):
        if total > peak:
            peak, peak_at = total, i + 1
    at_peak: dict[int, dict] = {}  # the second pass stops at the peak: one copy of the live set, not one per new high
    for _ in _allocated_after_each(trace[:peak_at], at_peak):
        pass
    by_line: dict[str, int] = {}
    by_frame: dict[str, int] = {}
    for event in at_peak.values():
        size, (line, frame) = event["size"], _sites(event.get("frames", []))
        by_line[line] = by_line.get(line, 0) + size
        by_frame[frame] = by_frame.get(frame, 0) + size
    largest = lambda groups: sorted(groups.items(), key=lambda item: (-item[1], item[0]))
    return PeakHolders(peak, before_bytes, largest(by_line), largest(by_frame), len(trace), len(trace) >= MAX_TRACE_EVENTS)


def _allocated_after_each(trace: list[dict], live: dict[int, dict]) -> Iterator[int]:
    """The traced bytes allocated after each event; `live` (addr -> its alloc event) follows along."""
    total = 0
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:  # a block from before the trace: not counted
            total -= live.pop(event["addr"])["size"]
        yield total


def _sites(frames: list[dict]) -> tuple[str, str]:
    """(the innermost fp4lab frame, the innermost frame), each as 'path:line name' from the package or
    site-packages root on. Frames run innermost first."""
    named = [f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in frames]
    inside = [n for f, n in zip(frames, named) if _PACKAGE_MARK in f["filename"]]
    return (inside[0] if inside else "(outside fp4lab)"), (named[0] if named else "(no stack)")


def _short(filename: str) -> str:
    for mark in (_PACKAGE_MARK, "/site-packages/", "/dist-packages/"):
        if mark in filename:
            return filename[filename.rindex(mark) + 1 :].removeprefix("site-packages/").removeprefix("dist-packages/")
    return filename
