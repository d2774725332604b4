#!/usr/bin/env bash
# One round of the recipe ledger (docs/LEDGER.md) on a GPU machine, bounded in time:
#
#   scripts/ledger_round.sh SECONDS RESULTS_DIR [SPEC[@K] ...]      (default SPEC: sweeps/ledger.toml)
#
# 1. the pycode corpus, where a SPEC trains on it (scripts/build_corpus.py: from a bundle in
#    .corpus/pycode when there is one, else from PyPI);
# 2. each SPEC swept into docs/ledger/sweep_catalog.json (runs already completed there are skipped, so
#    rounds accumulate) until SECONDS have passed: then the sweep gets Ctrl-C, the run in progress
#    checkpoints, and the next round on the same machine resumes it;
# 3. the report of each sweep into reports/<sweep>/; into RESULTS_DIR: the catalog, runs.tar.xz (every
#    run's summary.json and metrics.jsonl, no checkpoints) and reports.tar.xz.
#
# The runs of earlier rounds come from docs/ledger/runs.tar.xz, unpacked first. Where the rounds are
# published, copy RESULTS_DIR/sweep_catalog.json and RESULTS_DIR/runs.tar.xz over docs/ledger/'s and
# commit them: the next round, on a fresh machine, skips the completed runs and keeps their metrics.
#
# Runs go one per GPU (`fp4lab sweep --workers` = the GPUs nvidia-smi lists: each run gets a GPU of its
# own), so the ledger's tokens/s are those of a GPU to itself on a machine of one GPU or several.
# SPEC@K runs K at once on each GPU instead: more runs per hour, tokens/s no longer those of a GPU to
# itself (the stress ablation, where only the losses and the scanner's events matter).
#
# $PYTHON (default python3) is the interpreter that has fp4lab. Ctrl-C at a terminal stops the sweep
# as the deadline does (the run in progress checkpoints), then the results are written.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: scripts/ledger_round.sh SECONDS RESULTS_DIR [SPEC[@K] ...]" >&2
  exit 2
fi
budget=$1
results=$2
shift 2
specs=("$@")
[ ${#specs[@]} -gt 0 ] || specs=(sweeps/ledger.toml)
catalog=docs/ledger/sweep_catalog.json
runs_archive=docs/ledger/runs.tar.xz
for entry in "${specs[@]}"; do
  spec=${entry%@*}
  if [ ! -f "$spec" ] || { [ "$spec" != "$entry" ] && ! [[ "${entry##*@}" =~ ^[1-9][0-9]*$ ]]; }; then
    echo "ledger_round: $entry: SPEC must be a sweep spec file and K in SPEC@K a whole number of runs per GPU, e.g. sweeps/ledger_stress.toml@3" >&2
    exit 2
  fi
done
deadline=$((SECONDS + budget))
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$gpus" -ge 1 ] || gpus=1
mkdir -p "$results" "$(dirname "$catalog")"
[ ! -f "$runs_archive" ] || tar -xJf "$runs_archive"

python=${PYTHON:-python3}
"$python" scripts/build_corpus.py "${specs[@]%@*}"

for entry in "${specs[@]}"; do
  spec=${entry%@*}
  share=1
  [ "$spec" = "$entry" ] || share=${entry##*@}
  left=$((deadline - SECONDS))
  if [ "$left" -le 60 ]; then
    echo "ledger_round: no time left for $spec" >&2
    break
  fi
  # SIGINT: the sweep's own clean stop (checkpoint, record "interrupted"); exit 130 then is expected.
  # --foreground: the sweep stays in the terminal's process group, so Ctrl-C reaches it too.
  status=0
  timeout --foreground -s INT -k 120 "$left" "$python" -m fp4lab.cli sweep "$spec" --catalog "$catalog" --workers $((gpus * share)) \
    || status=$?
  [ "$status" -eq 0 ] || echo "ledger_round: $spec ended with $status" >&2
  # 124: the deadline; 130: the sweep's own exit after Ctrl-C, so no further spec starts
  if [ "$status" -eq 130 ]; then
    echo "ledger_round: interrupted; writing the results" >&2
    break
  fi
done

# The catalog and the runs first: should the machine's time run out during the reports, they are back.
cp "$catalog" "$results/sweep_catalog.json"
find runs -maxdepth 3 \( -name summary.json -o -name metrics.jsonl \) -print0 2>/dev/null | sort -z \
  | tar -cJf "$results/runs.tar.xz.part" --null -T -
mv "$results/runs.tar.xz.part" "$results/runs.tar.xz"
for entry in "${specs[@]}"; do
  spec=${entry%@*}
  name=$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["name"])' "$spec")
  "$python" -m fp4lab.cli report "$name" --catalog "$catalog" --out "reports/$name" || true
done
tar -cJf "$results/reports.tar.xz" reports
