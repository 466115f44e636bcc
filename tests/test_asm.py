"""kernels.asm: a kernel's PTX and SASS for a GPU this machine may not have."""

from pathlib import Path

import pytest
import torch
import triton

from kernels import asm, elementwise, matmul
from kernels.runtime import DEVICE

pytestmark = pytest.mark.skipif(
    not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists(),
    reason="this Triton ships no ptxas (its Linux wheels do): nothing here can compile for a GPU",
)


def add_code(n=4096, offset=0, **options):
    x = torch.randn(n + offset, device=DEVICE)[offset:]
    return asm.compile_for(
        elementwise.add_kernel, x, x, torch.empty(n, device=DEVICE), n, BLOCK_SIZE=1024, **options
    )


def test_add_compiles_for_hopper_and_loads_16_bytes_at_a_time_when_aligned():
    code = add_code()
    assert ".target sm_90" in code["ptx"]
    assert "ld.global.v4.b32" in code["ptx"]  # four fp32 a load: the pointer is 16-byte aligned
    ops = asm.opcodes(code["sass"])
    assert ops["LDG"] >= 2 and ops["STG"] >= 1 and ops["FADD"] >= 4


def test_it_specializes_on_the_arguments_as_a_launch_does():
    """A view one element in is not 16-byte aligned, and 4095 is not a multiple of 16."""
    aligned, shifted = add_code(), add_code(n=4095, offset=1)

    def divisible(code):  # the parameters the compiler may assume 16-divisible
        header = next(line for line in code["ttir"].splitlines() if "tt.func public" in line)
        return [p.split(":")[0] for p in header.split("%")[1:] if "tt.divisibility = 16" in p]

    assert divisible(aligned) == ["x_ptr", "y_ptr", "out_ptr", "n_elements"]
    assert divisible(shifted) == ["out_ptr"]
    assert "ld.global.v4" not in shifted["ptx"] and "ld.global.b32" in shifted["ptx"]
    assert asm.opcodes(shifted["sass"])["LDG"] > asm.opcodes(aligned["sass"])["LDG"]


def matmul_launch(n, block_m, block_n, block_k):
    """The arguments of one launch of kernels.matmul's kernel on n x n fp16 operands."""
    a = torch.randn(n, n, device=DEVICE, dtype=torch.float16)
    args = (a, a, torch.empty_like(a), a, n, n, n, *a.stride(), *a.stride(), *a.stride())
    flags = dict(HAS_BIAS=False, ACTIVATION="none", INPUT_PRECISION="ieee", GROUP_M=8)
    return args, dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def test_a_matmul_uses_wgmma_on_hopper_and_mma_before_it():
    args, meta = matmul_launch(256, 128, 128, 64)
    hopper = asm.opcodes(asm.compile_for(matmul.matmul_kernel, *args, **meta, num_warps=8)["sass"])
    ampere = asm.opcodes(
        asm.compile_for(matmul.matmul_kernel, *args, **meta, arch=80, num_warps=8)["sass"]
    )
    assert hopper["HGMMA"] > 0 and hopper["HMMA"] == 0
    assert ampere["HMMA"] > 0 and ampere["HGMMA"] == 0


def test_the_interpreter_keeps_its_kernels_after_a_compile():
    before = type(elementwise.add_kernel)
    add_code()
    assert type(elementwise.add_kernel) is before
    x = torch.arange(37.0, device=DEVICE)
    torch.testing.assert_close(elementwise.add(x, x), 2 * x)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.ones(4),), {"BLOCK_SIZE": 8}, "add_kernel needs y_ptr, out_ptr, n_elements"),
        ((torch.ones(4),) * 3 + (4,), {"BLOCK": 8}, "has no parameter 'BLOCK'"),
        ((torch.ones(4),) * 3 + (4, 8, 9), {}, "takes 5 arguments, 6 were given"),
        ((torch.ones(4),) * 3 + (4,), {"n_elements": 4, "BLOCK_SIZE": 8}, "got 'n_elements' twice"),
        ((torch.ones(4),) * 3 + ("four",), {"BLOCK_SIZE": 8}, "argument 'n_elements' = 'four'"),
    ],
)
def test_bad_arguments_name_what_is_wrong(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        asm.compile_for(elementwise.add_kernel, *args, **kwargs)


def test_only_a_triton_kernel_compiles():
    with pytest.raises(TypeError, match="takes a @triton.jit function"):
        asm.compile_for(elementwise.add, torch.ones(4), torch.ones(4))


def test_opcodes_counts_ptx_and_both_sass_listings():
    ptx = (
        ".visible .entry k(\n.reg .b32 %r<4>;\n\t@%p1 ld.global.v4.b32 { %r1 }, [ %rd1 + 0 ];\n"
        "\tcvt.rn.f32.s8 %f1, %rs1;\n\tcvt.u32.u16 %r2, %rs2;\n$L__BB0_1:\n\tret;\n}"
    )
    assert asm.opcodes(ptx) == {"ld": 1, "cvt": 2, "ret": 1}
    triton_listing = (
        "Function:k\n--:-:-:-:1\tLDC R1, c[0x0][0x28];\n"
        "01:-:-:Y:2\t@!P0 LDG.E.128 R4, desc[UR4][R2.64];\n.L_x_0:\n--:-:-:-:1\tEXIT;"
    )
    assert asm.opcodes(triton_listing) == {"LDC": 1, "LDG": 1, "EXIT": 1}
    cuobjdump = (
        "        /*0090*/                   @P0 HMMA.16816.F32 R4, R8, R12, R4 ;\n"
        "        /*00a0*/                   EXIT ;"
    )
    assert asm.opcodes(cuobjdump) == {"HMMA": 1, "EXIT": 1}
    with pytest.raises(TypeError, match="not bytes"):
        asm.opcodes(b"\x7fELF")


def test_an_autotuned_kernel_compiles_with_the_tile_given():
    args, meta = matmul_launch(64, 64, 64, 32)
    code = asm.compile_for(matmul.matmul_kernel_autotuned, *args, **meta)
    assert asm.opcodes(code["sass"])["HGMMA"] > 0
