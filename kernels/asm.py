"""What a kernel compiles to, on any machine: Triton's compiler needs no GPU to target one.

On a GPU a launch returns the compiled kernel, whose `.asm` holds each stage of the compile
(Chapter 6, exercise 7). On a laptop or in CI the course's kernels run under the interpreter,
which compiles nothing; `compile_for` asks the same compiler for the same stages, for the GPU
you name:

    from kernels import asm, elementwise
    code = asm.compile_for(elementwise.add_kernel, x, y, out, x.numel(), BLOCK_SIZE=1024)
    asm.opcodes(code["sass"])["LDG"]   # 4: each thread loads 8 of x and 8 of y, 16 bytes a load

It takes the arguments a launch takes, and specializes on them as a launch does (Triton's own
rule: a pointer 16-byte aligned and an integer divisible by 16 are marked so, an integer equal to
1 becomes a constant), so the code is the code that launch would run: tensors on any device
serve, since only their dtypes and addresses matter. The stages are Triton's IR (`ttir`, then
`ttgir` with its layouts), LLVM's (`llir`), PTX (`ptx`), the binary (`cubin`) and its SASS
(`sass`, disassembled by the cuobjdump that Triton ships), the instructions the SMs run.
"""

import contextlib
import inspect
import re
import sys
from collections import Counter

import triton
from triton._C.libtriton import native_specialize_impl  # the launcher's own rule, 3.6 to 3.9
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend

HOPPER = 90  # compute capability 9.0: the H100 and the H200


@contextlib.contextmanager
def _as_compiled():
    """Under the interpreter every @triton.jit function, the course's and Triton's own (tl.sum
    among them), is the interpreter's wrapper, which the compiler cannot call from a kernel.
    While compiling, each module holds the JITFunction it would hold on a GPU instead; yields
    {plain function: its JITFunction}."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without the interpreter
        yield {}
        return
    jitted, swapped = {}, []
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            # type(), not isinstance(): isinstance would ask some objects for their __class__
            if type(value) is InterpretedFunction:
                if value.fn not in jitted:
                    jitted[value.fn] = triton.JITFunction(value.fn, **value.kwargs)
                swapped.append((module.__dict__, name, value))
                module.__dict__[name] = jitted[value.fn]
    try:
        yield jitted
    finally:
        for names, name, value in swapped:
            names[name] = value


def compile_for(kernel, *args, arch=HOPPER, num_warps=4, num_stages=3, **named):
    """Triton's stages of `kernel` (a @triton.jit function, interpreted, autotuned or not) as a
    launch with `args` and the `named` arguments (its constexprs, the tile sizes among them)
    would compile it for a GPU of compute capability `arch` (80: A100, 90: H100/H200).
    Returns a mapping: "ttir", "ttgir", "llir", "ptx", "cubin", "sass" (made when first read)."""
    with _as_compiled() as jitted:
        fn = kernel
        while not isinstance(fn, triton.JITFunction) and hasattr(fn, "fn"):
            fn = jitted.get(fn.fn, fn.fn)  # an autotuner's kernel, or the interpreter's wrapper
        if not isinstance(fn, triton.JITFunction):
            raise TypeError(f"compile_for takes a @triton.jit function, not {kernel!r:.60}")
        return _compile(fn, args, named, arch, num_warps, num_stages)


def _compile(fn, args, named, arch, num_warps, num_stages):
    params = {p.name: p for p in fn.params}
    if len(args) > len(params):
        raise TypeError(f"{fn.__name__} takes {len(params)} arguments, {len(args)} were given")
    given = dict(zip(params, args, strict=False))  # fewer args: the rest by name or default
    for name, value in named.items():
        if name not in params:
            raise TypeError(f"{fn.__name__} has no parameter {name!r} (it has {', '.join(params)})")
        if name in given:
            raise TypeError(f"{fn.__name__} got {name!r} twice, by position and by name")
        given[name] = value
    for name, p in inspect.signature(fn.fn).parameters.items():
        if name not in given and p.default is not p.empty:
            given[name] = p.default
    missing = [name for name in params if name not in given]
    if missing:
        raise TypeError(
            f"{fn.__name__} needs {', '.join(missing)} (a launch would fail the same way)"
        )

    target = GPUTarget("cuda", arch, 32)  # 32 threads a warp
    backend = make_backend(target)
    signature, constants, attrs = {}, {}, {}
    for i, (name, p) in enumerate(params.items()):
        value = given[name]
        if p.is_constexpr:
            signature[name], constants[name] = "constexpr", value
            continue
        try:
            kind, spec = native_specialize_impl(
                type(backend),
                value,
                False,
                not p.do_not_specialize,
                not p.do_not_specialize_on_alignment,
            )
        except Exception as e:  # the launcher's own message for a type it cannot pass
            raise TypeError(f"{fn.__name__}: argument {name!r} = {value!r:.40}: {e}") from None
        signature[name] = kind
        if kind == "constexpr":  # an integer equal to 1, or None
            constants[name] = spec
        elif spec:
            attrs[(i,)] = backend.parse_attr(spec)
    source = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs=constants, attrs=attrs
    )
    # FMA fusion as a launch would have it, stated (Triton 3.9 warns when it is left unset)
    fusion = getattr(getattr(triton, "knobs", None), "language", None)
    options = {"num_warps": num_warps, "num_stages": num_stages,
               "enable_fp_fusion": getattr(fusion, "default_fp_fusion", True)}  # fmt: skip
    return triton.compile(source, target=target, options=options).asm


# an instruction's opcode: PTX's first word ("ld.global.v4.b32" -> "ld"); SASS's after its
# scheduling field (Triton's listing: "--:-:0:-:1<tab>@P0 LDG.E.128 ...") or its address
# (cuobjdump's: "/*0090*/ @P0 LDG.E.128 ...") and an optional predicate -> "LDG"
_PTX_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)[.\s;]", re.M)
_SASS_OP = re.compile(
    r"(?:^[-\w]{2}:[-\w]:[-\w]:[-\w]:\d+\t|/\*[0-9a-f]{4,}\*/)\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)",
    re.M,
)


def opcodes(code: str) -> Counter:
    """How many instructions of each opcode `code` holds, PTX or SASS (as `compile_for` returns
    them), counted as written: an instruction inside a loop counts once."""
    if not isinstance(code, str):
        raise TypeError(
            f"opcodes takes PTX or SASS text, not {type(code).__name__} (the cubin is binary)"
        )
    if _SASS_OP.search(code):
        return Counter(_SASS_OP.findall(code))
    body = code.split(".entry", 1)[-1]  # PTX: skip the module's directives
    return Counter(_PTX_OP.findall(body))
