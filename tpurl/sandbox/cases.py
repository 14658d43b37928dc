"""A test file as a grading plan: the units the sandbox runs and the checks the parent decides.

A test file may mix:

    assert f(1) == 2                       MBPP style: each top-level assert is one test
    def test_x(): ...                      pytest style: each test_* function is one test
    @pytest.mark.parametrize(...)          ... one test per parameter set
    class TestX(unittest.TestCase): ...    each test_* method is one test (setUp/tearDown run)
    def check(candidate): ...              HumanEval style: called with `entry_point` when given

plus imports, helpers and assignments (setup, run in file order), and nothing else of pytest than
`raises` (as a with-block), `approx` and `mark.parametrize`; fixtures are not supported.

Every `assert`, unittest `self.assertX(...)` and `pytest.raises` / `assertRaises` block in the file
becomes a *check*. A check's expression is split in two: the parts that depend on the candidate
(calls, names, attributes, subscripts, ...) become *probes*, which the sandbox evaluates and reports
as plain values; the rest (literals, comparisons, `not`, unary minus and calls of a few pure
functions: `set`, `sorted`, `len`, `abs`, `round`, `math.isclose`, `pytest.approx`, ...) is the
*skeleton*, which only the parent evaluates, on the reported values. `assert f(2) == 4` sends
`f(2)` to the sandbox; the `4` and the `==` never leave the parent. Parametrize values that are
literals are substituted into the function body, so they stay in the parent too.

A test passes iff its unit ran to its end, every check it reported held, and every check it must
reach (those not under an `if`, an `except`, an `else` or a raises-block, including those in
test-file functions it calls by name) was reported.
"""

from __future__ import annotations

import ast
import builtins
import copy
import dataclasses
import itertools
import types

TRUSTED_BUILTINS = ("abs", "all", "any", "bool", "dict", "float", "frozenset", "int", "len", "list", "max", "min",
                    "round", "set", "sorted", "str", "tuple")
TRUSTED_MATH = ("isclose", "isnan", "isinf", "isfinite", "fabs")
# keyword arguments a trusted call may take in the parent (any other makes the whole call a probe)
TRUSTED_KEYWORDS = {"_f_sorted": ("reverse",), "_f_round": ("ndigits",), "_f_min": ("default",),
                    "_f_max": ("default",), "_f_math_isclose": ("rel_tol", "abs_tol"), "_f_approx": ("rel", "abs"),
                    "_tpurl_almost_equal": ("places", "delta")}
_EQUAL = ("assertEqual", "assertListEqual", "assertTupleEqual", "assertDictEqual", "assertSetEqual",
          "assertSequenceEqual", "assertMultiLineEqual")
_COMPARE = {**{n: ast.Eq for n in _EQUAL}, "assertNotEqual": ast.NotEq, "assertIs": ast.Is, "assertIsNot": ast.IsNot,
            "assertIn": ast.In, "assertNotIn": ast.NotIn, "assertGreater": ast.Gt, "assertGreaterEqual": ast.GtE,
            "assertLess": ast.Lt, "assertLessEqual": ast.LtE}
_HELPERS = {"assertAlmostEqual": "_tpurl_almost_equal", "assertCountEqual": "_tpurl_count_equal",
            "assertRegex": "_tpurl_regex"}
_RAISES = ("assertRaises", "assertRaisesRegex")


class PlanError(ValueError):
    """The test file cannot be graded (a one-line reason)."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One assertion. `skeleton` evaluates it from the `probes` values `_p0, _p1, ...` (None for a raises
    check, which holds when an exception whose class chain has one of `raises` was raised and its
    message matches `match`)."""

    id: int
    line: int
    text: str
    skeleton: types.CodeType | None
    probes: int = 0
    raises: tuple[str, ...] = ()
    match: str | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    """One test: the unit that runs it and the checks it must reach."""

    name: str
    unit: int
    required: frozenset[int]


@dataclasses.dataclass(frozen=True)
class Plan:
    """`units` run in order in the sandbox (setup and tests); `cases` are the tests among them."""

    units: tuple[str, ...]
    cases: tuple[Case, ...]
    checks: tuple[Check, ...]


def plan_tests(source: str, *, entry_point: str | None = None) -> Plan:
    """The plan of test file `source`; PlanError when it cannot be parsed, holds no test, or nests
    an expression too deeply for Python's parser or the planner's recursion (`- - ... - 1`)."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise PlanError(f"tests: line {e.lineno}: {e.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own limit on nesting: MemoryError in CPython
        raise PlanError("tests: an expression is nested too deeply for Python's parser; write it flatter") from None
    try:
        return _Planner(tree, entry_point).plan()
    except RecursionError:  # splitting, unparsing or compiling a deeply nested check
        raise PlanError("tests: an expression is nested too deeply to grade; write it flatter") from None


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else (node.attr if isinstance(node, ast.Attribute) else "")


def _recorder_call(node: ast.AST, kind: str, check: int, args: list[ast.expr]) -> ast.Call:
    func = ast.Attribute(value=ast.Name(id="__tpurl__", ctx=ast.Load()), attr=kind, ctx=ast.Load())
    return ast.Call(func=func, args=[ast.Constant(check), *args], keywords=[])


def _recorded_id(node: ast.AST) -> int | None:
    """The check id of a rewritten `__tpurl__.check(id, ...)` / `__tpurl__.raises(id, ...)` call."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("check", "raises")
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "__tpurl__"):
        return node.args[0].value
    return None


def _is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


# nodes whose insides may not run (definitions, branches, comprehensions, short-circuits)
_CONDITIONAL = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.If, ast.IfExp, ast.Match,
                ast.BoolOp, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class _Planner(ast.NodeTransformer):
    """Rewrites asserts into recorder calls and splits the file into units (see the module docstring)."""

    def __init__(self, tree: ast.Module, entry_point: str | None):
        self.tree, self.entry_point = tree, entry_point
        self.checks: list[Check] = []
        self.pytest: set[str] = set()  # names bound to the pytest module
        self.trusted: dict[str, str] = {}  # name in the tests -> key of a trusted function (grading.TRUSTED)
        self.math: set[str] = set()
        self.functions: dict[str, ast.FunctionDef] = {}
        self._bind_imports(tree)

    # --- imports and trusted names -------------------------------------------------------------
    def _bind_imports(self, tree: ast.Module) -> None:
        bound = set()
        for stmt in tree.body:
            for node in ast.walk(stmt) if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) else ():
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    bound.add(node.id)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(stmt.name)
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    {"pytest": self.pytest, "math": self.math}.get(a.name, set()).add(a.asname or a.name)
                    bound.add(a.asname or a.name.split(".")[0])
            elif isinstance(stmt, ast.ImportFrom):
                for a in stmt.names:
                    key = {"math": f"_f_math_{a.name}" if a.name in TRUSTED_MATH else None,
                           "pytest": "_f_approx" if a.name == "approx" else None}.get(stmt.module)
                    if key:
                        self.trusted[a.asname or a.name] = key
                    if stmt.module == "pytest" and a.name not in ("approx", "raises"):
                        raise PlanError(f"tests: line {stmt.lineno}: pytest.{a.name} is not supported (supported: "
                                        "raises, approx, mark.parametrize)")
                    bound.add(a.asname or a.name)
        for name in TRUSTED_BUILTINS:
            if name not in bound:
                self.trusted[name] = f"_f_{name}"
        if "math" not in bound:  # MBPP's tests use math.isclose and leave the import to the solution
            self.math.add("math")
        self.raises_names = {a.asname or a.name for s in tree.body if isinstance(s, ast.ImportFrom)
                             and s.module == "pytest" for a in s.names if a.name == "raises"}

    def _trusted_key(self, func: ast.expr) -> str | None:
        if isinstance(func, ast.Name):
            return self.trusted.get(func.id) or (func.id if func.id.startswith("_tpurl_") else None)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            if func.value.id in self.math and func.attr in TRUSTED_MATH:
                return f"_f_math_{func.attr}"
            if func.value.id in self.pytest and func.attr == "approx":
                return "_f_approx"
        return None

    # --- checks --------------------------------------------------------------------------------
    def _split(self, node: ast.expr, probes: list[ast.expr]) -> ast.expr:
        """The parent's skeleton of `node`; candidate-dependent parts are appended to `probes`."""
        if _is_literal(node):
            return node
        if isinstance(node, ast.Compare):
            return ast.Compare(left=self._split(node.left, probes), ops=node.ops,
                               comparators=[self._split(c, probes) for c in node.comparators])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            return ast.UnaryOp(op=node.op, operand=self._split(node.operand, probes))
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return type(node)(elts=[self._split(e, probes) for e in node.elts], ctx=ast.Load())
        key = self._trusted_key(node.func) if isinstance(node, ast.Call) else None
        if key and not any(isinstance(a, (ast.Starred, ast.Lambda)) for a in node.args) and all(
                k.arg in TRUSTED_KEYWORDS.get(key, ()) for k in node.keywords):
            return ast.Call(func=ast.Name(id=key, ctx=ast.Load()), args=[self._split(a, probes) for a in node.args],
                            keywords=[ast.keyword(arg=k.arg, value=self._split(k.value, probes))
                                      for k in node.keywords])
        probes.append(node)
        return ast.Name(id=f"_p{len(probes) - 1}", ctx=ast.Load())

    def _check(self, test: ast.expr, at: ast.AST) -> ast.stmt:
        probes: list[ast.expr] = []
        skeleton = ast.fix_missing_locations(ast.Expression(body=self._split(test, probes)))
        check = Check(id=len(self.checks), line=at.lineno, text=ast.unparse(test)[:200],
                      skeleton=compile(skeleton, f"<check line {at.lineno}>", "eval"), probes=len(probes))
        self.checks.append(check)
        call = _recorder_call(at, "check", check.id, [ast.Tuple(elts=probes, ctx=ast.Load())])
        return ast.copy_location(ast.Expr(value=call), at)

    def _raises(self, call: ast.Call, at: ast.AST) -> ast.Call:
        """`pytest.raises(E, match=...)` / `assertRaises(E)` / `assertRaisesRegex(E, regex)` -> recorder call."""
        if not call.args:
            raise PlanError(f"tests: line {at.lineno}: raises needs an exception class")
        pattern = call.args[1] if _name(call.func) == "assertRaisesRegex" and len(call.args) > 1 else next(
            (k.value for k in call.keywords if k.arg in ("match", "expected_regex")), None)
        if pattern is not None and not (isinstance(pattern, ast.Constant) and isinstance(pattern.value, str)):
            raise PlanError(f"tests: line {at.lineno}: the expected message pattern must be a string literal")
        kinds = call.args[0].elts if isinstance(call.args[0], ast.Tuple) else [call.args[0]]
        names = []
        for k in kinds:
            builtin = isinstance(k, ast.Name) and k.id not in self.functions and isinstance(
                getattr(builtins, k.id, None), type) and issubclass(getattr(builtins, k.id), BaseException)
            names.append(f"builtins.{k.id}" if builtin else f".{_name(k)}")
        check = Check(id=len(self.checks), line=at.lineno, text=f"raises {ast.unparse(call.args[0])}"[:200],
                      skeleton=None, raises=tuple(names), match=None if pattern is None else pattern.value)
        self.checks.append(check)
        return _recorder_call(at, "raises", check.id, [call.args[0]])

    def _is_raises(self, node: ast.expr) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        return (_name(f) in _RAISES and isinstance(f, ast.Attribute)) or (
            isinstance(f, ast.Attribute) and f.attr == "raises" and isinstance(f.value, ast.Name)
            and f.value.id in self.pytest) or (isinstance(f, ast.Name) and f.id in self.raises_names)

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        return self._check(node.test, node)

    def visit_Expr(self, node: ast.Expr) -> ast.stmt:
        call = node.value
        method = _name(call.func) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) else ""
        if method in _RAISES and len(call.args) > 1 + (method == "assertRaisesRegex"):  # assertRaises(E, f, *args)
            n = 1 + (method == "assertRaisesRegex")
            body = ast.Expr(value=ast.Call(func=call.args[n], args=call.args[n + 1:], keywords=call.keywords))
            head = ast.Call(func=call.func, args=call.args[:n], keywords=[])
            return self.visit(ast.copy_location(ast.With(items=[ast.withitem(context_expr=head)], body=[body]), node))
        if method in _COMPARE or method in _HELPERS or method in ("assertTrue", "assertFalse", "assertIsNone",
                                                                  "assertIsNotNone"):
            return self._check(self._unittest_test(method, call), node)
        return self.generic_visit(node)

    def _unittest_test(self, method: str, call: ast.Call) -> ast.expr:
        """The assert expression equivalent to unittest's `self.<method>(...)`."""
        args = call.args
        need = 1 if method in ("assertTrue", "assertFalse", "assertIsNone", "assertIsNotNone") else 2
        if len(args) < need:
            raise PlanError(f"tests: line {call.lineno}: {method} needs {need} arguments")
        if method in _COMPARE:
            return ast.Compare(left=args[0], ops=[_COMPARE[method]()], comparators=[args[1]])
        if method in _HELPERS:
            keywords = [k for k in call.keywords if k.arg in ("places", "delta")]
            return ast.Call(func=ast.Name(id=_HELPERS[method], ctx=ast.Load()), args=args[:2], keywords=keywords)
        if method in ("assertIsNone", "assertIsNotNone"):
            op = ast.Is() if method == "assertIsNone" else ast.IsNot()
            return ast.Compare(left=args[0], ops=[op], comparators=[ast.Constant(None)])
        return args[0] if method == "assertTrue" else ast.UnaryOp(op=ast.Not(), operand=args[0])

    def visit_With(self, node: ast.With) -> ast.stmt:
        node.items = [ast.withitem(context_expr=self._raises(i.context_expr, node), optional_vars=i.optional_vars)
                      if self._is_raises(i.context_expr) else i for i in node.items]
        return self.generic_visit(node)

    # --- units and cases -----------------------------------------------------------------------
    def plan(self) -> Plan:
        body = list(self.tree.body)
        if self.entry_point and any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in body) and not any(
                isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and _name(s.value.func) == "check"
                for s in body):
            call = ast.parse(f"check({self.entry_point})").body[0]
            body.append(ast.increment_lineno(call, max((getattr(s, "end_lineno", 0) or 0) for s in body)))
        units: list[tuple[list[ast.stmt], str | None, list[ast.AST] | None]] = []  # (code, case name, reach)
        for stmt in body:
            units += self._units(stmt)
        sources, cases = [], []
        for code, name, reach in units:
            if name is not None and reach is None:  # a plain statement: a test iff it reaches a check
                name = name if self._required(code, set()) or self._reaches_any(code) else None
            if name is not None:
                cases.append(Case(name=name, unit=len(sources),
                                  required=frozenset(self._required(reach if reach is not None else code, set()))))
            sources.append(ast.unparse(ast.fix_missing_locations(ast.Module(body=code, type_ignores=[]))))
        pytest_names = self.pytest | self.raises_names | {n for n, k in self.trusted.items() if k == "_f_approx"}
        leftover = next((n for n in ast.walk(ast.Module(body=[c for u in units for c in u[0]], type_ignores=[]))
                         if isinstance(n, ast.Name) and n.id in pytest_names), None)
        if leftover is not None:
            raise PlanError(f"tests: line {getattr(leftover, 'lineno', '?')}: this use of pytest is not supported "
                            "(supported: assert, pytest.raises as a with-block, pytest.approx in an assert, "
                            "pytest.mark.parametrize)")
        if not cases:
            raise PlanError("tests: no tests found (write assert statements, test_* functions or unittest "
                            "TestCase classes)")
        return Plan(units=tuple(sources), cases=tuple(cases), checks=tuple(self.checks))

    def _units(self, stmt: ast.stmt) -> list[tuple[list[ast.stmt], str | None, list[ast.AST] | None]]:
        """The units of one top-level statement: (statements, test name or None, nodes whose checks
        the test must reach; None: the statements themselves)."""
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Compare) and ast.unparse(stmt.test) in (
                "__name__ == '__main__'", "'__main__' == __name__"):
            return []
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            stmt.names = [a for a in stmt.names if (a.name if isinstance(stmt, ast.Import) else stmt.module)
                          != "pytest"]
            return [([stmt], None, None)] if stmt.names else []
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if not stmt.name.startswith("test"):
                self.functions[stmt.name] = self.visit(stmt)
                return [([stmt], None, None)]
            return self._test_function(stmt)
        if isinstance(stmt, ast.ClassDef) and (stmt.name.startswith("Test") or any(
                _name(b).endswith("TestCase") for b in stmt.bases)):
            cls = self.visit(stmt)
            methods = [m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name.startswith("test")]
            run = [(ast.parse(f"__tpurl__.run_method({cls.name}, {m.name!r})").body, f"{cls.name}.{m.name}", m.body)
                   for m in methods]
            return [([cls], None, None)] + run
        new = self.visit(stmt)
        return [([new], f"line {stmt.lineno}", None)]

    def _test_function(self, fn: ast.FunctionDef) -> list:
        if isinstance(fn, ast.AsyncFunctionDef):
            raise PlanError(f"tests: line {fn.lineno}: async test {fn.name} is not supported")
        sets = [{}]
        for deco in fn.decorator_list:
            sets = [{**a, **b} for a, b in itertools.product(sets, self._parametrize(deco, fn))]
        fn.decorator_list = []
        params = [a.arg for a in fn.args.args]
        if sorted(params) != sorted(sets[0]):
            raise PlanError(f"tests: line {fn.lineno}: test {fn.name} takes arguments {params} that no "
                            "parametrize gives (fixtures are not supported)")
        out = []
        for k, values in enumerate(sets):
            name = fn.name if len(sets) == 1 and not values else f"{fn.name}__{k}"
            spec = self.visit(_specialize(copy.deepcopy(fn), name, values))
            out.append(([spec], None, None))
            label = fn.name if name == fn.name else f"{fn.name}[{k}]"
            out.append((ast.parse(f"{name}()").body, label, spec.body))
        return out

    def _parametrize(self, deco: ast.expr, fn: ast.FunctionDef) -> list[dict[str, ast.expr]]:
        if not (isinstance(deco, ast.Call) and ast.unparse(deco.func).split(".")[-2:] == ["mark", "parametrize"]
                and len(deco.args) >= 2):
            raise PlanError(f"tests: line {fn.lineno}: decorator {ast.unparse(deco)[:60]} on {fn.name} is not "
                            "supported (only pytest.mark.parametrize)")
        try:
            names = ast.literal_eval(deco.args[0])
        except ValueError:
            raise PlanError(f"tests: line {fn.lineno}: parametrize names must be a literal") from None
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if not isinstance(deco.args[1], (ast.List, ast.Tuple)):
            raise PlanError(f"tests: line {fn.lineno}: parametrize values must be a list written out")
        rows = [(row.elts if isinstance(row, ast.Tuple) and len(names) > 1 else [row]) for row in deco.args[1].elts]
        if any(len(r) != len(names) for r in rows):
            raise PlanError(f"tests: line {fn.lineno}: a parametrize row does not give {len(names)} values")
        return [dict(zip(names, r)) for r in rows]

    def _required(self, nodes, seen: set[str]) -> set[int]:
        """Checks reached unconditionally from `nodes` (following calls of test-file functions)."""
        out: set[int] = set()

        def visit(node: ast.AST) -> None:
            if (cid := _recorded_id(node)) is not None:
                out.add(cid)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.functions \
                    and node.func.id not in seen:
                seen.add(node.func.id)
                out.update(self._required(self.functions[node.func.id].body, seen))
            if isinstance(node, _CONDITIONAL):  # only the condition itself runs for sure
                first = {ast.If: "test", ast.IfExp: "test", ast.Match: "subject", ast.BoolOp: "values"}
                if type(node) in first:
                    part = getattr(node, first[type(node)])
                    visit(part[0] if isinstance(part, list) else part)
                return
            for field, value in ast.iter_fields(node):
                if isinstance(node, ast.Try) and field in ("handlers", "orelse") or field == "orelse" or (
                        isinstance(node, ast.With) and field == "body"
                        and any(_recorded_id(i.context_expr) is not None for i in node.items)):
                    continue
                for child in value if isinstance(value, list) else [value]:
                    if isinstance(child, ast.AST):
                        visit(child)

        for node in nodes:
            visit(node)
        return out

    def _reaches_any(self, nodes) -> bool:
        """Whether `nodes` could reach a check at all (under a condition too)."""
        names = {n.func.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name)}
        return any(_recorded_id(n) is not None for node in nodes for n in ast.walk(node)) or any(
            _recorded_id(n) is not None for f in names & self.functions.keys() for n in ast.walk(self.functions[f]))


class _Substitute(ast.NodeTransformer):
    def __init__(self, values: dict[str, ast.expr]):
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.values:
            return ast.copy_location(copy.deepcopy(self.values[node.id]), node)
        return node


def _specialize(fn: ast.FunctionDef, name: str, values: dict[str, ast.expr]) -> ast.FunctionDef:
    """`fn` without parameters, named `name`: literal values never assigned in the body are written
    into it (they stay with the parent), the others are assigned at its top."""
    assigned = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    inline = {k: v for k, v in values.items() if _is_literal(v) and k not in assigned}
    fn.name, fn.args = name, ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
    fn.body = [ast.Assign(targets=[ast.Name(id=k, ctx=ast.Store())], value=v, lineno=fn.lineno)
               for k, v in values.items() if k not in inline] + [_Substitute(inline).visit(s) for s in fn.body]
    return ast.fix_missing_locations(fn)
