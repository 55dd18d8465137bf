"""What the house tests read in a module's syntax tree: a class's methods, and whether a method is
only an interface's `raise NotImplementedError` (its docstring aside)."""
import ast


def methods(cls: ast.ClassDef) -> dict:
    return {item.name: item for item in cls.body if isinstance(item, ast.FunctionDef)}


def unimplemented(fn: ast.FunctionDef) -> bool:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return (len(body) == 1 and isinstance(body[0], ast.Raise) and body[0].exc is not None
            and "NotImplementedError" in ast.unparse(body[0].exc))
