"""Programmatic dependent launch (Hopper's PDL), for kernels that run back to back in a CUDA graph.

A kernel launched with `launch_pdl=True` may start while the kernel before it is still running,
as soon as every program of that one has called `griddepcontrol.launch_dependents`. It must then
wait (`griddepcontrol.wait`) before it reads anything its predecessors wrote; what it does before
the wait (address arithmetic, prefetching constant weights) overlaps the predecessor's tail and the
launch gap.

Whether the engine's own ops (the streamed read, the rotation with the K/V write, the step's GEMV)
launch that way is scoped state, not a global: a compiled step with PDL (`runner.DecodeForward`)
runs its calls inside `launching_dependents(True)`, and each op asks `ops_pdl(device)` as it
launches. Outside such a call they launch plainly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import triton.language as tl
from triton import jit

from nanolab.kernels import INTERPRETED

_LAUNCHING_DEPENDENTS: ContextVar[bool] = ContextVar("nanolab.ops_pdl", default=False)


@contextlib.contextmanager
def launching_dependents(on: bool) -> Iterator[None]:
    """While inside, the engine's ops launch as programmatic dependents when `on` (where the device
    supports it, `ops_pdl`), and plainly when not; what held before comes back on exit."""
    token = _LAUNCHING_DEPENDENTS.set(bool(on))
    try:
        yield
    finally:
        _LAUNCHING_DEPENDENTS.reset(token)


def ops_pdl(device: torch.device) -> bool:
    """Whether an op of the engine launches on `device` as a programmatic dependent: inside
    `launching_dependents(True)`, on a device that `supports_pdl`."""
    return _LAUNCHING_DEPENDENTS.get() and supports_pdl(device)


@jit
def dependent_launch(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible. Nothing without PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch once every program here has passed this point: it can only
    prefetch until it waits in turn, and its wait does not return before this kernel has finished.
    A kernel that never calls it releases the next one as its programs exit."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def supports_pdl(device: torch.device | str) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents: compiled (not Triton's
    interpreter) on a GPU of compute capability 9.0 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (9, 0)
