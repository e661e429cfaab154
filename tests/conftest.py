"""The implementations under test: every registered one, with the capabilities its
record declares (`jaxtile.registry`).

Every test that is about "an implementation" takes the ``impl`` fixture and runs once per
registered implementation; capabilities decide which tests apply, never a copy of a
test and never a name. An implementation registered outside jaxtile (a module listed in
``JAXTILE_IMPLEMENTATIONS``) runs the same tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import jax
import pytest

from jaxtile import registry

IMPLEMENTATIONS = registry.implementations()
TILED = tuple(i for i in IMPLEMENTATIONS if i.tiled)

# The Mosaic GPU interpreter (`mosaic_interpreter`) runs each warpgroup as a CPU
# computation that blocks, inside callbacks, until another warpgroup's arrives. The CPU
# client's pool has one thread per core (two in CI), fewer than the computations blocked at
# once, and the interpreter deadlocked on it. So the pool gets 16 threads (XLA reads
# ``NPROC``), and computations run on their callers' threads where they can (no
# asynchronous dispatch). Both are read when the backend starts, before any test runs.
os.environ["NPROC"] = "16"
jax.config.update("jax_cpu_enable_async_dispatch", False)

ON_GPU = jax.default_backend() == "gpu"

# On the CPU, XLA's persistent compilation cache in a directory of this run's own, which
# pytest-xdist's workers inherit: a program compiles once however many tests build it (a
# case under settings that do not change it, the same shapes in several modules).
if not ON_GPU:
    if "JAXTILE_TEST_XLA_CACHE" not in os.environ:
        os.environ["JAXTILE_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxtile-xla-cache-")
        atexit.register(shutil.rmtree, os.environ["JAXTILE_TEST_XLA_CACHE"], ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", os.environ["JAXTILE_TEST_XLA_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A call an implementation's record declares it cannot run (`registry.Unsupported`)
    is reported as skipped, with the record's reason; any other error still fails."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and call.excinfo.errisinstance(registry.Unsupported):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"unsupported: {call.excinfo.value}")


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped off the GPU; tests of an implementation that this platform
    runs only interpreted (Pallas kernels on the CPU) are marked ``interpreted``, so
    that ``-m "not interpreted"`` is a quick check."""
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
        params = getattr(item, "callspec", None)
        records = [] if params is None else [params.params.get(name) for name in ("impl", "tiled_impl")]
        if any(r is not None and jax.default_backend() not in r.platforms for r in records):
            item.add_marker(pytest.mark.interpreted)


def _runnable(record: registry.Implementation) -> registry.Implementation:
    """``record``, or a skip where it cannot run here at all (a Mosaic GPU kernel off a
    Hopper GPU)."""
    unable = record.unable(jax.default_backend())
    if unable is not None:
        pytest.skip(unable)
    return record


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda i: i.name)
def impl(request) -> registry.Implementation:
    return _runnable(request.param)


@pytest.fixture(params=TILED, ids=lambda i: i.name)
def tiled_impl(request) -> registry.Implementation:
    return _runnable(request.param)
