"""Chapter 6's measurements of decoding: the napkin math (bytes and FLOPs a step, the
speed-of-light line, the batch where decode turns compute-bound), and the timers behind each
numbered version (eager, CUDA graph, torch.compile), the kernels-per-step count and the batch
sweep. Shapes: B batch, T context (the keys a step reads).

A decoding step reads every weight once (whatever B) and each row's KV cache (B * T positions),
and does 2 FLOPs per weight per row plus attention's 4 * T * H * hd per layer and row. Its time
is at least max(bytes / bandwidth, FLOPs / peak): the roofline of one step.

Timed steps decode at one fixed position (T - 1 of a cache of T): every step then does the same
work, as the T-th step of a real decode does, and a CUDA graph captured once replays it.
"""

import contextlib
import time

import torch

from kernels import decode, int8, runtime
from kernels.bench import rotating_copies
from kernels.llm import ops
from kernels.llm.config import ModelConfig, get_config
from kernels.llm.model import fusions

# --- napkin math: bytes and FLOPs of one decoding step


def matmul_params(config) -> int:
    """Weights a token multiplies by: every linear layer and the head (not the norms, not the
    embedding lookup, which reads one row)."""
    c = get_config(config)
    d, hd = c.d_model, c.head_dim
    layer = d * c.n_heads * hd * 2 + d * c.n_kv_heads * hd * 2 + 3 * d * c.d_ff
    return c.n_layers * layer + c.vocab_size * d


def weight_bytes(config, dtype_bytes: int, int8: bool = False) -> int:
    """Bytes of weight one step reads: the matmul weights (int8: 1 byte each plus a 4-byte
    scale per output channel) and the norms in the float dtype."""
    c = get_config(config)
    norms = (2 * c.n_layers + 1) * c.d_model * dtype_bytes
    if not int8:
        return matmul_params(c) * dtype_bytes + norms
    d, hd = c.d_model, c.head_dim
    rows = c.n_layers * (c.n_heads * hd + 2 * c.n_kv_heads * hd + 2 * d + 2 * c.d_ff) + c.vocab_size
    return matmul_params(c) + 4 * rows + norms


def kv_bytes_per_position(config, dtype_bytes: int) -> int:
    """Bytes of keys and values one cached position holds, over all layers."""
    c = get_config(config)
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * dtype_bytes


def step_bytes(config, dtype_bytes: int, context: int, batch: int = 1, int8=False) -> int:
    """Bytes one step reads: the weights once, and B rows of `context` cached positions."""
    kv = batch * context * kv_bytes_per_position(config, dtype_bytes)
    return weight_bytes(config, dtype_bytes, int8) + kv


def step_flops(config, context: int, batch: int = 1) -> int:
    """FLOPs of one step: 2 per weight per row, and attention's q.k and p.v over `context`."""
    c = get_config(config)
    attention = c.n_layers * 4 * c.n_heads * c.head_dim * context
    return batch * (2 * matmul_params(c) + attention)


def speed_of_light(copy_gbps: float, nbytes: float) -> float:
    """Steps per second if a step took only its bytes at the copy bandwidth."""
    return copy_gbps * 1e9 / nbytes


def predicted_step_ms(
    config, dtype_bytes, context, batch, copy_gbps, peak_tflops, int8=False
) -> float:
    """The roofline's step time: max(bytes / bandwidth, FLOPs / peak), in ms."""
    memory = step_bytes(config, dtype_bytes, context, batch, int8) / (copy_gbps * 1e9)
    compute = step_flops(config, context, batch) / (peak_tflops * 1e12)
    return 1e3 * max(memory, compute)


def compute_bound_batch(config, dtype_bytes, context, copy_gbps, peak_tflops, int8=False):
    """The least batch at which a step's FLOPs take as long as its bytes, or None when that
    never happens: each row brings its own KV cache, so past the context where a row's KV
    bytes take longer than its FLOPs, a bigger batch never catches up with the bandwidth."""
    bandwidth, peak = copy_gbps * 1e9, peak_tflops * 1e12
    per_row = step_flops(config, context, 1) / peak - (
        context * kv_bytes_per_position(config, dtype_bytes) / bandwidth
    )
    if per_row <= 0:
        return None
    return weight_bytes(config, dtype_bytes, int8) / bandwidth / per_row


def kv_equals_weights_context(config, dtype_bytes: int, batch: int) -> float:
    """The context at which `batch` rows of KV cache weigh as much as the weights."""
    kv = batch * kv_bytes_per_position(config, dtype_bytes)
    return weight_bytes(config, dtype_bytes) / kv


# --- timing one step


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def decode_step(model, batch: int, context: int):
    """(step, tokens, cache): step() decodes one token for `batch` rows at position context - 1
    of a fresh static cache of `context` positions (zeros: the values do not change the work),
    reading all `context` keys; it returns the (B, 1, V) logits. `tokens` is its (B, 1) input."""
    device = model.embed.weight.device
    cache = model.new_cache(batch=batch, length=context)
    tokens = torch.ones((batch, 1), dtype=torch.int64, device=device)
    step = lambda: model(tokens, cache, input_pos=context - 1)
    return step, tokens, cache


def capture(step, warmup: int = 2):
    """A CUDA graph of step(): (replay, output), where replay() reruns the captured kernels
    and refills `output` in place. Warm-up runs first on a side stream (Triton compiles, the
    GEMV picks its tiles, torch's allocator settles). GPU only."""
    if not torch.cuda.is_available():
        raise RuntimeError("capture records a CUDA graph: it needs a CUDA GPU")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    torch.cuda.synchronize()
    return graph.replay, output


def step_ms(step, steps: int, device, warmup: int = 2) -> float:
    """Wall-clock ms per call of step(), `steps` calls back to back, one sync at the end:
    what a decoding loop sees, host time included."""
    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def eager_decode_ms(model, prompt_ids, steps: int) -> float:
    """v0: ms per token of a plain greedy loop (prefill, then one step per token, each reading
    the keys so far, its argmax read back to pick the next token): the host in the loop."""
    device = model.embed.weight.device
    cache = model.new_cache(batch=1, length=len(prompt_ids) + steps + 1)
    tokens = torch.tensor([prompt_ids], dtype=torch.int64, device=device)
    with torch.no_grad():
        logits = model(tokens, cache, input_pos=0)
        pos = len(prompt_ids)
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            token = int(logits[0, -1].argmax())  # the host waits for the GPU here
            logits = model(torch.tensor([[token]], device=device), cache, input_pos=pos)
            pos += 1
        _sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def graph_step_ms(model, batch: int, context: int, steps: int) -> float:
    """v1/v2: ms per step of decode_step replayed from a CUDA graph. GPU only."""
    with torch.no_grad():
        step, _, _ = decode_step(model, batch, context)
        replay, _ = capture(step)
        return step_ms(replay, steps, "cuda")


def compiled_step_ms(model, batch: int, context: int, steps: int, mode="reduce-overhead"):
    """ms per step of decode_step under torch.compile(mode=...), after warm-up calls (the
    compile, and reduce-overhead's CUDA-graph recording, stay outside the clock). The cache is
    marked as a static address, as a CUDA graph needs of a tensor it writes. Returns
    (ms, seconds the first calls took)."""
    device = model.embed.weight.device
    compiled = torch.compile(model, mode=mode)
    with torch.no_grad():
        _, tokens, cache = decode_step(model, batch, context)
        if device.type == "cuda":
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
        step = lambda: compiled(tokens, cache, input_pos=context - 1)
        start = time.perf_counter()
        for _ in range(3):  # compile; reduce-overhead records its graph on a later call
            step()
        _sync(device)
        first_s = time.perf_counter() - start
        return step_ms(step, steps, device), first_s


def kernels_per_step(step, device) -> dict:
    """What one call of step() launches, from torch.profiler: {"kernels": GPU kernels (on a
    CPU, the top-level aten ops, each a kernel of its own), "names": {name: count}}."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.device(device).type == "cuda"
    step()  # warm-up: compiles and tunes outside the trace
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    if on_gpu:
        chosen = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        chosen = [e for e in chosen if not e.name.startswith(("Memcpy", "Memset"))]
    else:
        chosen = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    names = {}
    for e in chosen:
        names[e.name] = names.get(e.name, 0) + 1
    return {"kernels": len(chosen), "names": dict(sorted(names.items(), key=lambda kv: -kv[1]))}


def gpu_busy(step, steps: int, device) -> dict:
    """The profiler's view of `steps` calls of step(): wall time, the time kernels ran (their
    summed durations) and the busy share: below 1, the GPU waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.device(device).type == "cuda"
    step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall_us = 1e6 * (time.perf_counter() - start)
    if on_gpu:
        kinds = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kinds = [e for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    busy_us = sum(e.time_range.elapsed_us() for e in kinds)
    return {"wall_us": wall_us, "busy_us": busy_us, "busy": busy_us / wall_us, "steps": steps}


# What each part of the fused step buys, a rung at a time: (label, backend, dependent launch,
# fusions: None as Block has them, else llm.fusions' switches). Each of Block's three
# epilogues is taken out in turn (its work back in a kernel of its own), the other two kept.
FUSION_LADDER = (
    ("torch's ops", "torch", True, None),
    ("without dependent launch", "kernels", False, None),
    ("SwiGLU in a kernel of its own", "kernels", True,
     {"rotary_in_epilogue": True, "norm_in_epilogue": True}),
    ("rotary in a kernel of its own", "kernels", True,
     {"swiglu_in_epilogue": True, "norm_in_epilogue": True}),
    ("the norms in kernels of their own", "kernels", True,
     {"swiglu_in_epilogue": True, "rotary_in_epilogue": True}),
    ("kernels", "kernels", True, None),
)  # fmt: skip


def fusion_ladder(model, batch: int, context: int, steps: int, counted: bool = False) -> dict:
    """{label: {"ms": a step replayed from a CUDA graph[, "kernels": what one step launches]}}
    for each rung of FUSION_LADDER, the model's backend as it was after. GPU only."""
    saved, out = model.backend, {}
    try:
        for label, backend, pdl, fused in FUSION_LADDER:
            model.backend = backend
            switches = contextlib.nullcontext() if fused is None else fusions(**fused)
            with runtime.dependent_launch(pdl), switches:  # a graph keeps what it captured
                out[label] = {"ms": graph_step_ms(model, batch, context, steps)}
                if counted:
                    step, _, _ = decode_step(model, batch, context)
                    out[label]["kernels"] = kernels_per_step(step, "cuda")["kernels"]
    finally:
        model.backend = saved
    return out


def batch_sweep(model, batches, context: int, steps: int, timer=None) -> list:
    """ms per step and tokens/s at each batch size, decoding at `context`; timer(model, batch,
    context, steps) defaults to graph_step_ms on a GPU, eager steps on a CPU."""
    if timer is None:
        timer = graph_step_ms if model.embed.weight.is_cuda else _eager_step_ms
    rows = []
    for batch in batches:
        ms = timer(model, batch, context, steps)
        rows.append({"batch": batch, "ms": ms, "tokens_per_s": 1e3 * batch / ms})
        if model.embed.weight.is_cuda:
            torch.cuda.empty_cache()  # the next batch's cache may be large
    return rows


def _eager_step_ms(model, batch, context, steps):
    with torch.no_grad():
        step, _, _ = decode_step(model, batch, context)
        return step_ms(step, steps, model.embed.weight.device)


def linear_shapes(config) -> dict:
    """{name: (N, K)} of one layer's linear weights and the head: the GEMVs of a step."""
    c = get_config(config)
    d, hd = c.d_model, c.head_dim
    return {
        "wq": (c.n_heads * hd, d), "wk": (c.n_kv_heads * hd, d), "wv": (c.n_kv_heads * hd, d),
        "wo": (d, c.n_heads * hd), "w_gate": (c.d_ff, d), "w_up": (c.d_ff, d),
        "w_down": (d, c.d_ff), "head": (c.vocab_size, d),
    }  # fmt: skip


def time_linears(shapes: dict, fns: dict, dtype, device, timer, rows: int = 1) -> list:
    """For each weight shape (N, K), a random x (rows, K) and float weight (N, K): for each
    label in `fns`, (fn, make_argsets), timer(fn, make_argsets(x, weight)) ms and the GB/s of
    the float weight's bytes (an int8 fn reads half of them: its GB/s is the float-equivalent).
    timer: kernels.bench.rotating_graph_ms on a GPU (rotating copies of the weight)."""
    out = []
    for name, (n, k) in shapes.items():
        x = torch.randn((rows, k), dtype=dtype, device=device)
        weight = torch.randn((n, k), dtype=dtype, device=device) * k**-0.5
        nbytes = weight.nbytes + x.nbytes + rows * n * weight.element_size()
        row = {"name": name, "N": n, "K": k, "bytes": nbytes}
        for label, (fn, make_args) in fns.items():
            ms = timer(fn, make_args(x, weight))
            row[label] = {"ms": ms, "gbps": nbytes / ms / 1e6}
        out.append(row)
    return out


def down_projection_ms(config, dtype, device, timer, copies=rotating_copies) -> dict:
    """The MLP's down projection for one decode row with SwiGLU's product silu(gate) * up: in a
    kernel of its own, then the GEMV, against formed inside the GEMV's loads
    (kernels.decode.swiglu_linear, one launch fewer). Float and int8 weights (d_model, d_ff):
    {"float": {"separate": ms, "fused": ms}, "int8": {...}}, each timer(fn, argsets) over
    copies(weight) (on a GPU: kernels.bench.rotating_graph_ms over rotating_copies)."""
    c = get_config(config)
    weight = (torch.randn((c.d_model, c.d_ff), device=device) * c.d_ff**-0.5).to(dtype)
    gate_up = torch.randn((1, 2 * c.d_ff), device=device).to(dtype)
    q, scale = int8.quantize(weight)
    argsets = {
        "float": [(w, None) for w in copies(weight)],
        "int8": [(w, scale) for w in copies(q)],
    }
    separate = lambda w, s: ops.linear(decode.silu_mul(gate_up), w, "kernels", s)
    fused = lambda w, s: decode.swiglu_linear(gate_up, w, s)
    return {kind: {"separate": timer(separate, sets), "fused": timer(fused, sets)}
            for kind, sets in argsets.items()}  # fmt: skip


def describe_config(config) -> str:
    c = config if isinstance(config, ModelConfig) else get_config(config)
    return (
        f"{c.n_layers} layers, d_model {c.d_model}, MLP {c.d_ff}, {c.n_heads}/{c.n_kv_heads} "
        f"heads of {c.head_dim}, vocab {c.vocab_size}: {c.n_params() / 1e6:.0f} M parameters"
    )
