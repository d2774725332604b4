"""The kernel ratchet's proposer (`fp4lab ratchet sweeps/attention_tiles.md --agent command --command
"python3 scripts/propose_attention_tiles.py"`): a coordinate search over the launch configuration of the
fused-probe attention kernel at head dim 64, one change per proposal.

It reads the ratchet's context (JSON on stdin: the editable files at the branch head, the history)
and answers a unified diff that moves one of the eight entries of `_GPU_TILES[64]` (forward BLOCK_M,
BLOCK_N, dK/dV BLOCK_M, BLOCK_N, dQ BLOCK_M, BLOCK_N, warps, stages) one step from the kept
configuration, keeping the kernel's constraints (each forward and dQ BLOCK_M a multiple of its BLOCK_N,
each dK/dV BLOCK_N a multiple of its BLOCK_M). A configuration named in an earlier rationale is not
proposed again. Exit 1 when every neighbour was tried (the search has converged).
"""

from __future__ import annotations

import difflib
import json
import re
import sys

PATH = "fp4lab/numerics/kernels/attention.py"
ROW = re.compile(r"^(    64: \()([0-9, ]+)(\),)$", re.M)
CHOICES = ((16, 32, 64, 128),) * 6 + ((2, 4, 8), (1, 2, 3, 4))
NAMES = ("forward BLOCK_M", "forward BLOCK_N", "dK/dV BLOCK_M", "dK/dV BLOCK_N", "dQ BLOCK_M", "dQ BLOCK_N", "warps", "stages")


def valid(tiles: tuple[int, ...]) -> bool:
    fwd_m, fwd_n, kv_m, kv_n, dq_m, dq_n = tiles[:6]
    return fwd_m % fwd_n == 0 and dq_m % dq_n == 0 and kv_n % kv_m == 0


def neighbours(tiles: tuple[int, ...]):
    """(name, configuration): each entry one step down, then up, in the order of NAMES."""
    for i, choices in enumerate(CHOICES):
        at = choices.index(tiles[i]) if tiles[i] in choices else None
        for j in ((at - 1, at + 1) if at is not None else ()):
            if 0 <= j < len(choices):
                moved = tiles[:i] + (choices[j],) + tiles[i + 1:]
                if valid(moved):
                    yield NAMES[i], moved


def main() -> int:
    context = json.load(sys.stdin)
    text = context["files"].get(PATH)
    if text is None:
        print(f"propose_attention_tiles: {PATH} is not among the editable files; set [edit].files to it", file=sys.stderr)
        return 2
    match = ROW.search(text)
    if match is None:
        print(f"propose_attention_tiles: no `    64: (...),` row of _GPU_TILES in {PATH}", file=sys.stderr)
        return 2
    current = tuple(int(v) for v in match.group(2).split(","))
    tried = {tuple(int(v) for v in found.split(","))
             for row in context.get("history", []) for found in re.findall(r"\(([0-9, ]+)\)", row.get("rationale") or "")}
    for name, moved in neighbours(current):
        if moved in tried:
            continue
        new = text[:match.start(2)] + ", ".join(map(str, moved)) + text[match.end(2):]
        diff = "".join(difflib.unified_diff(text.splitlines(True), new.splitlines(True), f"a/{PATH}", f"b/{PATH}"))
        at = NAMES.index(name)
        # both configurations in parentheses: a later proposal reads them as tried (the first one measured
        # is the baseline, named in no other rationale)
        rationale = f"head dim 64: {name} {current[at]} -> {moved[at]}: ({', '.join(map(str, current))}) -> ({', '.join(map(str, moved))})"
        print(json.dumps({"diff": diff, "rationale": rationale}))
        return 0
    print(f"propose_attention_tiles: every neighbour of ({', '.join(map(str, current))}) was tried", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
