#!/usr/bin/env bash
# device call (untracked): check the fused CTA-local quantizers on CUDA, time them, then a ledger round.
# usage: LEDGER_END=480 bash gpu18.sh [check] SPEC...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=/tmp/fp4cache
FP4="python3 -m fp4lab.cli"
if [ "$1" = check ]; then
  shift
  nvidia-smi -L
  timeout -k 5 240 python3 -m pytest -m cuda -q -p no:cacheprovider -x tests/test_triton_quantize.py -k "cta" > $OUT/cta_tests.log 2>&1
  rc=$?; echo "cta tests rc=$rc"; grep -E "FAILED|Error|passed|failed" $OUT/cta_tests.log | tail -8
  timeout -k 5 120 python3 -m pytest -m cuda -q -p no:cacheprovider -x tests/test_tensor_cores.py -k "cuda and cta" > $OUT/tc_tests.log 2>&1
  echo "tensor-core tests rc=$?"; grep -E "FAILED|Error|passed|failed" $OUT/tc_tests.log | tail -5
  if [ $rc -ne 0 ]; then echo "CTA kernels fail on CUDA: no ledger round"; exit 1; fi
  timeout -k 5 240 python3 gpu18_bench.py 2>&1 | tee $OUT/cta_bench.log | grep -E "tok/s|Error" | head -12
  echo "bench rc=${PIPESTATUS[0]}"
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
