"""Device helper (untracked): training steps of CTA-local recipes with the fused CTA quantizers (now)
and without them (kernel_covers as before the change), beside bf16, in one process."""
import json, os, sys, torch
from fp4lab.bench.steps import bench_steps
import fp4lab.nn.fp4_linear as fl

out = {}
common = dict(model="125m", batch_size=16, seq_len=1024, device=torch.device("cuda"), steps=15, warmup=5)
fused = bench_steps(["bf16", "nvfp4-cta", "hybrid-operand"], **common, on_result=lambda r: print(f"fused {r.name}: {r.tokens_per_s:,.0f} tok/s", flush=True))
out["fused"] = [r.as_dict() for r in fused]
covers = fl.kernel_covers
fl.kernel_covers = lambda spec: spec.format != "nvfp4_cta" and covers(spec)
reference = bench_steps(["nvfp4-cta", "hybrid-operand"], **common, on_result=lambda r: print(f"reference {r.name}: {r.tokens_per_s:,.0f} tok/s", flush=True))
out["reference"] = [r.as_dict() for r in reference]
json.dump(out, open(os.path.join(os.environ["OUT"], "cta_bench.json"), "w"), indent=1)
