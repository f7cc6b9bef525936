"""llama-cpp-python's server and loader options, shared by vs_llamacpp.py and serving.py."""

from __future__ import annotations

import subprocess
import sys

from common import wait_healthy

# -- llama.cpp -----------------------------------------------------------------------
# llama.cpp's extra CPU buffer types include an AMX path that dies with SIGILL (tileloadd)
# on some VMs that report AMX; without them llama.cpp runs its AVX-512 kernels. This
# snippet turns them off in-process and in the server process.
NO_EXTRA_BUFTS = """
import llama_cpp.llama as _ll
_default = _ll.llama_cpp.llama_model_default_params
def _params():
    p = _default()
    p.use_extra_bufts = False
    return p
_ll.llama_cpp.llama_model_default_params = _params
"""


def start_llama_cpp(path: str, port: int, n_ctx: int, threads: int, extra_bufts: bool):
    # --interrupt_requests False: queue concurrent requests; by default a new request cuts
    # the running one short, which would count as (very) low throughput.
    boot = ("" if extra_bufts else NO_EXTRA_BUFTS) + (
        "import runpy, sys; sys.argv[0] = 'llama_cpp.server'; "
        "runpy.run_module('llama_cpp.server', run_name='__main__')"
    )
    cmd = [sys.executable, "-c", boot, "--model", path, "--port", str(port), "--host",
           "127.0.0.1", "--n_ctx", str(n_ctx), "--n_threads", str(threads),
           "--interrupt_requests", "False"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(f"http://127.0.0.1:{port}/v1/models", proc)
    return proc
