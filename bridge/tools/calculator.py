"""The calculator tool: the integer value of an arithmetic expression (bridge/tasks/tool_arith.py).

    calculator("37*48")  # "1776"

+ - * // % and parentheses over integers, by an AST walk (no eval); no power operator, so
no expression it accepts can take long or allocate much (the sandbox limits it anyway).
"""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}  # fmt: skip


def calculator(expr: str) -> str:
    """The integer value of an arithmetic expression (+ - * // %, parentheses)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {ast.unparse(node)!r}")

    if not isinstance(expr, str) or len(expr) > 200:
        raise ValueError("expr must be a string of at most 200 characters")
    return str(value(ast.parse(expr.strip(), mode="eval").body))
