#!/usr/bin/env bash
# device call: issue 15 leftovers (untracked)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
FP4="python3 -m fp4lab.cli"
part=$1
if [ "$part" = 1 ]; then
  timeout -k 5 200 python3 -m pytest -m cuda -v -p no:cacheprovider --durations=12 tests/test_triton_attention.py tests/test_producer_fusion.py > $OUT/tests.log 2>&1
  echo "tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|s call" $OUT/tests.log | tail -30
  for pf in off all; do
    prof=""; [ $pf = all ] && prof="--profile /tmp/prof_all"
    timeout -k 5 160 $FP4 bench steps --steps 6 --warmup 3 --recipes bf16,mxfp4,nvfp4 --producer-fusion $pf $prof --json > $OUT/steps_$pf.json 2>> $OUT/err.log
    echo "steps $pf rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(r['name'], round(r['step_ms'],2), round(r['step_ms_spread'],3), r['peak_memory_mb']) for r in d['steps']]" $OUT/steps_$pf.json
  done
  tar -czf $OUT/prof_all.tar.gz -C /tmp prof_all
fi
if [ "$part" = 2 ]; then
  timeout -k 5 250 $FP4 bench steps --model 350m --steps 6 --warmup 3 --recipes bf16,mxfp4 --mx-gemm fp8 --json > $OUT/steps_350m_fp8.json 2>> $OUT/err.log
  echo "350m rc=$?"; tail -c 2500 $OUT/steps_350m_fp8.json
  timeout -k 5 60 $FP4 bench fusion --json > $OUT/bench_fusion.json 2>> $OUT/err.log; echo "fusion rc=$?"; tail -c 1500 $OUT/bench_fusion.json
  timeout -k 5 200 python3 -m pytest -m cuda -v -p no:cacheprovider --durations=12 tests/test_mx_gemm_linear.py tests/test_triton_fusion.py tests/test_triton_mx_gemm.py "tests/test_cli.py::test_bench_gemm_attention_and_fusion_on_a_gpu" > $OUT/tests2.log 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|s call" $OUT/tests2.log | tail -30
fi
if [ "$part" = 3 ]; then
  timeout -k 5 170 $FP4 bench fusion --json > $OUT/bench_fusion.json 2>> $OUT/err.log; echo "fusion rc=$?"; tail -c 3000 $OUT/bench_fusion.json
  timeout -k 5 150 python3 -m pytest -m cuda -v -p no:cacheprovider --durations=12 tests/test_triton_fusion.py tests/test_mx_gemm_linear.py tests/test_triton_mx_gemm.py > $OUT/tests3.log 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/tests3.log | tail -30; grep -c PASSED $OUT/tests3.log
fi
