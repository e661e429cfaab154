"""Times PyTorch's ``scaled_dot_product_attention`` under one backend per task (flash,
cuDNN, memory-efficient or math, chosen with ``torch.nn.attention.sdpa_kernel``). Run by
`bench.runner` as ``python -m bench.torch_worker``, in a process of its own so that
PyTorch's and JAX's allocators never share the GPU.

On CUDA: ``triton.testing.do_bench(warmup=50, rep=300)`` median (20th and 80th
percentiles as the spread) and ``torch.cuda.max_memory_allocated`` over the first call
after ``reset_peak_memory_stats``, inputs and outputs included. On the CPU: the batch timer
of `bench._worker` and no memory figure. Tensors are ``[batch, heads, seq, head_dim]``,
PyTorch's own layout. There is no compilation: ``compile_s`` is the first call.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench import _worker
from bench.suites import Problem

BACKENDS = {
    "torch.flash": SDPBackend.FLASH_ATTENTION,
    "torch.cudnn": SDPBackend.CUDNN_ATTENTION,
    "torch.efficient": SDPBackend.EFFICIENT_ATTENTION,
    "torch.math": SDPBackend.MATH,
}
CUDA = torch.cuda.is_available()


def _sync(_=None) -> None:
    if CUDA:
        torch.cuda.synchronize()


def _timing(call, budget_s: float) -> _worker.Timing:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if not (CUDA and do_bench):
        return _worker.time_batches(call, _sync, budget_s, warm=1)
    lo, ms, hi = do_bench(call, warmup=50, rep=300, quantiles=[0.2, 0.5, 0.8])
    return _worker.Timing(ms, lo, hi, None, "triton do_bench(warmup=50, rep=300)")


def measure(task: dict, request: dict) -> dict:
    p = Problem.from_dict(task["problem"])
    backward = task["mode"] == "fwdbwd"
    torch.manual_seed(request["seed"])
    device, dtype = ("cuda" if CUDA else "cpu"), getattr(torch, p.dtype)

    def normal(heads):
        return torch.randn(p.batch, heads, p.seq_len, p.head_dim, device=device, dtype=dtype, requires_grad=backward)

    q, k, v = normal(p.num_heads), normal(p.num_kv_heads), normal(p.num_kv_heads)
    dout = torch.randn_like(q) if backward else None
    options = dict(is_causal=p.causal)
    if p.num_kv_heads != p.num_heads:
        options["enable_gqa"] = True

    def forward():
        return F.scaled_dot_product_attention(q, k, v, **options)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        out = forward()
        out.backward(dout)
        return out

    call = forward_backward if backward else forward
    with sdpa_kernel([BACKENDS[task["impl"]]]):
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = call()
        _sync()
        compile_s = time.perf_counter() - start
        del out
        peak = torch.cuda.max_memory_allocated() if CUDA else None
        timing = _timing(call, request["budget_s"])
    return dict(
        status="ok",
        compile_s=compile_s,
        compiled_bytes=None,
        peak_bytes=peak,
        peak_source="device" if CUDA else None,
        peak_exact=True,
        **dataclasses.asdict(timing),
    )


if __name__ == "__main__":
    _worker.serve(measure)
