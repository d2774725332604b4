"""The kernel ratchet's parts (sweeps/attention_tiles.md): the proposer moves one launch parameter of the
fused-probe attention's head-dim-64 row one step, within the kernel's constraints, never twice to a
configuration already measured, and its diff passes the ratchet's own validation against this tree;
the metric script refuses to measure without CUDA."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from fp4lab.lab.ratchet.proposers import validate_proposal
from fp4lab.lab.specs.program import load_program

ROOT = Path(__file__).resolve().parents[2]
KERNEL = "fp4lab/numerics/kernels/attention.py"


def propose(history: list[dict] | None = None, text: str | None = None) -> subprocess.CompletedProcess:
    context = {"files": {KERNEL: text if text is not None else (ROOT / KERNEL).read_text()}, "history": history or []}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "propose_attention_tiles.py")], input=json.dumps(context),
                           capture_output=True, text=True, timeout=60)  # fmt: skip


def row(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.search(r"^    64: \(([0-9, ]+)\),$", text, re.M).group(1).split(","))


def test_a_proposal_moves_one_parameter_one_step_and_passes_the_ratchets_validation():
    program = load_program(ROOT / "sweeps" / "attention_tiles.md")
    done = propose()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    proposal = validate_proposal(answer, program, ROOT, "command")  # paths, [edit].files and `git apply --check`
    assert proposal.kind == "diff" and proposal.paths == (KERNEL,)
    before = row((ROOT / KERNEL).read_text())
    changed = [line for line in answer["diff"].splitlines() if line.startswith(("+ ", "- ", "+    ", "-    "))]
    assert len(changed) == 2, changed  # one line out, one line in: the head-dim-64 row
    after = tuple(int(v) for v in re.search(r"\+    64: \(([0-9, ]+)\),", answer["diff"]).group(1).split(","))
    assert sum(a != b for a, b in zip(before, after)) == 1
    assert str(before).replace(" ", "") in answer["rationale"].replace(" ", "") and str(after).replace(" ", "") in answer["rationale"].replace(" ", "")


def test_configurations_named_before_are_not_proposed_again_and_the_constraints_hold():
    text = (ROOT / KERNEL).read_text()
    seen: list[dict] = []
    proposed = set()
    while True:
        done = propose(seen, text)
        if done.returncode != 0:
            break
        answer = json.loads(done.stdout)
        after = tuple(int(v) for v in re.search(r"\+    64: \(([0-9, ]+)\),", answer["diff"]).group(1).split(","))
        fwd_m, fwd_n, kv_m, kv_n, dq_m, dq_n = after[:6]
        assert fwd_m % fwd_n == 0 and dq_m % dq_n == 0 and kv_n % kv_m == 0, after
        assert after not in proposed and after != row(text)
        proposed.add(after)
        seen.append({"iteration": len(seen) + 1, "decision": "discard", "rationale": answer["rationale"]})
    assert done.returncode == 1 and "every neighbour" in done.stderr
    assert 4 <= len(proposed) <= 16  # each of the 8 entries one step down or up, where allowed


def test_the_proposer_and_the_metric_refuse_what_they_cannot_do():
    done = propose(text="no tiles here\n")
    assert done.returncode == 2 and "_GPU_TILES" in done.stderr
    if not __import__("torch").cuda.is_available():
        metric = subprocess.run([sys.executable, str(ROOT / "scripts" / "attention_tiles_metric.py")], capture_output=True, text=True,
                                timeout=120, cwd=ROOT)  # fmt: skip
        assert metric.returncode == 2 and "needs a CUDA device" in metric.stderr and "attention_ms" not in metric.stdout
