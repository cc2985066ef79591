"""Tools for the `tool_use` env: a Python function as a JSON-schema tool spec, and the built-ins `calculator`
(arithmetic by walking the expression's AST: no eval) and `search` (BM25 over a local document collection).

A user tool is any function with typed arguments and a docstring, named in the recipe as "pkg.mod:fn":

    def lookup_price(item: str, quantity: int = 1) -> str:
        \"\"\"Price of an item in dollars.

        Args:
            item: the item's name
            quantity: how many
        \"\"\"

becomes {"name": "lookup_price", "description": "Price of an item in dollars.", "parameters": {"type": "object",
"properties": {"item": {"type": "string", "description": "the item's name"}, "quantity": {"type": "integer", ...}},
"required": ["item"]}}. It may be async; its result is sent back as text (JSON for non-strings).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import types
import typing
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backends.errors import UserError
from runner.recipe.common import Json

JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
                              dict: "object"}


class ToolError(Exception):
    """A call the tool refused (bad arguments, a bad expression): its message goes back to the model."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Json  # JSON schema of the arguments (an object)
    fn: Callable[..., object]  # its result goes back to the model as text

    @property
    def spec(self) -> Json:
        """The cookbook's ToolSpec: {name, description, parameters}."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    async def call(self, arguments: Json, timeout_s: float) -> str:
        """The result as text; ToolError for arguments that do not fit the schema, a tool that raises, or one
        that runs past timeout_s."""
        check_arguments(self, arguments)
        try:
            if inspect.iscoroutinefunction(self.fn):
                out = await asyncio.wait_for(self.fn(**arguments), timeout_s)
            else:
                out = await asyncio.wait_for(asyncio.to_thread(self.fn, **arguments), timeout_s)
        except TimeoutError:
            raise ToolError(f"{self.name} timed out after {timeout_s:g} s") from None
        except ToolError:
            raise
        except Exception as e:  # noqa: BLE001 - the tool's failure is the model's tool result, not a crash
            raise ToolError(f"{self.name} raised {type(e).__name__}: {str(e)[:200]}") from None
        return out if isinstance(out, str) else json.dumps(out, default=str)


def check_arguments(tool: Tool, arguments: Json) -> None:
    props: Json = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolError(f"{tool.name} has no argument {', '.join(map(repr, unknown))}; it takes {sorted(props)}")
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"{tool.name} is missing argument {', '.join(map(repr, missing))}")
    for key, value in arguments.items():
        want = props[key].get("type")
        if want is not None and not _fits(value, want):
            raise ToolError(f"{tool.name}: argument {key!r} should be a {want}, got {json.dumps(value)[:60]}")


def _fits(value: object, want: str) -> bool:
    match want:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, (int, float)) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
    return True


# ---------------------------------------------------------------- a function as a tool spec


def _json_type(hint: object, where: str) -> Json:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return _json_type(args[0], where)
        raise UserError(f"{where}: a union type {hint} has no JSON-schema type here; use one type")
    if origin in (list, Sequence, tuple):
        args = typing.get_args(hint)
        out: Json = {"type": "array"}
        if args and args[0] is not Ellipsis:
            out["items"] = _json_type(args[0], where)
        return out
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {**_json_type(type(values[0]), where), "enum": values}
    if hint in JSON_TYPES:
        return {"type": JSON_TYPES[hint]}
    raise UserError(f"{where}: argument type {getattr(hint, '__name__', hint)} has no JSON-schema type; use str, "
                    "int, float, bool, list or dict")


def _arg_docs(doc: str) -> dict[str, str]:
    """Google-style "Args:" entries: name -> description."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:", "Parameters:"))
    except StopIteration:
        return out
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        m = re.match(r"\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)", line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def tool_from_function(fn: Callable[..., object], where: str, name: str | None = None) -> Tool:
    """A Tool from a function's signature, type hints and docstring (UserError naming `where` for what cannot
    become a JSON schema: a missing docstring or type hint, *args)."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].strip()
    if not description:
        raise UserError(f"{where}: the tool needs a docstring (its first paragraph is the description the model sees)")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - user code's annotations
        raise UserError(f"{where}: its type hints do not resolve: {e}") from None
    arg_docs = _arg_docs(doc)
    props: Json = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UserError(f"{where}: *{pname} cannot be declared to a model; name every argument")
        if pname not in hints:
            raise UserError(f"{where}: argument {pname!r} needs a type hint")
        prop = _json_type(hints[pname], f"{where} argument {pname!r}")
        if pname in arg_docs:
            prop["description"] = arg_docs[pname]
        props[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    parameters = {"type": "object", "properties": props, "required": required}
    return Tool(name or fn.__name__, description, parameters, fn)


# ---------------------------------------------------------------- calculator

_BINARY: dict[type[ast.operator], Callable[[float, float], float | complex]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS: dict[str, Callable[..., object]] = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max,
                                         "log": math.log, "exp": math.exp, "floor": math.floor, "ceil": math.ceil}
_CONSTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e100


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("exponent or base too large")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(out, complex):
            raise ToolError("the result is not a real number")
        if abs(out) > MAX_MAGNITUDE:
            raise ToolError("the result is too large")
        return out
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS
            and not node.keywords):
        try:
            out = _FUNCS[node.func.id](*(_eval(a) for a in node.args))
        except (ValueError, TypeError, OverflowError) as e:
            raise ToolError(f"{node.func.id}: {e}") from None
        if not isinstance(out, (int, float)):  # of numbers, each is a number
            raise ToolError(f"{node.func.id}: the result is not a real number")
        return out
    raise ToolError(f"unsupported expression: {ast.unparse(node)[:60]!r}; use numbers, + - * / // % ** (), "
                    f"{', '.join(sorted(_FUNCS))}")


def format_number(x: float | int) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    if isinstance(x, float):
        return f"{x:.10g}"
    return str(x)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. "(12 + 30) * 2 / 7" or "sqrt(2)".

    Args:
        expression: numbers, + - * / // % ** and parentheses, sqrt abs round min max log exp floor ceil, pi, e
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip().replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ToolError(f"not an arithmetic expression: {expression[:60]!r}") from None
    return format_number(_eval(tree))


# ---------------------------------------------------------------- search: BM25

_TOKEN = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset("a an and are as at be by for from has he in is it its of on or that the to was were what "
                      "when where which who will with how many much did does do".split())


def tokenize(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


@dataclass(frozen=True)
class Doc:
    id: str
    title: str
    text: str


class BM25:
    """Okapi BM25 (k1 = 1.5, b = 0.75) over title + text."""

    def __init__(self, docs: Sequence[Doc], k1: float = 1.5, b: float = 0.75):
        self.docs, self.k1, self.b = list(docs), k1, b
        self.tf_D = [Counter(tokenize(f"{d.title} {d.text}")) for d in self.docs]
        self.len_D = [sum(tf.values()) for tf in self.tf_D]
        self.avg_len = sum(self.len_D) / len(self.len_D) if self.docs else 0.0
        df: Counter[str] = Counter()
        for tf in self.tf_D:
            df.update(tf.keys())
        n = len(self.docs)
        self.idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = tokenize(query)
        out = []
        for tf, length in zip(self.tf_D, self.len_D, strict=True):
            s = 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    norm = f + self.k1 * (1 - self.b + self.b * length / (self.avg_len or 1.0))
                    s += self.idf[t] * f * (self.k1 + 1) / norm
            out.append(s)
        return out

    def top(self, query: str, k: int) -> list[tuple[Doc, float]]:
        scored = [(s, i) for i, s in enumerate(self.scores(query)) if s > 0]
        scored.sort(key=lambda x: (-x[0], x[1]))
        return [(self.docs[i], s) for s, i in scored[:k]]


def load_docs(rows: Sequence[object], where: Sequence[str]) -> list[Doc]:
    docs = []
    seen: set[str] = set()
    for row, w in zip(rows, where, strict=True):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise UserError(f"{w}: a search document is an object with a string `text` (and `id`, `title`)")
        doc_id = str(row.get("id", len(docs)))
        if doc_id in seen:
            raise UserError(f"{w}: document id {doc_id!r} appears twice")
        seen.add(doc_id)
        docs.append(Doc(doc_id, str(row.get("title", "")), row["text"]))
    if not docs:
        raise UserError("the search tool's document collection is empty")
    return docs


def search_tool(index: BM25, top_k: int) -> Tool:
    def search(query: str) -> str:
        """Search the document collection; returns the best-matching documents' titles and text.

        Args:
            query: keywords to look for
        """
        hits = index.top(query, top_k)
        if not hits:
            return "No results."
        return "\n".join(f"[{i}] {d.title} (id {d.id}): {d.text}" for i, (d, _) in enumerate(hits, 1))

    return tool_from_function(search, "the search tool")


def builtin_tools() -> dict[str, Callable[..., object]]:
    return {"calculator": calculator}
