"""The course's command line: `python -m kernels COMMAND ...`; `--help` lists the commands."""

import argparse
import sys


def doctor(_args) -> int:
    import torch

    from kernels import check, runtime
    from kernels.elementwise import add, add_ref

    info = runtime.versions()
    for key, value in info.items():
        print(f"{key:>8}: {value}")
    x = check.random_tensor((1000,), seed=0)
    y = check.random_tensor((1000,), seed=1)
    try:
        result = check.compare(add(x, y), add_ref(x.double(), y.double()), op="elementwise")
    except Exception as exc:  # the point of doctor is to report any failure in one line
        result = check.Comparison(False, f"{type(exc).__name__}: {exc}")
    if not result.ok:
        print(f"PROBLEM: a Triton vector add failed ({result.message})")
        return 1
    if runtime.ON_GPU and not runtime.INTERPRET:
        print(
            f"OK: Triton compiles for {info['device']}; timings are real "
            f"(CUDA {torch.version.cuda})"
        )
    elif runtime.ON_GPU:
        print(
            "OK, but TRITON_INTERPRET is set on a GPU machine: kernels run in the interpreter; "
            "unset it to compile them"
        )
    else:
        print(
            "OK: no GPU, CPU mode: Triton kernels run in the interpreter (correct, slow); "
            "chapters show GPU timings recorded on an H200"
        )
    return 0


def bench_command(args) -> int:
    from kernels import benchmarks

    return benchmarks.main(args.names, json_path=args.json, update=args.update)


def record_command(args) -> int:
    from kernels import notebook

    return notebook.main(args.paths)


def generate_command(args) -> int:
    """The model's reply to one chat message, fp32 on a CPU (its weights' dtype on a GPU: bf16).
    --invariant decodes inside batch_invariant_mode() on the course's batch-invariant kernels
    (on a CPU, Triton's interpreter: minutes a token for the real model; try --config tiny)."""
    import contextlib

    import torch

    from kernels import llm
    from kernels.batch_invariant import batch_invariant_mode
    from kernels.runtime import ON_GPU

    config = llm.CONFIGS[args.config]
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    backend = "kernels" if args.invariant else args.backend
    try:
        model = llm.load_model(args.config, dtype=dtype, backend=backend)
        # the tiny config's vocabulary is bytes; the others decode with the file's tokenizer
        if config.vocab_size == 256:
            tok = llm.tokenizer.ByteTokenizer()
        else:
            tok = llm.load_tokenizer()
    except FileNotFoundError as exc:  # the message names the three ways to supply the file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stop = () if tok.eos_id is None else (tok.eos_id,)
    mode = batch_invariant_mode() if args.invariant else contextlib.nullcontext()
    with mode:
        ids = llm.generate(
            model,
            tok.chat(args.prompt),
            args.tokens,
            temperature=args.temperature,
            seed=args.seed,
            stop_ids=stop,
            progress=args.tokens > 32 or args.invariant,
        )
    ids = ids[:-1] if ids and ids[-1] in stop else ids
    print(tok.decode([i for i in ids if i < tok.vocab_size]))
    return 0


def main(argv=None) -> int:
    from kernels.grader import cli as grader

    parser = argparse.ArgumentParser(
        prog="python -m kernels",
        description=__doc__,
        epilog="Learners grade from the course's folder with `make grade LAB=labs/<lab>.ipynb` "
        "and `make progress`: the same grade and progress commands, with no environment to "
        "activate.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="mode, device, versions, and a one-line verdict")
    p = sub.add_parser("bench", help="ceilings and kernels against baselines (GPU)")
    p.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    p.add_argument(
        "--update",
        action="store_true",
        help="add to the rows already in --json OUT, replacing those of the same name",
    )
    p = sub.add_parser("record", help="execute notebooks and record their outputs and metadata")
    p.add_argument("paths", nargs="+")
    p = sub.add_parser("generate", help="the language model's reply to a chat message")
    p.add_argument("prompt", help='the user\'s message, e.g. "Tell me about Richard Feynman."')
    p.add_argument("--tokens", type=int, default=64, help="at most this many new tokens (64)")
    p.add_argument(
        "--config",
        default="smollm2-135m",
        choices=["smollm2-135m", "tiny", "llama-1b-shape"],
        help="smollm2-135m: the real model; the others: random weights of that shape",
    )
    p.add_argument(
        "--invariant",
        action="store_true",
        help="decode on the batch-invariant kernels (Chapter 5), whatever --backend says",
    )
    p.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "kernels"],
        help="torch's ops (default) or the course's kernels",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampled"
    )
    p.add_argument("--seed", type=int, default=None, help="seeds the sampler (temperature > 0)")
    grader.add_commands(sub)
    args = parser.parse_args(argv)
    handlers = {
        "doctor": doctor,
        "bench": bench_command,
        "record": record_command,
        "generate": generate_command,
    }
    handlers.update(grader.HANDLERS)
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
