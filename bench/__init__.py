"""Benchmarks of jaxtile's implementations against the attention a JAX or PyTorch user has today.

``python -m bench`` times every importable jaxtile implementation and its peers
(``jax.nn.dot_product_attention`` with XLA and cuDNN, JAX's bundled Pallas ``mha``, and
PyTorch's ``scaled_dot_product_attention`` backends) forward and forward+backward, with
peak memory, and writes ``results.json``, a terminal table and PNG plots. Each framework
runs in worker processes of its own (`bench.jax_worker`, `bench.torch_worker`) so the two
never share a GPU allocator; the JAX implementations of each shape share one and are timed
against each other in interleaved rounds (`bench.runner`). ``python -m bench.report results.json`` prints the README's
Markdown tables from the JSON.

Modules: `bench.suites` (what is measured, FLOP counts), `bench.catalog` (which
implementations exist and what each supports), `bench.runner` (worker processes,
time-outs, out-of-memory handling), `bench.table`, `bench.plots`, `bench.report`.
"""
