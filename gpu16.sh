#!/usr/bin/env bash
# device call: ledger rounds (untracked). usage: bash gpu16.sh PART
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=/tmp/fp4cache
FP4="python3 -m fp4lab.cli"
part=$1
shift
if [ "$part" = check ]; then
  nvidia-smi -L
  timeout -k 5 100 $FP4 bench fusion --json > $OUT/bench_fusion.json 2>> $OUT/err.log; echo "fusion rc=$?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r) for r in d['fusion']]" $OUT/bench_fusion.json 2>&1 | cut -c1-400
  timeout -k 5 120 python3 -m pytest -m cuda -v -p no:cacheprovider tests/test_triton_fusion.py -k "extreme_magnitudes_on_cuda or (rmsnorm_reference_is_nn_rmsnorm and cuda)" > $OUT/tests.log 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests.log | tail -12
fi
budget=$(( ${LEDGER_END:-535} - SECONDS ))
echo "ledger budget ${budget}s"
bash scripts/ledger_round.sh "$budget" $OUT "$@" > $OUT/round.log 2>&1
echo "round rc=$?"
grep -E "ledger_round|completed|interrupted|failed|diverged" $OUT/round.log | tail -40
python3 - <<'PY'
import json, collections
d = json.load(open("docs/ledger/sweep_catalog.json"))["runs"]
c = collections.Counter((r["sweep"], r["state"]) for r in d.values())
print(sorted(c.items()))
PY
