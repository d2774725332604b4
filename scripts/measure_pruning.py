"""What early stopping saves: an Optuna sweep spec run with its pruner and again with pruner = "none",
for a few sampler seeds, each in a fresh folder; prints a Markdown table of trials, pruned trials,
training steps, wall time and the best objective found.

    python scripts/measure_pruning.py                         # sweeps/muon_tpe.toml, seeds 0 1 2, 2 workers
    python scripts/measure_pruning.py SPEC --seeds 0 1 --workers 2

Steps are what the trials trained (summary.json `steps_completed`), the compute the pruner saves; wall
time also holds each trial's start-up (a process, torch's import), which pruning does not save.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_sweep(spec_text: str, folder: Path, workers: int) -> dict:
    folder.mkdir(parents=True)
    (folder / "spec.toml").write_text(spec_text)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fp4lab.cli", "sweep", "spec.toml", "--workers", str(workers)],
                          cwd=folder, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the sweep in {folder} failed:\n{done.stdout}\n{done.stderr}")
    runs = json.loads((folder / "sweep_catalog.json").read_text())["runs"].values()
    finished = [r["summary"]["final_val_loss"] for r in runs if r["state"] == "completed"]
    return {"trials": len(runs), "pruned": sum(r["state"] == "pruned" for r in runs),
            "steps": sum(r["summary"]["steps_completed"] for r in runs), "wall": wall, "best": min(finished)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", nargs="?", default=str(ROOT / "sweeps" / "muon_tpe.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    text = Path(args.spec).read_text()
    if not re.search(r"^pruner = ", text, re.M) or not re.search(r"^seed = ", text, re.M):
        raise SystemExit(f"{args.spec}: needs a top-level seed and an [optuna] pruner line to compare against none")
    print("| sampler seed | pruner | trials (pruned) | steps trained | wall | best final_val_loss |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="fp4lab-pruning-") as tmp:
        for seed in args.seeds:
            seeded = re.sub(r"^seed = .*$", f"seed = {seed}", text, flags=re.M)
            for label, spec in (("none", re.sub(r"^pruner = .*$", 'pruner = "none"', seeded, flags=re.M)), ("as in the spec", seeded)):
                r = run_sweep(spec, Path(tmp) / f"{seed}-{label.split()[0]}", args.workers)
                print(f"| {seed} | {label} | {r['trials']} ({r['pruned']}) | {r['steps']} | {r['wall']:.0f} s | {r['best']:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
