"""mosaic_v3's kernels on the CPU, through jax's Mosaic GPU interpreter.

jax 0.10.2 ships an interpreter for Pallas Mosaic GPU kernels
(`jax._src.pallas.mosaic_gpu.interpret`): each warpgroup runs as a host thread, and
shared memory, TMA copies and mbarriers are simulated, so a kernel's synchronisation
runs as written. It does not yet take everything jaxtile's kernels use; `interpreted`
fills those gaps for one test, and puts everything back after it:

* ``pl.run_state`` over ``wgmma`` accumulators (`backward._products`): discharged as the
  Mosaic GPU lowering discharges it, and the functional ``wgmma`` that leaves evaluated;
* ``wgmma`` with its left operand in registers (``P V``) or an operand transposed
  (``Q Kᵀ``), and ``plgpu.load`` (`_ring.load_stat`); ``plgpu.layout_cast`` is the
  identity here;
* shared memory sliced at traced offsets (``pl.ds(row0, block_q)``), which it refuses
  though the offsets are concrete where it reads them;
* ``plgpu.RefUnion`` as separate allocations (its members may share memory, and a
  kernel never reads one member through another);
* barriers freed with phases no thread waited for: a producer need not wait for its
  ring's last frees, and mbarriers require nothing of phases no one waits for;
* TMA copies that read past the end of global memory (the forward's last key tile):
  TMA fills what lies past the end with zeros, as ``plgpu.copy_gmem_to_smem`` asks by
  default (``OOBFillMode.ZEROS``), where the interpreter raises. Every other read past
  the end still raises.

Outside the interpreter, a call runs unpartitioned (``custom_partitioning`` cannot
carry the interpreter's ordered callbacks) and mosaic_v3's record lets it run on the
CPU. The interpreter's threads block on each other inside CPU computations, more of them
at once than a 2-core machine's CPU client has threads: ``conftest`` gives its pool 16
and turns off asynchronous CPU dispatch, before the backend starts.

Written against jax 0.10.2's interpreter (what CI installs); `UNAVAILABLE` says why the
tests skip elsewhere (on the GPU image's jax 0.11.2, the GPU tests run the kernels).
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.state import discharge, indexing
from jax._src.state import types as state_types
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtile import registry
from jaxtile.distributed import _sharding

VERSION = (0, 10, 2)
UNAVAILABLE = None if jax.__version_info__ == VERSION else f"written against jax {VERSION}'s interpreter"
if UNAVAILABLE is None:
    from jax._src.pallas.mosaic_gpu import core as gpu_core
    from jax._src.pallas.mosaic_gpu import primitives as gpu_primitives
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, jaxpr_interpret, shared_memory
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params

    _ONE_EQUATION = jax_core.DebugInfo("mosaic_interpreter", "one equation", None, None)


def _transformed(ref_aval, transforms) -> jax_core.ShapedArray:
    """The array a ref's aval holds once ``transforms`` apply."""
    aval = ref_aval.inner_aval
    for transform in transforms:
        aval = transform.transform_type(aval)
    return aval


def _read(interpreter, eqn, token, key, transforms, aval):
    """``(token, value)`` of the ref ``key`` under ``transforms`` (read as ``aval``), through
    the interpreter's own read; transposes apply to the value read."""
    permutations = [t.permutation for t in transforms if isinstance(t, state_types.TransposeTransform)]
    indexers = tuple(t for t in transforms if not isinstance(t, state_types.TransposeTransform))
    shape = aval.shape
    for permutation in reversed(permutations):
        shape = tuple(shape[i] for i in np.argsort(permutation))
    token, value = gpu_callbacks.call_get(
        token=token,
        result_shape_and_dtype=jax_core.ShapedArray(shape, aval.dtype),
        device_id=jnp.int32(interpreter.device_info.device_id),
        grid_point_coords=interpreter.grid_point_coords,
        thread_id=interpreter.thread_id,
        allocation_key_as_array=key,
        transforms=indexers,
        source_info=eqn.source_info,
    )
    for permutation in permutations:
        value = jnp.transpose(value, permutation)
    return token, value


def _wgmma(interpreter, eqn, token, acc, a, b, *leaves):
    """``(token, acc + a @ b)`` in float32, ``a`` a value or a ref, ``b`` a ref."""
    params, empty = eqn.params, jax.tree.structure([])
    trees = [params[f"{name}_transforms_tree"] or empty for name in ("acc", "a", "b")]
    _, a_transforms, b_transforms = jax.tree.unflatten(jax.tree_util.treedef_tuple(trees), leaves)
    a_aval, b_aval = eqn.invars[1].aval, eqn.invars[2].aval
    if isinstance(a_aval, state_types.AbstractRef):
        token, a = _read(interpreter, eqn, token, a, a_transforms, _transformed(a_aval, a_transforms))
    token, b = _read(interpreter, eqn, token, b, b_transforms, _transformed(b_aval, b_transforms))
    return token, acc + jnp.matmul(a, b, preferred_element_type=jnp.float32)


def _wgmma_into(interpreter, eqn, token, key, *operands):
    """``wgmma`` into an accumulator ref: read, add the product, write back."""
    aval = eqn.invars[0].aval.inner_aval
    token, acc = _read(interpreter, eqn, token, key, (), aval)
    token, acc = _wgmma(interpreter, eqn, token, acc, *operands)
    token, _ = gpu_callbacks.call_swap(
        token=token,
        result_shape_and_dtype=aval,
        device_id=jnp.int32(interpreter.device_info.device_id),
        grid_point_coords=interpreter.grid_point_coords,
        thread_id=interpreter.thread_id,
        allocation_key_as_array=key,
        transforms=(),
        val=acc.astype(aval.dtype),
        mask=None,
        source_info=eqn.source_info,
    )
    return token


def _run_state(interpreter, eqn, token, *refs):
    """``pl.run_state``: its accumulators (and values) discharged, as Mosaic GPU lowers it;
    refs it closes over stay refs."""
    body = eqn.params["jaxpr"]
    discharged = [
        isinstance(var.aval, gpu_core.WGMMAAbstractAccumulatorRef) or not isinstance(out.aval, state_types.AbstractRef)
        for var, out in zip(body.invars, eqn.outvars)
    ]
    closed = discharge.discharge_state(jax_core.ClosedJaxpr(body, ()), should_discharge=discharged)
    token, finals = interpreter.interpret(closed.jaxpr, token, *closed.consts, *refs)
    finals = iter(finals)
    return token, [next(finals) if d else ref for d, ref in zip(discharged, refs)]


def _interpret(original):
    """The interpreter's ``interpret``, taking the primitives above itself and handing it
    every other equation one at a time."""

    def interpret(self, jaxpr, token, *args):
        env = dict(zip(jaxpr.constvars + jaxpr.invars, args))

        def read(var):
            return var.val if isinstance(var, jax_core.Literal) else env[var]

        for eqn in jaxpr.eqns:
            invals, primitive = [read(var) for var in eqn.invars], eqn.primitive
            if primitive is discharge.run_state_p:
                token, outs = _run_state(self, eqn, token, *invals)
            elif primitive is gpu_primitives.wgmma_p:
                token, out = _wgmma(self, eqn, token, *invals)
                outs = [out]
            elif primitive is gpu_primitives.wgmma_ref_p:
                token, outs = _wgmma_into(self, eqn, token, *invals), []
            elif primitive is gpu_primitives.load_p:
                ref, *leaves = invals
                transforms = tuple(eqn.params["tree"].unflatten(leaves))
                token, out = _read(self, eqn, token, ref, transforms, eqn.outvars[0].aval)
                outs = [out]
            elif primitive is gpu_core.layout_cast_p or (
                primitive is gpu_primitives.wgmma_accumulator_deref_p
                and not isinstance(eqn.invars[0].aval, state_types.AbstractRef)  # discharged
            ):
                outs = invals[:1]
            else:
                variables = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, jax_core.Literal)))
                single = jax_core.Jaxpr([], variables, eqn.outvars, [eqn], eqn.effects, _ONE_EQUATION)
                token, outs = original(self, single, token, *map(read, variables))
            env.update(zip(eqn.outvars, outs))
        return token, [read(var) for var in jaxpr.outvars]

    return interpret


def _indexers_only(transforms):
    for transform in transforms:
        if not isinstance(transform, indexing.NDIndexer):
            raise ValueError(f"Unsupported transform: {transform}")


def _free(barrier):
    with barrier.cv:
        barrier.ref_count -= 1


_copying = threading.local()  # set while this thread runs a TMA copy (`_zero_filled`)


def _copy(execute):
    """A TMA copy's ``execute``, run with `_copying` set."""

    def run(self, token):
        _copying.on = True
        try:
            return execute(self, token)
        finally:
            _copying.on = False

    return run


def _zero_filled(handle):
    """The interpreter's read past the end of a buffer: zeros past it inside a TMA copy
    (``ret`` holds what lies inside), ``handle``'s error elsewhere."""

    def read(ret, full_read_shape, shape, dtype, *args):
        if not getattr(_copying, "on", False):
            return handle(ret, full_read_shape, shape, dtype, *args)
        zeros = np.zeros(full_read_shape, dtype)
        if ret is not None:
            zeros[tuple(slice(n) for n in ret.shape)] = ret
        return zeros

    return read


@contextlib.contextmanager
def interpreted(monkeypatch, detect_races: bool = False):
    """Runs Mosaic GPU kernels traced inside it on the CPU, with the gaps above filled, on a
    fresh simulated GPU (a failed call leaves the interpreter's state behind); with
    ``detect_races``, the interpreter's happens-before race detector watches every read
    and write of shared and global memory (`races_found`). ``monkeypatch``: pytest's,
    which undoes the patches after the test."""
    interpreter = jaxpr_interpret.JaxprInterpreter
    monkeypatch.setattr(interpreter, "interpret", _interpret(interpreter.interpret))
    monkeypatch.setattr(gpu_callbacks, "_validate_transforms", _indexers_only)
    monkeypatch.setattr(shared_memory.Barrier, "deallocate", _free)
    transfer = gpu_callbacks.DeviceLocalMemoryTransfer
    monkeypatch.setattr(transfer, "execute", _copy(transfer.execute))
    monkeypatch.setattr(
        gpu_callbacks, "_handle_out_of_bounds_read", _zero_filled(gpu_callbacks._handle_out_of_bounds_read)
    )
    monkeypatch.setattr(plgpu, "RefUnion", lambda *members: members)
    monkeypatch.setattr(_sharding, "_per_shard", lambda fun, _args, _results, args, config: fun(*args, config))
    unable = registry.Implementation.unable
    monkeypatch.setattr(
        registry.Implementation, "unable", lambda self, p: None if self.family == "mosaic" else unable(self, p)
    )
    gpu_callbacks.reset_gpu_interpret_mode_state()
    jax.clear_caches()  # kernels traced for the GPU, or before the patches, are not reused
    try:
        with interpret_params.force_gpu_interpret_mode(interpret_params.InterpretGPUParams(detect_races=detect_races)):
            yield
    finally:
        jax.clear_caches()


def races_found() -> bool:
    """Whether the race detector saw a race in a kernel run since `interpreted` began."""
    return gpu_callbacks.get_races().races_found
