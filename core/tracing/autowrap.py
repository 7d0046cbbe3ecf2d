"""Autowrap: rewrite a forward so that one untraceable statement becomes an opaque call.

Why: ``if mask.any(): ...`` or an ``assert`` on tensor values in non-target code stops
tracing. Instead of giving up on the whole module, the statement is compiled into its own
function (inputs: the locals it reads, outputs: the locals it assigns) that the graph calls
as one node. Decorators around the forward are kept by rebuilding their closures.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .opaque import opaque

_UNSET_NAME = "_lw_unset"


class _Unset:
    """Value of a local that a wrapped statement neither received nor assigned."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


@dataclass(frozen=True)
class WrappedStatement:
    """One statement the tracer turned into an opaque call, and why."""

    file: str
    line: int
    statement: str
    why: str
    module: str  # qualified name of the module whose forward holds it ("" = the model)

    def __str__(self) -> str:
        where = self.module or "<model>"
        return f"{short_path(self.file)}:{self.line} in {where}: {self.statement.splitlines()[0]}  ({self.why})"


def short_path(path: str) -> str:
    """``.../site-packages/transformers/x.py`` -> ``transformers/x.py``; other paths as they are."""
    marker = os.sep + "site-packages" + os.sep
    return path.rsplit(marker, 1)[1] if marker in path else path


def _pick(namespace: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {n: namespace[n] for n in names if n in namespace}


def _stmt_lists(node: ast.AST) -> list[list[ast.stmt]]:
    lists = []
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            lists.append(value)
    for handler in getattr(node, "handlers", []) or []:
        lists.append(handler.body)
    for case in getattr(node, "cases", []) or []:
        lists.append(case.body)
    return lists


def _path_to_line(body: list[ast.stmt], line: int) -> list[tuple[list[ast.stmt], int]]:
    """(containing list, index) pairs from the outermost to the innermost statement at ``line``."""
    for i, stmt in enumerate(body):
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            path = [(body, i)]
            for inner in _stmt_lists(stmt):
                deeper = _path_to_line(inner, line)
                if deeper:
                    return path + deeper
            return path
    return []


def _escapes(stmt: ast.stmt) -> str | None:
    """Why ``stmt`` cannot live in its own function (control flow leaving it), else None."""

    def visit(node: ast.AST, in_loop: bool) -> str | None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            return None
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await)):
            return "contains return/yield"
        if isinstance(node, (ast.Break, ast.Continue)) and not in_loop:
            return "contains break/continue of an outer loop"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "declares global/nonlocal"
        loop = in_loop or isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        for child in ast.iter_child_nodes(node):
            reason = visit(child, loop)
            if reason:
                return reason
        return None

    return visit(stmt, False)


def _names(node: ast.AST, ctx: type) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _mutated(node: ast.AST) -> set[str]:
    """Locals changed in place by item/attribute assignment (``d[k] = v``, ``o.x += 1``, ``del d[k]``).

    They are outputs of a wrapped statement too: while tracing the statement is not run, so
    the caller would otherwise keep the unchanged object.
    """
    found = set()
    for n in ast.walk(node):
        if isinstance(n, (ast.Subscript, ast.Attribute)) and isinstance(n.ctx, (ast.Store, ast.Del)):
            base = n.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                found.add(base.id)
    return found


def _local_names(fdef: ast.FunctionDef) -> set[str]:
    a = fdef.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
    names = {p.arg for p in params} | _names(fdef, ast.Store)
    for node in ast.walk(fdef):
        if isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((al.asname or al.name).split(".")[0] for al in node.names)
    return names


class ForwardRewriter:
    """Per-tracer registry of wrapped statements and the rewritten forwards built from them."""

    def __init__(self) -> None:
        self._lines: dict[Callable[..., Any], dict[int, tuple[WrappedStatement, int]]] = {}
        self._built: dict[Callable[..., Any], Callable[..., Any]] = {}
        self.code_owner: dict[types.CodeType, Callable[..., Any]] = {}

    @property
    def records(self) -> list[WrappedStatement]:
        return [rec for lines in self._lines.values() for rec, _ in lines.values()]

    def forward_for(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The rewritten version of ``fn`` if any of its statements were wrapped, else ``fn``."""
        return self._built.get(fn, fn)

    def inner_code(self, fn: Callable[..., Any]) -> types.CodeType | None:
        inner = inspect.unwrap(self.forward_for(fn))
        return getattr(inner, "__code__", None)

    def is_wrapped(self, fn: Callable[..., Any], line: int) -> bool:
        return any(rec.line <= line <= rec.line + rec.statement.count("\n")
                   for rec, _ in self._lines.get(fn, {}).values())

    def wrap(self, fn: Callable[..., Any], line: int, why: str, module: str) -> WrappedStatement | str:
        """Wrap the statement of ``fn`` at ``line``; the record, or a reason it cannot be done."""
        try:
            fdef, inner = _parse(fn)
        except (OSError, TypeError, SyntaxError, IndexError) as exc:
            return f"source of {getattr(fn, '__qualname__', fn)} unavailable ({exc})"
        path = _path_to_line(fdef.body, line)
        reason = "no statement at that line"
        for depth in range(len(path) - 1, -1, -1):
            body, i = path[depth]
            stmt = body[i]
            if isinstance(stmt, ast.Return) and stmt.value is not None and not _escapes(ast.Expr(stmt.value)):
                reason = None
            else:
                reason = _escapes(stmt)
            if reason is None:
                break
        if reason is not None:
            return f"cannot wrap the statement at line {line}: {reason}"
        record = WrappedStatement(inner.__code__.co_filename, stmt.lineno, ast.unparse(stmt), why, module)
        if self.is_wrapped(fn, stmt.lineno):
            return f"statement at line {stmt.lineno} is already wrapped"
        self._lines.setdefault(fn, {})[stmt.lineno] = (record, depth)
        try:
            self._built[fn] = _build(fn, [(ln, d) for ln, (_, d) in self._lines[fn].items()])
        except Exception as exc:  # noqa: BLE001 - keep the registry consistent on a failed rebuild
            del self._lines[fn][stmt.lineno]
            return f"rewriting {inner.__qualname__} failed: {exc}"
        self.code_owner[inspect.unwrap(self._built[fn]).__code__] = fn
        return record


def _parse(fn: Callable[..., Any]) -> tuple[ast.FunctionDef, Any]:
    inner = inspect.unwrap(fn)
    lines, start = inspect.getsourcelines(inner)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, start - 1)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TypeError("not a plain function")
    return fdef, inner


def _build(fn: Callable[..., Any], lines: list[tuple[int, int]]) -> Callable[..., Any]:
    fdef, inner = _parse(fn)
    fdef.decorator_list = []
    locals_ = _local_names(fdef)
    # ``self.x = ...`` is not rebound from a wrapped statement's result (it is the module)
    receiver = {a.arg for a in fdef.args.args[:1]}
    helpers: dict[str, Any] = {"_lw_pick": _pick}
    stmt_defs: list[ast.stmt] = []
    for line, depth in sorted(lines, reverse=True):  # later (inner) statements first
        body, i = _path_to_line(fdef.body, line)[depth]
        stmt = body[i]
        name = f"_lw_stmt_L{line}"
        is_return = isinstance(stmt, ast.Return)
        reads = _names(stmt, ast.Load) & locals_
        writes = set() if is_return else ((_names(stmt, ast.Store) | (_mutated(stmt) - receiver)) & locals_)
        params = sorted(reads | writes)
        outs = sorted(writes)
        result = stmt.value if is_return else ast.Tuple([ast.Name(o, ast.Load()) for o in outs], ast.Load())
        func = ast.FunctionDef(
            name=name,
            args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[ast.arg(p) for p in params],
                               kw_defaults=[ast.Name(_UNSET_NAME, ast.Load()) for _ in params], kwarg=None, defaults=[]),
            body=([] if is_return else [stmt]) + [ast.Return(result)], decorator_list=[], returns=None)
        stmt_defs.append(func)
        call = ast.Call(ast.Name(name, ast.Load()), [], [ast.keyword(None, ast.Call(
            ast.Name("_lw_pick", ast.Load()),
            [ast.Call(ast.Name("locals", ast.Load()), [], []), ast.Tuple([ast.Constant(p) for p in params], ast.Load())],
            []))])
        if is_return:
            new: list[ast.stmt] = [ast.Return(call)]
        else:
            new = [ast.Assign([ast.Name("_lw_result", ast.Store())], call)]
            new += [ast.Assign([ast.Name(o, ast.Store())],
                               ast.Subscript(ast.Name("_lw_result", ast.Load()), ast.Constant(k), ast.Load()))
                    for k, o in enumerate(outs)]
        for node in new:
            ast.copy_location(node, stmt)
        body[i:i + 1] = new
    freevars = list(inner.__code__.co_freevars)
    closure = dict(zip(freevars, (c.cell_contents for c in (inner.__closure__ or ())), strict=True))
    maker = ast.FunctionDef(
        name="_lw_make", args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in [*freevars, *helpers,
                                                                                          *(d.name for d in stmt_defs)]],
                                            vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fdef, ast.Return(ast.Name(fdef.name, ast.Load()))], decorator_list=[], returns=None)
    module = ast.Module(body=[*stmt_defs, maker], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {_UNSET_NAME: UNSET}
    exec(compile(module, inner.__code__.co_filename, "exec"), inner.__globals__, namespace)  # noqa: S102 - our own AST
    for d in stmt_defs:
        namespace[d.name].__layerwise_stmt__ = True  # never dead-code eliminated
    stmt_fns = {d.name: opaque(namespace[d.name]) for d in stmt_defs}
    new_inner = namespace["_lw_make"](*(closure[n] for n in freevars), *helpers.values(), *stmt_fns.values())
    new_inner.__qualname__ = inner.__qualname__
    new_inner.__defaults__, new_inner.__kwdefaults__ = inner.__defaults__, inner.__kwdefaults__
    return _rewrap(fn, inner, new_inner)


def _rewrap(fn: Callable[..., Any], inner: Callable[..., Any], new_inner: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``'s decorator chain rebuilt around ``new_inner`` (closure cells swapped)."""
    if fn is inner:
        return new_inner
    wrapped = fn.__wrapped__  # type: ignore[attr-defined]
    new_wrapped = _rewrap(wrapped, inner, new_inner)
    cells, replaced = [], False
    for cell in fn.__closure__ or ():  # type: ignore[attr-defined]
        try:
            hit = cell.cell_contents is wrapped
        except ValueError:
            hit = False
        cells.append(types.CellType(new_wrapped) if hit else cell)
        replaced = replaced or hit
    if not replaced:
        raise TypeError(f"decorator around {inner.__qualname__} does not keep the wrapped function in its closure")
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))  # type: ignore[attr-defined]
    new.__kwdefaults__ = fn.__kwdefaults__  # type: ignore[attr-defined]
    new.__dict__.update(fn.__dict__)
    new.__wrapped__ = new_wrapped  # type: ignore[attr-defined]
    new.__qualname__ = fn.__qualname__
    return new
