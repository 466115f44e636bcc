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


def main(argv=None) -> int:
    from kernels.grader import cli as grader

    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__)
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
    grader.add_commands(sub)
    args = parser.parse_args(argv)
    handlers = {"doctor": doctor, "bench": bench_command, "record": record_command}
    handlers.update(grader.HANDLERS)
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
