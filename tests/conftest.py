"""The implementations under test and what each one declares it can do.

Every test that is about "an implementation" takes the ``impl`` fixture and runs once per
entry of `IMPLEMENTATIONS`; capabilities decide which tests apply, never a copy of a test.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest


@dataclasses.dataclass(frozen=True)
class Implementation:
    """An implementation and its declared capabilities.

    tiled: O(N) memory and skips tiles the mask hides (all but the reference).
    pallas: a Pallas kernel; blocks must be powers of two >= 16, and off-GPU it runs in
      interpret mode (slow, so tests keep shapes small).
    """

    name: str
    tiled: bool = True
    pallas: bool = False


IMPLEMENTATIONS = (
    Implementation("reference", tiled=False),
    Implementation("scan_v1"),
    Implementation("scan_v2"),
    Implementation("pallas_v1", pallas=True),
    Implementation("pallas_v2", pallas=True),
)
TILED = tuple(i for i in IMPLEMENTATIONS if i.tiled)

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=IMPLEMENTATIONS, ids=lambda i: i.name)
def impl(request) -> Implementation:
    return request.param


@pytest.fixture(params=TILED, ids=lambda i: i.name)
def tiled_impl(request) -> Implementation:
    return request.param
