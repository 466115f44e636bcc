"""Out-of-bounds accesses under Triton's interpreter: a clear error, not a crash.

On a GPU, a load or store past the end of a tensor reads or overwrites whatever memory lies
there; sometimes the launch fails with "an illegal memory access", often nothing shows. Triton's
interpreter does the same with raw host pointers, so a missing mask may crash the process, corrupt
the heap (a `std::bad_alloc` later) or pass unnoticed, depending on what the allocator put next
to the tensor. In CPU mode the course checks every access that its mask lets through: its
elements must lie inside one tensor argument of the launch (a view may reach all of its storage),
or the launch stops, before the access, with an error that names the operation, the tensor and
how far outside it the access went.
"""

import numpy as np
from triton.runtime import interpreter

# The storages of the tensor arguments of the launch running now (the interpreter runs one at a
# time), sorted by address: each one's argument name, first byte and one past its last byte.
_NAMES: list[str] = []
_STARTS = np.zeros(0, dtype=np.int64)
_ENDS = np.zeros(0, dtype=np.int64)


def _tensors(name, value):
    """(name, tensor) for a launch argument: tensors, tuples of them, descriptors' bases."""
    if isinstance(value, tuple):
        for i, item in enumerate(value):
            yield from _tensors(f"{name}[{i}]", item)
    elif hasattr(value, "base") and hasattr(value, "block_shape"):  # a TensorDescriptor
        yield from _tensors(name, value.base)
    elif hasattr(value, "untyped_storage"):
        yield name, value


def _record(arg_names, args, kwargs) -> None:
    """Keep the storages the launch may touch (a view may reach all of its storage), once per
    launch: every access of the launch is checked against them."""
    global _NAMES, _STARTS, _ENDS
    named = [*zip(arg_names, args, strict=False), *kwargs.items()]  # fewer args: keywords
    spans = {}
    for name, value in named:
        for label, tensor in _tensors(name, value):
            storage = tensor.untyped_storage()
            start = storage.data_ptr()
            if start and start not in spans:
                spans[start] = (label, start, start + storage.nbytes())
    ordered = sorted(spans.values(), key=lambda span: span[1])
    _NAMES = [span[0] for span in ordered]
    _STARTS = np.array([span[1] for span in ordered], dtype=np.int64)
    _ENDS = np.array([span[2] for span in ordered], dtype=np.int64)


def _nearest(address: int) -> int:
    """The argument whose storage lies closest to `address` (before it or after it), for an
    access with no element inside any argument."""
    return int(np.argmin(np.where(address < _STARTS, _STARTS - address, address - _ENDS)))


def check(operation: str, pointers, mask, element_bytes: int) -> None:
    """Raise IndexError if an element that `mask` lets through lies outside the tensor argument
    the access reaches into."""
    if not _NAMES:
        return
    addresses = np.asarray(pointers, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask, dtype=bool), addresses.shape)]
    addresses = addresses.reshape(-1).astype(np.int64)
    if addresses.size == 0:
        return
    owner = np.searchsorted(_STARTS, addresses, side="right") - 1
    inside = (owner >= 0) & (addresses + element_bytes <= _ENDS[np.maximum(owner, 0)])
    # One access reaches into one tensor (its pointers are one base plus offsets): the tensor
    # most of its elements fall in, so that running past x into the tensor allocated after it
    # is caught too.
    home = int(np.bincount(owner[inside]).argmax()) if inside.any() else None
    if home is not None:
        inside &= owner == home
    if inside.all():
        return
    outside = addresses[~inside]
    first = int(outside[0])
    span = home if home is not None else _nearest(first)
    name, start, end = _NAMES[span], int(_STARTS[span]), int(_ENDS[span])
    element, count = (first - start) // element_bytes, (end - start) // element_bytes
    where = "before the start of" if first < start else "past the end of"
    raise IndexError(
        f"{operation} {where} {name}: element {element}, where it has {count} "
        f"({outside.size} of this access's {addresses.size} elements outside it). Mask it "
        "(for example mask=offsets < n_elements, on the load and on the store): on a GPU it "
        "reads or overwrites other memory, often without an error"
    )


def install() -> None:
    """Check the interpreter's loads, stores and atomics (CPU mode only: kernels.runtime)."""
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(builder, "_course_bounds", False):
        return
    init_args = executor._init_args_hst

    def init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        _record(self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store
    atomic_rmw, atomic_cas = builder.create_atomic_rmw, builder.create_atomic_cas

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        check("tl.load", ptrs.data, mask.data, _element_bytes(ptrs))
        return masked_load(self, ptrs, mask, other, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        check("tl.store", ptrs.data, mask.data, _element_bytes(ptrs))
        return masked_store(self, ptrs, value, mask, cache_policy)

    def create_atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope):
        check("an atomic", ptr.data, mask.data, _element_bytes(ptr))
        return atomic_rmw(self, rmw_op, ptr, val, mask, sem, scope)

    def create_atomic_cas(self, ptr, cmp, val, sem, scope):
        check("tl.atomic_cas", ptr.data, None, _element_bytes(ptr))
        return atomic_cas(self, ptr, cmp, val, sem, scope)

    executor._init_args_hst = init_args_hst
    builder.create_masked_load, builder.create_masked_store = (
        create_masked_load,
        create_masked_store,
    )
    builder.create_atomic_rmw, builder.create_atomic_cas = create_atomic_rmw, create_atomic_cas
    builder._course_bounds = True


def _element_bytes(pointers) -> int:
    return np.dtype(interpreter._get_np_dtype(pointers.get_element_ty())).itemsize
