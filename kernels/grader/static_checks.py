"""Static checks on a submission's source, made in the grader's own process (never executed).

- Kernel bodies: a `@triton.jit` function may use only `tl`, `triton`, `math`, its arguments
  and locals, `tl.constexpr` globals and other jit functions. Under the interpreter a body
  that computes with torch or numpy would otherwise pass for a kernel.
- Tampering: graded code may not import beyond a short list, reach private attributes, call
  exec/eval/getattr and friends, or assign into torch, triton or kernels. The comparisons run
  in the grader's process, so patching them in the child changes nothing; these rules guard
  what the child observes (kernel launches, torch ops) on the learner's behalf.
- What each task needs: the function it grades is defined, and it is not still a stub.

This is a net for honest mistakes and casual cheating, not a sandbox for hostile code.
"""

import ast
from dataclasses import dataclass, field

ALLOWED_IMPORTS = (
    "collections",
    "dataclasses",
    "functools",
    "itertools",
    "kernels",
    "math",
    "time",
    "torch",
    "triton",
    "typing",
)
BANNED_CALLS = {
    "__import__",
    "breakpoint",
    "compile",
    "delattr",
    "eval",
    "exec",
    "getattr",
    "globals",
    "open",
    "setattr",
    "vars",
}
# Attribute names that lead from an allowed module to the interpreter's machinery.
BANNED_ATTRIBUTES = {
    "builtins",
    "ctypes",
    "gc",
    "grader",
    "importlib",
    "inspect",
    "modules",
    "multiprocessing",
    "os",
    "pickle",
    "shutil",
    "signal",
    "socket",
    "subprocess",
    "sys",
    "threading",
}
ALLOWED_DUNDERS = {"__init__", "__name__", "__doc__"}
# What a kernel body may name besides its arguments and locals (Triton's supported builtins).
JIT_BUILTINS = {
    "bool",
    "float",
    "int",
    "isinstance",
    "len",
    "list",
    "max",
    "min",
    "print",
    "range",
    "tuple",
    "NotImplementedError",
}
JIT_MODULES = ("triton", "math")
KERNEL_RULE = (
    "a @triton.jit function may use only tl, triton, math, its arguments, "
    "tl.constexpr globals and other @triton.jit functions"
)


@dataclass
class Analysis:
    problems: list = field(default_factory=list)  # fail every task
    kernel_problems: list = field(default_factory=list)  # fail tasks that ask for a kernel
    defined: set = field(default_factory=set)  # module-level names
    stubs: dict = field(default_factory=dict)  # function -> message of its NotImplementedError
    identifiers: dict = field(default_factory=dict)  # name -> first line it is used on


def _dotted(node):
    """'torch.nn.functional.softmax' for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _root_name(node):
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _imports(tree, sub, out):
    """alias -> dotted module path, and one problem per import outside the allowed list."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = []
            for a in node.names:
                target = a.name if a.asname else a.name.split(".")[0]
                pairs.append((a.name, a.asname or target, target))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                out.problems.append(f"relative import at {sub.where(node.lineno)}")
                continue
            pairs = []
            for a in node.names:
                full = f"{node.module}.{a.name}"
                pairs.append((full, a.asname or a.name, full))
        else:
            continue
        for full, alias, target in pairs:
            parts = full.split(".")
            out.identifiers.setdefault(parts[-1], node.lineno)
            if parts[0] == "__future__":
                continue
            if parts[0] not in ALLOWED_IMPORTS or full.startswith("kernels.grader"):
                out.problems.append(
                    f"imports {full.removesuffix('.*')} at {sub.where(node.lineno)}: graded "
                    f"cells may import only {', '.join(ALLOWED_IMPORTS)} (not kernels.grader)"
                )
            elif any(p.startswith("_") or p == "*" for p in parts):
                out.problems.append(
                    f"imports {full} at {sub.where(node.lineno)}: private or * import"
                )
            aliases[alias] = target
    return aliases


def _resolve(dotted, aliases):
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    if head not in aliases:
        return None
    return aliases[head] + ("." + rest if rest else "")


def _scan(tree, sub, aliases, out):
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.identifiers.setdefault(node.id, line)
            if node.id.startswith("__") and node.id not in ALLOWED_DUNDERS:
                out.problems.append(f"uses {node.id} at {sub.where(line)}: not allowed")
            if isinstance(node.ctx, ast.Load) and node.id in BANNED_CALLS:
                out.problems.append(
                    f"uses {node.id} at {sub.where(line)}: graded cells may not use "
                    f"{', '.join(sorted(BANNED_CALLS))}"
                )
        elif isinstance(node, ast.Attribute):
            out.identifiers.setdefault(node.attr, line)
            resolved = _resolve(_dotted(node), aliases) or ""
            if node.attr.startswith("_") and node.attr not in ALLOWED_DUNDERS:
                out.problems.append(
                    f"uses the private attribute {node.attr} at {sub.where(line)}: graded "
                    "code may use only public APIs"
                )
            elif node.attr in BANNED_ATTRIBUTES or resolved.startswith("kernels.grader"):
                out.problems.append(
                    f"reaches {node.attr} at {sub.where(line)}: graded code may not touch the "
                    "interpreter's or the grader's machinery"
                )
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in _flatten(targets):
                if isinstance(target, (ast.Attribute, ast.Subscript)):
                    if _root_name(target) in aliases:
                        out.problems.append(
                            f"changes {ast.unparse(target)} at {sub.where(line)}: graded code "
                            "may not modify torch, triton or kernels"
                        )


def _flatten(targets):
    """The places an assignment writes: `a, (b.c, *d) = ...` gives a, b.c and d."""
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            yield from _flatten(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _flatten([target.value])
        else:
            yield target


def _is_jit(fn, aliases):
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if _resolve(_dotted(target), aliases) == "triton.jit":
            return True
    return False


def _stub_message(fn):
    """The message of a function whose whole body raises NotImplementedError, else None."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or fn.decorator_list:
        return None
    exc = body[0].exc
    call = exc if isinstance(exc, ast.Call) else None
    name = call.func if call else exc
    if not (isinstance(name, ast.Name) and name.id == "NotImplementedError"):
        return None
    if call and call.args and isinstance(call.args[0], ast.Constant):
        return str(call.args[0].value)
    return ""


def _kernel_problems(tree, sub, aliases, out):
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    jit_names = {f.name for f in functions if _is_jit(f, aliases)}
    constexprs = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            value = node.value.func if isinstance(node.value, ast.Call) else node.value
            resolved = _resolve(_dotted(value), aliases) or ""
            if resolved.startswith("triton.language.") and isinstance(node.targets[0], ast.Name):
                constexprs.add(node.targets[0].id)
    for fn in functions:
        if fn.name not in jit_names:
            continue
        args = fn.args
        allowed = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                    allowed.add(node.id)
                elif isinstance(node, (ast.FunctionDef, ast.Lambda)):
                    allowed.update(a.arg for a in node.args.args)
        allowed |= jit_names | constexprs | JIT_BUILTINS
        for stmt in fn.body:
            for node in ast.walk(stmt):
                if not isinstance(node, ast.Name) or node.id in allowed:
                    continue
                resolved = aliases.get(node.id)
                if resolved is not None and resolved.split(".")[0] in JIT_MODULES:
                    continue
                if resolved is not None:
                    what = f"uses {node.id}" + (f" ({resolved})" if resolved != node.id else "")
                elif node.id in out.defined:
                    what = f"uses {node.id}, neither a @triton.jit function nor a tl.constexpr"
                else:
                    continue  # an undefined name fails when the kernel runs, with its own message
                out.kernel_problems.append(
                    f"kernel {fn.name} {what} at {sub.where(node.lineno)}: {KERNEL_RULE}"
                )
                break


def analyse(sub) -> Analysis:
    """Everything the grader can tell about a submission without running it."""
    out = Analysis()
    try:
        tree = ast.parse(sub.source, filename="submission.py")
    except SyntaxError as exc:
        out.problems.append(f"syntax error at {sub.where(exc.lineno or 0)}: {exc.msg}")
        return out
    aliases = _imports(tree, sub, out)
    _scan(tree, sub, aliases, out)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.defined.add(node.name)
            message = _stub_message(node)
            if message is not None:
                out.stubs[node.name] = message
        elif isinstance(node, ast.Assign):
            out.defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.defined.add(node.target.id)
    _kernel_problems(tree, sub, aliases, out)
    return out
