"""fp4lab bench: kernel and training-step benchmarks, each beside the anchor it is measured against.

`kernels.py` times the quantizers against a device-to-device copy of the same tensor; `steps.py`
times fp4lab training steps against `anchor.py`, a plain PyTorch Llama loop of the same shape. The
CLI (`fp4lab bench`) prints both as tables or JSON; docs/BENCHMARKS.md records the GPU figures.
"""
