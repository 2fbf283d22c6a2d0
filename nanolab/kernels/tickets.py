"""Ticket counters for kernels whose last program to finish a piece of work folds it: a split
read's shares (`paged_attention`'s "split" variant)."""

from __future__ import annotations

import torch

# Per device, every ticket buffer handed out, newest last. None is ever dropped: a captured graph
# keeps the address it was captured with.
_TICKETS: dict[torch.device, list[torch.Tensor]] = {}


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 tickets on `device`, all 0 between launches: the program that takes a
    piece's last ticket puts it back. Kernels that use them run one at a time on the device's
    stream (a programmatic dependent takes none before its wait), so they share the buffer."""
    held = _TICKETS.setdefault(device, [])
    if not held or held[-1].numel() < n:
        held.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return held[-1]
