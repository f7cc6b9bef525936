"""Compile our Triton kernels for a CUDA GPU on a machine without one.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, not that Triton can
compile them: a type mix-up or an op the compiler rejects shows only on a GPU. Triton can
compile ahead of time for a named target (here sm_90, the H200) down to a cubin with the
ptxas it ships, no driver needed; its cuobjdump then tells the registers each thread uses
and the bytes spilled to local memory (a spill slows a kernel down: the tests forbid them).

A test module lists ``CASES``: name -> a call of one of our Python wrappers on small CPU
tensors, and reads the results from the ``sm90_build`` fixture (tests/conftest.py).
``compile_cases(path)`` runs them in a fresh interpreter-free process (this test
session imported the kernels interpreted), where each ``kernel[grid](...)`` is recorded
instead of launched and then compiled, so the compiled variants are exactly those the
wrappers launch (constexprs, argument types, launch options, and what a launch adds to
them: Triton's own argument binder turns 1-valued ints into constexprs and gives ints
divisible by 16 and 16-byte aligned pointers the divisibility hint, except the arguments
a kernel lists in ``do_not_specialize``). Each result also carries every launch's
specialization key, so a test can check that launches which should share a variant do.
Run as a script it is that process: ``python triton_aot.py TEST_MODULE.py`` prints one
JSON result per case.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SHARED_MEMORY_SM90 = 232_448
"""Bytes of shared memory one block may use on sm_90."""


def _sm90():
    """Triton's target for an H200: sm_90, 32-thread warps."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@dataclass
class Launch:
    kernel: object  # a triton JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class Recorder:
    launches: list[Launch] = field(default_factory=list)


@contextlib.contextmanager
def record_launches() -> Iterator[Recorder]:
    """Within: ``kernel[grid](*args, **kwargs)`` records a Launch and runs nothing."""
    from triton.runtime.jit import KernelInterface

    recorder = Recorder()
    original = KernelInterface.__getitem__

    def getitem(kernel, grid):
        return lambda *args, **kwargs: recorder.launches.append(Launch(kernel, args, kwargs))

    KernelInterface.__getitem__ = getitem
    try:
        yield recorder
    finally:
        KernelInterface.__getitem__ = original


Variant = tuple[dict, dict, dict, dict]
"""(signature, constexprs, attrs, options) of one compiled variant (``specialize``)."""


def specialize(launch: Launch) -> Variant:
    """(signature, constexprs, attrs, options) of the variant a real launch of ``launch``
    on an sm_90 GPU compiles, from Triton's own argument binder (the one ``kernel[grid]``
    runs): every constexpr; an int equal to 1 becomes a constexpr and one divisible by 16
    (a 16-byte aligned pointer) carries the divisibility hint, unless the kernel lists the
    argument in ``do_not_specialize`` (then it is a plain i32/i64/pointer, no hint, so any
    value shares the variant) or, for a pointer, in ``do_not_specialize_on_alignment``."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(_sm90())
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, (kind, value)) in enumerate(zip(kernel.params, specialization)):
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = bound[param.name]
        elif isinstance(value, str):  # "D": divisible by 16; "": neither
            attrs[(i,)] = backend.parse_attr(value)
    return signature, constexprs, attrs, options


def specialization_key(variant: Variant) -> list[str]:
    """A variant as readable entries: ``name=value`` for a constexpr (1-valued ints
    included), ``name:type`` plus ``/16`` for the divisibility hint."""
    signature, constexprs, attrs, _ = variant
    out = []
    for i, (name, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            out.append(f"{name}={constexprs[(i,)]!r}")
        else:
            out.append(f"{name}:{kind}" + ("/16" if attrs.get((i,)) else ""))
    return out


def compile_for_sm90(launch: Launch, variant: Variant):
    """The launch's kernel compiled for sm_90 as ``variant`` (``specialize(launch)``);
    raises what Triton raises."""
    import triton
    from triton.compiler import ASTSource

    signature, constexprs, attrs, options = variant
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=_sm90(), options=options)


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """Registers per thread and spill stack bytes of a cubin (``cuobjdump -res-usage``,
    shipped with triton's NVIDIA backend); None without it."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", out.stdout)
    return {"regs": int(found[1]), "stack": int(found[2])} if found else None


def _run_case(call) -> dict:
    """{"kernels", "keys", "cubin_bytes", "shared", "usage"} (lists, one entry per launch;
    keys from ``specialization_key``) or {"error": ...}."""
    try:
        with record_launches() as rec:
            call()
        variants = [specialize(launch) for launch in rec.launches]
        compiled = [compile_for_sm90(launch, v) for launch, v in zip(rec.launches, variants)]
        keys = [specialization_key(v) for v in variants]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    return {
        "kernels": [launch.name for launch in rec.launches],
        "keys": keys,
        "cubin_bytes": [len(c.asm["cubin"]) for c in compiled],
        "shared": [c.metadata.shared for c in compiled],
        "usage": [resource_usage(c.asm["cubin"]) for c in compiled],
    }


def compile_cases(test_file: str, timeout: float = 600) -> dict[str, dict]:
    """Compile every case of ``test_file``'s CASES in a process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, __file__, test_file], env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the compile process failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_builds(result: dict, kernels: list[str]) -> None:
    """A case (one entry of ``compile_cases``) compiled: exactly ``kernels`` launched, each
    a non-empty cubin within sm_90's shared memory and without register spills."""
    assert "error" not in result, result.get("error")
    assert result["kernels"] == kernels
    assert all(n > 0 for n in result["cubin_bytes"])
    assert all(s <= SHARED_MEMORY_SM90 for s in result["shared"]), result["shared"]
    spills = [u["stack"] for u in result["usage"] if u is not None]
    assert not any(spills), f"registers spilled: {result['usage']}"


def gpu_compiler_missing() -> str | None:
    """Why Triton can not compile for NVIDIA GPUs here (None when it can)."""
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _main(test_file: str) -> None:
    spec = importlib.util.spec_from_file_location("aot_cases", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {name: _run_case(call) for name, call in module.CASES.items()}
    print(json.dumps(results))


if __name__ == "__main__":
    _main(sys.argv[1])
