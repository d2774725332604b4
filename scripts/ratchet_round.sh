#!/usr/bin/env bash
# One round of a ratchet (docs/RATCHET.md) on a machine that starts bare and keeps nothing, bounded
# in time, its state carried in and out as a few files:
#
#   scripts/ratchet_round.sh SECONDS RESULTS_DIR PROGRAM [ITERATIONS] [-- RATCHET OPTIONS ...]
#
# The state of tag T (PROGRAM's file name without .md; --tag among the options changes it) lives in
# docs/ratchet/T/ when it is carried in:
#   sweep_catalog.json   the ratchet's records (imported by the catalog on a machine that has none)
#   branch               "<head> <base>": the commits of branch ratchet/T and of main it grew from
#   branch.bundle        the commits base..head (absent while nothing was kept)
#   state.tar.xz         .fp4lab/ratchet/T/ without its worktrees and checkpoints: results.tsv,
#                        patches, logs, the optuna journal, each run's summary.json and metrics.jsonl
#
# 1. the branch and the state are restored where this checkout lacks them (a checkout that has them,
#    e.g. the machine of the previous round, keeps its own); the pycode corpus is built where the
#    program trains on it (scripts/build_corpus.py: from a bundle in .corpus/pycode, carried in, when
#    there is one);
# 2. `fp4lab ratchet PROGRAM --iterations ITERATIONS --tag T --catalog docs/ratchet/T/sweep_catalog.json`
#    until SECONDS have passed: then it gets Ctrl-C, records what was decided and stops; an iteration
#    cut off is run again by the next round (its checkpoints are not carried: too large);
# 3. the four files into RESULTS_DIR. Where the rounds are published, copy them over docs/ratchet/T/
#    and commit them: the next round, on a fresh machine, continues from there.
#
# The base must be a commit this checkout has (the branch starts at the HEAD of the first round).
# $PYTHON (default python3) is the interpreter that has fp4lab.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/ratchet_round.sh SECONDS RESULTS_DIR PROGRAM [ITERATIONS] [-- RATCHET OPTIONS ...]"
if [ $# -lt 3 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "$usage" >&2
  exit 2
fi
budget=$1
results=$2
program=$3
shift 3
iterations=()
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  if ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "ratchet_round: ITERATIONS must be a whole number, got '$1'; $usage" >&2
    exit 2
  fi
  iterations=(--iterations "$1")
  shift
fi
[ $# -eq 0 ] || { [ "$1" = "--" ] && shift; }
options=("$@")
if [ ! -f "$program" ]; then
  echo "ratchet_round: $program: no such program file; $usage" >&2
  exit 2
fi
tag=$(basename "$program" .md)
for ((i = 0; i < ${#options[@]}; i++)); do
  case "${options[$i]}" in
    --tag) tag=${options[$((i + 1))]:-} ;;
    --tag=*) tag=${options[$i]#--tag=} ;;
    --catalog | --catalog=*) echo "ratchet_round: --catalog is docs/ratchet/<tag>/sweep_catalog.json here; leave it out" >&2; exit 2 ;;
  esac
done
if ! [[ "$tag" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]]; then
  echo "ratchet_round: tag '$tag' must be letters, digits, '.', '_' or '-'" >&2
  exit 2
fi
carried=docs/ratchet/$tag
state=.fp4lab/ratchet/$tag
branch=ratchet/$tag
mkdir -p "$results" "$carried"

if ! git show-ref --verify --quiet "refs/heads/$branch" && [ -f "$carried/branch" ]; then
  read -r head base < "$carried/branch"
  if [ -f "$carried/branch.bundle" ]; then
    git fetch -q "$carried/branch.bundle" "refs/heads/$branch:refs/heads/$branch"
  else
    git branch "$branch" "$head"
  fi
  [ "$(git rev-parse "$branch")" = "$head" ] || { echo "ratchet_round: $carried/branch names $head but the bundle gives $(git rev-parse "$branch")" >&2; exit 1; }
fi
if [ ! -d "$state" ] && [ -f "$carried/state.tar.xz" ]; then
  mkdir -p "$state"
  tar -xJf "$carried/state.tar.xz" -C "$state"
fi

# The pycode corpus where the program's runs train on it (from a carried bundle in .corpus/pycode).
"${PYTHON:-python3}" scripts/build_corpus.py "$program"

# SIGINT: the ratchet's own clean stop (what was decided is recorded; exit 130 then is expected).
# --foreground keeps the ratchet in the terminal's process group, so a Ctrl-C reaches it too (it passes
# one SIGINT on to its runs, which live in sessions of their own).
timeout --foreground -s INT -k 120 "$budget" "${PYTHON:-python3}" -m fp4lab.cli ratchet "$program" "${iterations[@]}" --tag "$tag" \
  --catalog "$carried/sweep_catalog.json" "${options[@]}" || echo "ratchet_round: the ratchet ended with $?" >&2

cp "$carried/sweep_catalog.json" "$results/sweep_catalog.json"
if git show-ref --verify --quiet "refs/heads/$branch"; then
  head=$(git rev-parse "$branch")
  base=$(git merge-base "$branch" HEAD)
  echo "$head $base" > "$results/branch"
  rm -f "$results/branch.bundle"
  [ "$head" = "$base" ] || git bundle create -q "$results/branch.bundle" "$branch" "^$base"
fi
if [ -d "$state" ]; then
  (cd "$state" && find . \( -path ./worktree -o -path './worker-*' \) -prune -o -type f \
     \( ! -path './runs/*' -o -name summary.json -o -name metrics.jsonl \) -print0 \
     | sort -z | tar -cJf - --null -T -) > "$results/state.tar.xz.part"
  mv "$results/state.tar.xz.part" "$results/state.tar.xz"
fi
echo "ratchet_round: tag $tag: $(ls "$results" | tr '\n' ' ')into $results; copy them over $carried/ to carry them on" >&2
