"""Arrival counters: how a kernel cut into pieces finishes its own work without a second launch.

A split kernel (kernels.split_k's pieces of K, the split-KV attention's pieces of the keys)
leaves partial results that must be combined in a fixed order. A second kernel can do it, at
the price of a launch (on a decode step of a small model, about as long as the work). Instead,
each program stores its partial, then adds 1 to its tile's counter (an atomic with
acquire-release order, after a barrier: every thread's partial is out before the count), and
the program that finds it was the last combines every piece of the tile in the same fixed
order as the second kernel would (so the same bits, whatever order the pieces arrived in), and
sets the counter back to 0 for the next launch. Nothing waits; no order depends on timing.

One buffer of counters per device, zeroed once and shared by every launch: launches on one
stream follow each other, so each finds its counters at 0. Two streams running such kernels at
the same time would share counters: the course runs them on one stream.
"""

import torch
import triton
import triton.language as tl

SIZE = 1 << 20  # counters per device (4 MB): a launch with more tiles takes the second kernel

_buffers: dict = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's zeroed int32 counters if `tiles` of them are available, else None (more
    than SIZE tiles, or the first use inside a CUDA graph capture, where a buffer made during
    the capture would belong to the graph): the caller then launches its combining kernel."""
    if tiles > SIZE:
        return None
    buffer = _buffers.get(device)
    if buffer is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffer = _buffers[device] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return buffer


@triton.jit
def last_to_arrive(count_ptr, tile, pieces):
    """In a kernel, after a program has stored its piece of `tile`: True in the last of the
    tile's `pieces` programs to get here, which also sets the tile's counter back to 0 for
    the next launch (every other piece has counted already)."""
    tl.debug_barrier()  # every thread's stores are out before the count
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    last = arrived == pieces - 1
    tl.atomic_xchg(count_ptr + tile, 0, mask=last)
    return last
