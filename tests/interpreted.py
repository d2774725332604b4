"""A test module's check run in a fresh Python under Triton's interpreter: TRITON_INTERPRET=1 is read
when Triton's kernels are first imported, so it cannot be switched on inside the test process.

`interpreter_python(code)` runs any such code; `run_interpreted(module, call)` one check of a test
module. Both first fold the interpreter's reductions by slice (`fold_reductions_by_slice`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROLOGUE = f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom tests.interpreted import fold_reductions_by_slice\nfold_reductions_by_slice()\n"


def interpreter_python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c code` under TRITON_INTERPRET=1 (after PROLOGUE), its output captured; check its returncode."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", PROLOGUE + code], env=env, timeout=timeout, capture_output=True, text=True, check=False)


def run_interpreted(module: str, call: str, timeout: int = 600) -> None:
    """`call`, with every name of the test module `module` (its `__name__`) in scope, under TRITON_INTERPRET=1;
    fails with its stderr."""
    done = interpreter_python(f"from {module} import *\n{call}\nprint('ok')\n", timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def fold_reductions_by_slice() -> None:
    """Triton's interpreter reduces with a combine function of the kernel's own (the quantizers'
    NaN-propagating max) one element at a time in Python: most of an interpreted check's time. This
    folds the same function over whole slices along the axis instead, in the same order (acc, then
    element 1, 2, ...), so every output element sees the same operations (measured: the fused
    producers' check 4.5 times faster). Left alone where the interpreter's internals differ."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    reduce_ops = getattr(interpreter, "ReduceOps", None)
    if reduce_ops is None or not all(hasattr(reduce_ops, name) for name in ("generic_reduce", "unravel", "to_tensor")):
        return

    def folded(self, inputs):
        whole_axis = self.axis is None
        inputs, axis = self.unravel(inputs, self.axis)
        data = [x.handle.data for x in inputs]
        shape = data[0].shape

        def slice_at(k):
            return tuple(self.to_tensor(np.take(d, k, axis=axis), x.dtype) for d, x in zip(data, inputs))

        acc = slice_at(0)
        for k in range(1, shape[axis]):
            combined = self.combine_fn.fn(*acc, *slice_at(k))
            acc = combined if isinstance(combined, tuple) else (combined,)
        out = []
        for value, d, x in zip(acc, data, inputs):
            values = value.handle.data if isinstance(value, tl.core.tensor) else value
            result = np.asarray(values).astype(d.dtype).reshape(shape[:axis] + shape[axis + 1 :])
            if self.keep_dims:
                result = result.reshape((1,) * len(shape)) if whole_axis else np.expand_dims(result, axis)
            elif whole_axis:
                result = result.item()
            out.append(self.to_tensor(result, x.dtype))
        return out

    reduce_ops.generic_reduce = folded
