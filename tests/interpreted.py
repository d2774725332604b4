"""A test module's check run in a fresh Python under Triton's interpreter: TRITON_INTERPRET=1 is read
when Triton's kernels are first imported, so it cannot be switched on inside the test process.

`interpreter_python(code)` runs any such code; `run_interpreted(module, calls)` checks of a test module,
several in one start. Both first fold the interpreter's reductions by slice (`fold_reductions_by_slice`), and build each
fp4lab kernel variant the interpreter launched for a GPU too (`build_recorded_kernels`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROLOGUE = (f"import os, sys\nsys.path.insert(0, {ROOT!r})\n"
            "from tests.interpreted import fold_reductions_by_slice, record_launched_kernels\n"
            "fold_reductions_by_slice()\nrecord_launched_kernels(os.environ['FP4LAB_KERNEL_RECORD'])\n")


def interpreter_python(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c code` under TRITON_INTERPRET=1 (after PROLOGUE), its output captured; check its returncode."""
    pytest.importorskip("triton")
    with tempfile.TemporaryDirectory() as folder:
        record = os.path.join(folder, "kernels.jsonl")
        open(record, "w").close()
        env = dict(os.environ, TRITON_INTERPRET="1", FP4LAB_KERNEL_RECORD=record)
        done = subprocess.run([sys.executable, "-c", PROLOGUE + code], env=env, timeout=timeout, capture_output=True, text=True, check=False)
        if done.returncode == 0:  # a failed check's own error comes first
            build_recorded_kernels(record)
    return done


def checks_code(module: str, calls: str | Sequence[str]) -> str:
    """Python that runs `calls` (statements over the names of the test module `module`, its `__name__`)
    one after another, each even when one before it failed, prints "ok" after the last, or exits 1 with
    each failure's traceback and then the list of the calls that failed. Checks that share one
    interpreter start share its ~3 s of imports (most of a small check's time)."""
    calls = [calls] if isinstance(calls, str) else list(calls)
    return (f"import sys as _sys, traceback as _traceback\nfrom {module} import *\n_failed = []\n"
            f"for _call in {calls!r}:\n"
            "    try:\n        exec(_call)\n"
            "    except Exception:\n        _failed.append(_call)\n        _traceback.print_exc()\n"
            "if _failed:\n    _sys.exit('failed: ' + '; '.join(_failed))\n"
            "print('ok')\n")


def run_interpreted(module: str, calls: str | Sequence[str], timeout: int = 600) -> None:
    """`calls` (one statement or several, in order) with every name of the test module `module` in scope,
    in one Python under TRITON_INTERPRET=1; fails naming the calls that failed, after their tracebacks.
    A call that changes the interpreter for the rest of the process comes after those it must not touch."""
    done = interpreter_python(checks_code(module, calls), timeout)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-8000:]


@contextlib.contextmanager
def fused_kernels_as_on_cuda() -> Iterator[None]:
    """fp4_linear asks for the fused Triton kernels on CPU tensors as it does on CUDA ones (under the
    interpreter they run there); its own answer comes back on exit, so a later check in the same
    process gets the CPU's. Also a decorator of a check."""
    from fp4lab.nn import fp4_linear
    from fp4lab.numerics.kernels import quantizer_covers

    on_cpu = fp4_linear.kernel_options
    fp4_linear.kernel_options = lambda spec, signs, t, seed: (
        fp4_linear.fused_options(spec, signs, t, seed) if quantizer_covers(spec) else None)
    try:
        yield
    finally:
        fp4_linear.kernel_options = on_cpu


@contextlib.contextmanager
def spying(owner: object, name: str, record: Callable[..., object]) -> Iterator[None]:
    """`owner.name` (a function) calls `record` with its arguments first, until exit."""
    original = getattr(owner, name)

    def spied(*args, **kwargs):
        record(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, spied)
    try:
        yield
    finally:
        setattr(owner, name, original)


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



def record_launched_kernels(path: str) -> None:
    """Append each fp4lab kernel variant the interpreter launches to `path`, one JSON line: module, name
    and arguments (tensors as their dtype), for `build_recorded_kernels` to build outside the
    interpreter (Triton's own library is interpreted here, so nothing can be compiled in this process)."""
    import inspect
    import json

    from triton.runtime import interpreter

    seen: set[str] = set()
    interpreted_run = interpreter.InterpretedFunction.run

    def described(value, constexpr: bool):
        """A constexpr by value; a runtime argument by what its type is in the kernel's signature (so
        launches over other shapes are one variant)."""
        if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
            return {"tensor": str(value.dtype)}
        if constexpr or value is None or isinstance(value, bool):
            return value if value is None or isinstance(value, (bool, int, float, str)) else {"unrecorded": type(value).__name__}
        if isinstance(value, int):
            return {"int": "i32" if -(2**31) <= value < 2**31 else "i64"}
        return {"float": True} if isinstance(value, float) else {"unrecorded": type(value).__name__}

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("fp4lab."):
            named = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in self.arg_names}
            params = inspect.signature(self.fn).parameters
            line = json.dumps({"module": self.fn.__module__, "kernel": self.fn.__name__, "args": {
                name: described(value, "constexpr" in str(params[name].annotation)) for name, value in named.items()}},
                sort_keys=True)  # fmt: skip
            if line not in seen:
                seen.add(line)
                with open(path, "a") as out:
                    out.write(line + "\n")
        return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run


@functools.cache
def _kernel_sources_digest() -> bytes:
    """Triton's version and fp4lab's kernel sources, as they are for this test process."""
    import triton

    digest = hashlib.sha256(triton.__version__.encode())
    for source in sorted(Path(ROOT, "fp4lab", "numerics", "kernels").glob("*.py")):
        digest.update(source.read_bytes())
    return digest.digest()


def _built_marker(line: str) -> Path:
    """A file whose existence says this variant built before from the same kernel sources and Triton:
    in the temp folder, so the workers of one run, and later runs on this machine, build it once."""
    name = hashlib.sha256(_kernel_sources_digest() + line.encode()).hexdigest()
    return Path(tempfile.gettempdir(), "fp4lab-sm90-builds", name)


def build_recorded_kernels(path: str) -> None:
    """Build each kernel variant `record_launched_kernels` wrote to `path` for an H100 (Triton's front
    end, Python AST to TTIR: no GPU needed), its float arguments typed as Triton's launcher types them
    (fp32) and as torch.compile does (fp64). The interpreter runs kernels as Python and lets pass what
    the compiler refuses: statements after a taken constexpr `return` (compiled anyway), a loop-carried
    value whose type changes. Raises AssertionError naming the kernel and the compiler's message."""
    import importlib
    import json

    import torch

    from tests.kernels.test_triton_frontend import FLOAT_TYPES, build_ttir

    with open(path) as lines:
        recorded = [line for line in lines.read().splitlines() if line and not _built_marker(line).exists()]
    for line in recorded:
        variant = json.loads(line)
        if any(isinstance(v, dict) and "unrecorded" in v for v in variant["args"].values()):
            continue
        kernel = getattr(importlib.import_module(variant["module"]), variant["kernel"])
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        stand_ins = {"tensor": lambda dtype: torch.empty(1, dtype=getattr(torch, dtype.removeprefix("torch."))),
                     "int": lambda width: 7 if width == "i32" else 2**40, "float": lambda _: 0.5}
        args = {name: stand_ins[next(iter(v))](next(iter(v.values()))) if isinstance(v, dict) else v
                for name, v in variant["args"].items()}
        typings = FLOAT_TYPES.items()
        if not any(isinstance(v, float) and name not in constexprs for name, v in args.items()):
            typings = list(typings)[:1]  # no float argument: one build is the other
        for launcher, float_type in typings:
            try:
                build_ttir(kernel, float_type, constexprs=constexprs, **args)
            except Exception as error:
                cause = error.__cause__ or error  # a CompilationError's message is the source; its cause says why
                message = (str(cause).strip().splitlines() or [""])[-1] or repr(cause)
                raise AssertionError(f"{variant['kernel']} ({variant['module']}) does not build for sm90 with floats as "
                                     f"{launcher} passes them: {message}\n{line}") from error
        marker = _built_marker(line)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
