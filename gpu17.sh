#!/usr/bin/env bash
# device call: profile fp8 vs bf16 steps (untracked)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FP4LAB_CACHE=/tmp/fp4cache
timeout -k 5 ${1:-140} python3 -m fp4lab.cli bench steps --recipes bf16,fp8 --steps 6 --warmup 3 --profile $OUT/prof --json > $OUT/steps.json 2> $OUT/err.log
echo "rc=$?"; tail -5 $OUT/err.log
ls $OUT/prof 2>/dev/null
for f in $OUT/prof/*fp8*.txt; do head -40 "$f" | cut -c1-200; done 2>/dev/null
