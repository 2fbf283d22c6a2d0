"""Programmatic dependent launch (Hopper's PDL), for kernels that run back to back in a CUDA graph.
Day 61.

A kernel launched with `launch_pdl=True` may start while the kernel before it is still running,
as soon as every program of that one has called `griddepcontrol.launch_dependents`. It must then
wait (`griddepcontrol.wait`) before it reads anything its predecessors wrote; what it does before
the wait (address arithmetic, prefetching constant weights) overlaps the predecessor's tail and the
launch gap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton.language as tl
from triton import jit

from nanolab.kernels import INTERPRETED

# Whether the engine's own decode kernels (the streamed read, the rotation with the K/V write)
# launch as programmatic dependents wherever `supports_pdl`. Off outside a compiled step: a
# `runner.DecodeForward` with PDL turns it on for its own calls (`launching_dependents`), with
# inductor's PDL to match; the lab sets it to measure it.
OPS_PDL = False
# Whether those kernels release their dependents (`release_dependents`) as they start, ahead of
# their own wait, instead of as their programs exit: the next kernel is then resident, and can
# prefetch what no kernel writes (a GEMV's weight, `gemv.STEP_L2_AHEAD`), while this one still
# waits or runs. Its wait still returns only once this kernel has finished. Read at each launch
# (`level`).
EARLY_RELEASE = False


@contextlib.contextmanager
def launching_dependents(on: bool) -> Iterator[None]:
    """`OPS_PDL` set to `on` while inside, and put back after. A process-wide setting, as the
    engine runs its steps from one thread."""
    global OPS_PDL
    saved, OPS_PDL = OPS_PDL, on
    try:
        yield
    finally:
        OPS_PDL = saved


@jit
def dependent_launch(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible. Nothing when PDL is 0;
    at level 2 (`level`), release the next kernel first."""
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()


@jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel launch once every program here has passed this point: it can only
    prefetch until it waits in turn, and its wait does not return before this kernel has finished.
    A kernel that never calls it releases the next one as its programs exit."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def level(pdl: bool) -> int:
    """The PDL constexpr of a kernel launched with `pdl`: 0 not a dependent, 1 a dependent that
    waits first, 2 one that releases its own dependents before that wait (`EARLY_RELEASE`)."""
    return 0 if not pdl else 2 if EARLY_RELEASE else 1


def ops_pdl(device: torch.device) -> bool:
    """Whether an op of the engine launches on `device` as a programmatic dependent (`OPS_PDL`)."""
    return OPS_PDL and supports_pdl(device)


def supports_pdl(device: torch.device | str) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents: compiled (not Triton's
    interpreter) on a GPU of compute capability 9.0 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and not INTERPRETED and torch.cuda.get_device_capability(device) >= (9, 0)
