"""Prose equals data: the numbers a chapter's markdown states, checked against its recorded run.

A number in a markdown cell is tied to the recorded value it reports by an HTML comment right
after it (invisible in JupyterLab and in the book, where MyST passes it through as raw HTML):

    bf16 0.97×<!-- = speedup(bench.rows["matmul bf16 4096^3"], "torch.matmul") -->

The comment holds an expression over the recorded data; the number before it (an optional unit
such as ×, %, ms, µs, GB/s or TFLOP/s may sit between them) must equal the expression's value
rounded to as many decimals as the prose shows: "0.97" passes for 0.9705, fails for 0.9649.
Long expressions go in one block per cell, one `name = expression` per line, and the inline
comment names them (`0.97×<!-- = bf16_4096 -->`):

    <!-- measured: the rest of this line is a note for the reader of the source
    bf16_4096 = speedup(bench.rows["matmul bf16 4096^3"], "torch.matmul")
    -->

Names an expression can use (nothing else: it is parsed, never passed to eval):
- `ch`: the `results` of the chapter's own recorded JSON, `kernels/data/h200/<chapter>.json`;
- `bench`: the benchmark's recorded JSON, `kernels/data/h200/bench.json` (`bench.rows`,
  `bench.ceilings`);
- `recorded("tune_fusion")`: the `results` of another recorded JSON of the same folder (a
  tuning script's run, which a chapter quotes);
- `out(r"regex")`: the one number captured by the regex's group in the notebook's stored
  outputs (every match must capture the same value);
- `speedup(row, baseline)`: `row.baselines[baseline] / row.ms`, the "vs baselines" ratio the
  benchmark prints; `slowdown(row, baseline)`, its inverse; `geomean`, `min`, `max`, `abs`;
  `find(items, field=value, ...)`: the one item of a list with those fields.
`a.b` and `a["b"]` read a key of a dict; `rows["name"]` picks the one item of a list whose
`name` (or, failing that, any other text field) is that string; `rows[0]` indexes; + - * /.

In every markdown cell, every number with a unit of measurement (% × x µs us ms s GB/s TB/s
TFLOP/s tok/s) must carry an annotation, be marked `<!-- cited -->` (a number from outside this
run: a paper, a datasheet, an earlier run named as such), or be a target (right after ≥, ≤, <,
>, "at most", "at least", "under", "over", "above", "below"). Annotations need a block
`<!-- measured -->` in their cell (it may be empty): such a cell is *converted*.
`check_notebook` fails, naming chapter, cell, the prose number and the recorded value, when
- an annotated number differs from its recorded value (the prose was left behind by a
  re-recording, or was retyped wrong);
- an expression names a value the recorded data no longer hold (a re-recording removed it);
- a block defines a name no annotation uses (prose removed, its data left behind);
- any markdown cell, converted or not, states a measurement-like number with none of the three
  marks above (a cell that quotes the run must be converted);
- an annotation sits in a cell without a block (a cell is converted whole or not at all).

`coverage(path)` lists the converted cells; `python -m kernels.prose NB...`
prints every annotated number beside its recorded value, the list to work through after
re-recording a chapter.
"""

import ast
import json
import math
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from kernels.bench import DATA_DIR, RECORDED_GPU

# A ratio or a share is written against its number (0.97×, 52%); a time or a rate after a space
# or not (26 µs, 4245 GB/s). No sign: "0.86×-0.89×" is a range, not a negative number.
UNIT = r"(?:[×%]|x\b|\s?(?:µs|us|ms|s|GB/s|TB/s|TFLOP/s|tok/s)\b)"
NUMBER = r"(?<![\w.,])(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)"
ANNOTATED = re.compile(NUMBER + r"(?P<unit>" + UNIT + r")?\s*<!--\s*=(?P<expr>[^\n]*?)-->")
CITED = re.compile(NUMBER + r"(?:" + UNIT + r")?\s*<!--\s*cited\b[^\n]*?-->")
BLOCK = re.compile(r"<!--\s*measured\b(?P<body>.*?)-->", re.S)
MEASUREMENT = re.compile(NUMBER + UNIT)
TARGET = re.compile(r"(?:[≥≤<>]|\bat most|\bat least|\bunder|\bover|\babove|\bbelow)\s*$")
IGNORED = re.compile(r"<!--.*?-->|`[^`\n]*`|\$[^$\n]*\$", re.S)  # comments, code, math


@dataclass
class Annotation:
    cell: int
    number: str  # as the prose writes it
    expr: str
    value: float | None = None  # the recorded value, once resolved
    problem: str | None = None


class Missing(LookupError):
    """The expression names a value the recorded data do not hold."""


# --- the recorded data an expression reads


class _Output:
    def __init__(self, texts):
        self.texts = texts

    def __call__(self, pattern):
        found = {m.group(1) for text in self.texts for m in re.finditer(pattern, text)}
        if len(found) != 1:
            what = "matches nothing" if not found else f"captures {sorted(found)}"
            raise Missing(f"out({pattern!r}) {what} in the stored outputs")
        return float(found.pop().replace(",", ""))


def _outputs(nb):
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            yield "".join(text)


def _load(path):
    if not path.exists():
        raise Missing(f"{path.name} is not recorded")
    return json.loads(path.read_text())


def _pick(items, key):
    """The one item of a list of dicts that `key` names."""
    if isinstance(key, int):
        if -len(items) <= key < len(items):
            return items[key]
        raise Missing(f"no item {key} in a list of {len(items)}")
    named = [i for i in items if isinstance(i, dict) and i.get("name") == key]
    named = named or [i for i in items if isinstance(i, dict) and key in i.values()]
    if len(named) != 1:
        raise Missing(f"{len(named)} recorded items named {key!r}, not one")
    return named[0]


def _get(container, key):
    if isinstance(container, dict):
        if key not in container:
            raise Missing(f"no recorded key {key!r} (recorded: {sorted(container)[:12]})")
        return container[key]
    if isinstance(container, list):
        return _pick(container, key)
    raise Missing(f"cannot look up {key!r} in a {type(container).__name__}")


def _find(items, **fields):
    hits = [i for i in items if all(i.get(k) == v for k, v in fields.items())]
    if len(hits) != 1:
        raise Missing(f"{len(hits)} recorded items with {fields}, not one")
    return hits[0]


def _geomean(*values):
    return math.exp(sum(math.log(v) for v in values) / len(values))


FUNCTIONS = {
    "speedup": lambda row, baseline: _get(_get(row, "baselines"), baseline) / _get(row, "ms"),
    "slowdown": lambda row, baseline: _get(row, "ms") / _get(_get(row, "baselines"), baseline),
    "geomean": _geomean,
    "find": _find,
    "min": min,
    "max": max,
    "abs": abs,
}
OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def evaluate(expr: str, names: dict):
    """The value of an annotation's expression, read from `names` (no eval)."""

    def walk(node):
        match node:
            case ast.Expression(body=body):
                return walk(body)
            case ast.Constant(value=value) if isinstance(value, int | float | str):
                return value
            case ast.Name(id=name) if name in names:
                return names[name]
            case ast.Name(id=name):
                raise Missing(f"unknown name {name!r}")
            case ast.Attribute(value=value, attr=attr):
                return _get(walk(value), attr)
            case ast.Subscript(value=value, slice=key):
                return _get(walk(value), walk(key))
            case ast.BinOp(left=left, op=op, right=right) if type(op) in OPERATORS:
                return OPERATORS[type(op)](walk(left), walk(right))
            case ast.UnaryOp(op=ast.USub(), operand=operand):
                return -walk(operand)
            case ast.List(elts=elts) | ast.Tuple(elts=elts):
                return [walk(e) for e in elts]
            case ast.Call(func=ast.Name(id=name), args=args, keywords=keywords) if callable(
                names.get(name)
            ):
                kwargs = {k.arg: walk(k.value) for k in keywords}
                return names[name](*[walk(a) for a in args], **kwargs)
        raise ValueError(f"not allowed in an annotation: {ast.unparse(node)!r}")

    return walk(ast.parse(expr.strip(), mode="eval"))


def names_for(path, nb) -> dict:
    """What an annotation in notebook `path` can read: its chapter's recorded results, the
    benchmark's, its stored outputs and the helper functions."""
    data = DATA_DIR / RECORDED_GPU
    names = dict(FUNCTIONS, out=_Output(list(_outputs(nb))))
    names["recorded"] = lambda stem: _load(data / f"{Path(str(stem)).name}.json")["results"]
    for name, file in (("ch", f"{Path(path).stem}.json"), ("bench", "bench.json")):
        try:
            recorded = _load(data / file)
            names[name] = recorded["results"] if name == "ch" else recorded
        except Missing:
            pass  # an expression naming it fails with "unknown name"
    return names


# --- the check


def _matches(number: str, value) -> bool:
    """`number` as written equals `value` rounded to its decimals."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    prose = Decimal(number.replace(",", ""))
    half = Decimal(5).scaleb(prose.as_tuple().exponent - 1)
    return abs(float(prose) - value) <= float(half) * (1 + 1e-9) + 1e-12


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else repr(value)[:60]


def _definitions(body: str, where: str, names: dict, problems: list) -> dict:
    defined = {}
    for line in body.strip().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, expr = line.partition("=")
        if not sep or not name.strip().isidentifier():
            problems.append(f"{where}: a block line must be `name = expression`: {line!r}")
            continue
        if any(defined.get(n, 0) is None for n in _referenced([expr])):
            defined[name.strip()] = None  # built on a failed line, reported already
            continue
        try:
            defined[name.strip()] = evaluate(expr, {**names, **defined})
        except (LookupError, ValueError, TypeError, ZeroDivisionError, SyntaxError) as e:
            problems.append(f"{where}: {name.strip()} = {expr.strip()}: {e}")
            defined[name.strip()] = None
    return defined


def _referenced(exprs) -> set[str]:
    """The names some expressions read."""
    found = set()
    for expr in exprs:
        try:
            found |= {
                n.id
                for n in ast.walk(ast.parse(expr.strip() or "0", mode="eval"))
                if isinstance(n, ast.Name)
            }
        except SyntaxError:
            pass  # reported where it is evaluated
    return found


def check_cell(source: str, where: str, cell: int, names: dict):
    """(annotations, problems) of one markdown cell."""
    problems, annotations = [], []
    blocks = list(BLOCK.finditer(source))
    defined = {}
    for block in blocks:  # the rest of a block's first line is a note for the reader
        defined |= _definitions(block.group("body").partition("\n")[2], where, names, problems)
    scope = {**names, **defined}
    bodies = [block.group("body").partition("\n")[2] for block in blocks]
    used = _referenced(line.partition("=")[2] for body in bodies for line in body.splitlines())
    for m in ANNOTATED.finditer(source):
        a = Annotation(cell, m.group("number"), m.group("expr").strip())
        annotations.append(a)
        if not blocks:
            a.problem = "annotated, but the cell has no <!-- measured --> block"
            continue
        used |= _referenced([a.expr])
        try:
            a.value = evaluate(a.expr, scope)
        except (LookupError, ValueError, TypeError, ZeroDivisionError, SyntaxError) as e:
            a.problem = f"{a.expr}: {e}"
            continue
        if a.value is None:  # its block line failed, and says why
            a.problem = f"{a.expr} is not in the recorded run"
        elif not _matches(a.number, a.value):
            a.problem = f"{a.expr} is {_shown(a.value)} in the recorded run"
    problems += [f"{where}: prose says {a.number}: {a.problem}" for a in annotations if a.problem]
    for name in sorted(set(defined) - used):
        problems.append(f"{where}: `{name}` is defined in the block but no number uses it")
    rest = IGNORED.sub(" ", CITED.sub(" ", ANNOTATED.sub(" ", source)))  # converted or not
    for m in MEASUREMENT.finditer(rest):
        if not TARGET.search(rest[max(0, m.start() - 12) : m.start()]):
            context = " ".join(rest[max(0, m.start() - 40) : m.end() + 10].split())
            problems.append(
                f"{where}: {m.group(0)!r} has no annotation (…{context}…): tie it to "
                "the recorded run with <!-- = ... -->, or mark it <!-- cited -->"
            )
    return annotations, problems


def _cells(path):
    nb = json.loads(Path(path).read_text())
    return nb, [
        (i, "".join(c["source"])) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown"
    ]


def check_notebook(path) -> tuple[list[Annotation], list[str]]:
    """Every annotation of the notebook at `path`, resolved, and every problem found."""
    nb, cells = _cells(path)
    names = names_for(path, nb)
    annotations, problems = [], []
    for i, source in cells:
        found, wrong = check_cell(source, f"{Path(path).stem} cell {i}", i, names)
        annotations += found
        problems += wrong
    return annotations, problems


def coverage(path) -> list[int]:
    """The converted markdown cells of a notebook (0-based cell indices)."""
    return [i for i, source in _cells(path)[1] if BLOCK.search(source)]


def main(paths) -> int:
    failed = False
    for path in paths:
        annotations, problems = check_notebook(path)
        print(f"{path}: converted cells {coverage(path)}, {len(annotations)} annotated numbers")
        for a in annotations:
            value = "missing" if a.value is None else _shown(a.value)
            mark = "ok " if a.problem is None else "BAD"
            print(f"  {mark} cell {a.cell:3}: {a.number:>8}  recorded {value:>9}  {a.expr}")
        for problem in problems:
            print(f"  problem: {problem}")
        failed = failed or bool(problems)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
