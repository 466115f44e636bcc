"""Lab 6, LLM inference: its tasks, the cases the grader draws, and the references.

Task 1 is napkin math (kernels.llm.speed's formulas are the reference); task 2 a decode step of
grouped-query attention over a KV cache (the reference: kernels.attention.attention_ref with the
key/value heads repeated, in fp64); task 3 registers the lab's given Triton kernel as a PyTorch
operator: the child runs torch.library.opcheck on it and one call under
torch.compile(fullgraph=True) (any failure is the task's failure), and the grader checks that
call's output; task 4 an int8 weight-only GEMV kernel against kernels.int8.linear_ref in fp64,
and task 5 the same kernel on a GPU: bf16 and fp16 values, then timed against cuBLAS's bf16
matmul of the same shape.
"""

import torch

from kernels import int8
from kernels.attention import attention_ref
from kernels.grader import cases
from kernels.grader.tasks import Case, Task, kernel_task
from kernels.llm import speed
from kernels.llm.config import ModelConfig
from kernels.runtime import DEVICE

NAME = "lab06_llm_inference"
COURSE_NAMES = frozenset(
    {
        "speed",
        "step_bytes",
        "weight_bytes",
        "speed_of_light",
        "gemv",
        "linear_int8",
        "attention_ref",
        "sdpa_attention",
    }
)
MATMUL_OPS = frozenset({"matmul", "mm", "addmm", "linear", "__matmul__", "bmm"})
SHAPES = (  # (n_layers, d_model, d_ff, n_heads, n_kv_heads, head_dim, vocab)
    (30, 576, 1536, 9, 3, 64, 49152), (16, 2048, 8192, 32, 8, 64, 128256),
    (2, 64, 128, 4, 2, 16, 256), (32, 4096, 14336, 32, 8, 128, 128256), (1, 8, 8, 1, 1, 2, 3),
)  # fmt: skip


# Task 1: bytes a step and the speed-of-light line


def decode_napkin_ref(shape, dtype_bytes, context, batch, copy_gbps):
    """[bytes one decoding step reads, steps/s at the copy bandwidth]; a tied head."""
    n_layers, d, f, h, hkv, hd, vocab = shape
    config = ModelConfig(vocab, n_layers, d, f, h, hkv, hd, 1e4, 1e-5)
    nbytes = speed.step_bytes(config, dtype_bytes, context, batch)
    return [nbytes, speed.speed_of_light(copy_gbps, nbytes)]


def _napkin_cases(rng):
    drawn = []
    for i in range(12):
        shape = SHAPES[i % len(SHAPES)]
        args = (shape, rng.choice((1, 2, 4)), rng.choice((0, 1, 512, 4097)), rng.choice((1, 3, 64)),
                round(cases.log_uniform(rng, 100, 5000), 1))  # fmt: skip
        drawn.append(Case(args, label=f"decode_napkin{args}", expected=decode_napkin_ref(*args)))
    return drawn


# Task 2: one decode step of grouped-query attention over a KV cache


def gqa_decode_ref(q, k_cache, v_cache, kv_len: int):
    """q (B, H, hd) attends over the first kv_len positions of k_cache, v_cache (B, Hkv, T,
    hd); head h reads key/value head h // (H // Hkv). fp64 -> (B, H, hd)."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:, :, :kv_len].double().repeat_interleave(group, dim=1)
    v = v_cache[:, :, :kv_len].double().repeat_interleave(group, dim=1)
    return attention_ref(q.double()[:, :, None], k, v)[:, :, 0]


def _gqa_cases(rng):
    drawn = []
    for b, h, hkv, t, kv_len, hd in ((1, 9, 3, 40, 17, 64), (3, 4, 4, 8, 8, 16),
                                     (2, 8, 1, 130, 129, 32), (4, 6, 2, 5, 1, 8)):  # fmt: skip
        for dtype in (torch.float32, torch.float16):
            q, seed = cases.draw(rng, (b, h, hd), dtype)
            k = cases.tensor((b, hkv, t, hd), seed + 1, dtype)
            v = cases.tensor((b, hkv, t, hd), seed + 2, dtype)
            label = (f"q {tuple(q.shape)}, cache {tuple(k.shape)}, kv_len {kv_len}, "
                     f"{cases.dtype_name(dtype)}, seed {seed}")  # fmt: skip
            ref = gqa_decode_ref(q, k, v, kv_len)
            drawn.append(Case((q, k, v, kv_len), label=label, expected=ref, dtype=dtype))
    return drawn


# Task 3: the given kernel as an operator


def silu_mul_ref(gate, up):
    """SwiGLU's middle: silu(gate) * up, in fp64."""
    g = gate.double()
    return g * torch.sigmoid(g) * up.double()


def _operator_cases(rng):
    drawn = []
    for shape, dtype in (
        ((3, 129), torch.float32),
        ((1, 1000), torch.float16),
        ((7,), torch.float32),
    ):
        gate, seed = cases.draw(rng, shape, dtype)
        up = cases.tensor(shape, seed + 1, dtype)
        label = cases.label(gate, dtype, seed)
        drawn.append(Case((gate, up), label=label, expected=silu_mul_ref(gate, up), dtype=dtype,
                          action="operator"))  # fmt: skip
    return drawn


# Task 4: an int8 weight-only GEMV


def _quantized(shape, seed):
    """int8.quantize of fresh values, made on the kernels' device (which quantize checks),
    returned to the grader's CPU like every other input."""
    q, scale = int8.quantize(cases.tensor(shape, seed).to(DEVICE))
    return q.cpu(), scale.cpu()


def _int8_case(rng, shape, dtype, strided=False):
    """x (m, k) @ int8 (n, k).T against fp64; strided: x as every other element of a wider row."""
    m, n, k = shape
    x, seed = cases.draw(rng, (m, k), dtype)
    q, scale = _quantized((n, k), seed + 1)
    how = ", non-contiguous," if strided else ""
    label = f"x ({m}, {k}){how} @ int8 ({n}, {k}).T, {cases.dtype_name(dtype)}, seed {seed}"
    ref = int8.linear_ref(x.double(), q, scale.double())
    x = cases.strided(x) if strided else x
    return Case((x, q, scale), label=label, expected=ref, dtype=dtype)


def _int8_cases(rng):
    drawn = []
    for shape in ((1, 129, 127), (1, 1000, 64), (3, 65, 300), (16, 33, 129)):
        drawn += [_int8_case(rng, shape, dtype) for dtype in (torch.float32, torch.float16)]
    return drawn + [_int8_case(rng, (3, 65, 300), torch.float16, strided=True)]


# On a GPU: bf16 and fp16 values, then the speed of a decoding step's GEMV. TIMED's int8 weight
# is 59 MB, half the bytes of the bf16 weight cuBLAS reads for the same product: a kernel that
# streams its weight at more than half of cuBLAS's bandwidth is faster. The solution's kernel
# (16 x 512 tiles, no tensor cores) passed the timed case on an H100 (torch 2.11, triton 3.6)
# and is yet to be timed on the H200; the threshold is the one the course sets for this kernel
# (faster than cuBLAS), not a fraction calibrated on the solution.
TIMED = (1, 14336, 4096)  # (M, N, K): a llama MLP's gate projection at one token
MIN_DENSE_FRACTION = 1.0
GPU_SHAPES = ((1, 1000, 4096), (16, 257, 1000), (64, 129, 300), (1, 14336, 64))


def timed_int8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """The timed case's int8 weight (n, k), made in the child: too large to send."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)


def _int8_gpu_cases(rng):
    drawn = []
    for dtype in (torch.bfloat16, torch.float16):
        drawn += [_int8_case(rng, shape, dtype) for shape in GPU_SHAPES]
    drawn.append(_int8_case(rng, (16, 257, 1000), torch.bfloat16, strided=True))
    m, n, k = TIMED
    seed = cases.new_seed(rng)
    weight = {"builder": "kernels.grader.lab06:timed_int8_weight",
              "kwargs": {"n": n, "k": k, "seed": seed}}  # fmt: skip
    x, scale = (
        cases.big_random(rng, (m, k), torch.bfloat16),
        cases.big_random(rng, (n,), torch.float32),
    )
    timed = cases.timed(
        (x, weight, scale),
        f"x ({m}, {k}) @ int8 ({n}, {k}).T, bfloat16, timed",
        against="dense_weight",
        min_fraction=MIN_DENSE_FRACTION,
        why="the int8 weight is half the bytes of the bfloat16 one cuBLAS reads",
        rate=lambda ms: f"{n * k / (ms * 1e6):.0f} GB/s of int8 weight read",
    )
    return drawn + [timed]


TASKS = [
    Task(
        name="decode_napkin",
        function="decode_napkin",
        points=2,
        summary="bytes one decoding step reads and its speed-of-light steps/s",
        hint="every weight once (a tied head: the embedding once), and batch * context KV "
        "positions",
        cases=_napkin_cases,
        check=cases.numbers(("bytes", "steps_per_s")),
        forbidden_names=COURSE_NAMES,
    ),
    Task(
        name="gqa_decode",
        function="gqa_decode",
        points=3,
        summary="one decode step of grouped-query attention over a KV cache, fp32 and fp16",
        hint="query head h uses key/value head h // (H // Hkv); only the first kv_len positions",
        cases=_gqa_cases,
        check=cases.values("attention"),
        forbidden_ops=frozenset({"scaled_dot_product_attention"}),
        forbidden_names=COURSE_NAMES,
    ),
    Task(
        name="silu_mul_operator",
        function="make_silu_mul",
        points=3,
        summary="the given kernel as a torch.library operator: opcheck, then "
        "torch.compile(fullgraph=True)",
        hint="torch.library.custom_op with mutates_args=(), and a register_fake that only "
        "allocates",
        cases=_operator_cases,
        check=cases.values("elementwise"),
        time_limit=180.0,  # opcheck and a compile
    ),
    kernel_task(
        name="int8_gemv",
        function="int8_gemv",
        points=3,
        summary="x @ (q * scale[:, None]).T, the int8 weight dequantized in a Triton kernel",
        hint="load an int8 tile, convert it to x's dtype, accumulate in fp32, scale once at the end",  # noqa: E501
        cases=_int8_cases,
        check=cases.values("matmul"),
        forbidden_ops=MATMUL_OPS,
        forbidden_names=COURSE_NAMES,
    ),
    kernel_task(
        name="int8_gemv_gpu",
        function="int8_gemv",
        points=2,
        summary="on a GPU: bf16 and fp16 values, and faster than cuBLAS's bf16 matmul at "
        f"M = {TIMED[0]}, N = {TIMED[1]}, K = {TIMED[2]}",
        hint="many programs in flight (a narrow BLOCK_N) each loading long rows (a deep "
        "BLOCK_K): 16 x 512 int8 is 8 KB a load",
        cases=_int8_gpu_cases,
        check=cases.values("matmul"),
        forbidden_ops=MATMUL_OPS,
        forbidden_names=COURSE_NAMES,
        needs_gpu=True,
        exclusive=True,
        time_limit=180.0,  # compiles the kernel for each dtype, then times a 59 MB weight
    ),
]
