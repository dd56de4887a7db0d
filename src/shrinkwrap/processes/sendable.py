"""Whether a fresh process can start at all: what it is sent must pickle, and the main script,
which a spawned process runs again, must let it (:func:`why_unsendable`; the main guard read from the
script's syntax tree)."""

from __future__ import annotations

import ast
import functools
import io
import os
import pickle
import sys
import types
from typing import Any, Iterator

from .._compat import caller_frame
from .copies import ModelCopies


def why_unsendable(args: tuple) -> str | None:
    """Why ``args`` cannot be sent to a spawned process, or None: they do not pickle; the main
    script would run again there to harm (:func:`_main_reruns`); or they name a function or
    class of ``__main__`` that a spawned process cannot find: one of an interactive session
    (``python -c``, a notebook), or one the script defines under ``if __name__ == "__main__":``,
    which the process does not run. Each reason says the fix.

    Example::

        >>> why_unsendable((lambda: None,))
        "the factory, batch, loss or plan does not pickle (Can't pickle <function <lambda> ...>): use ..."
    """
    finder = _MainNames(io.BytesIO())
    try:
        finder.dump(args)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types (PicklingError, AttributeError, TypeError)
        return (f"the factory, batch, loss or plan does not pickle ({exc}): use module-level functions for the "
                "factory and the loss")
    main = sys.modules.get("__main__")
    rerun = _main_reruns(main)
    if rerun or not finder.names:
        return rerun
    if _spawn_main_by(main) is None:
        return (f"{finder.names[0]} is defined in __main__ here (an interactive session, python -c or a "
                "notebook), which a spawned process cannot import: define it in a module and import it")
    tree = _script(main.__file__) if getattr(main, "__file__", None) else None
    bound = _defined_unguarded(tree) if tree is not None else None
    hidden = [n for n in finder.names if bound is not None and n.split(".")[0] not in bound]
    if hidden:
        return (f"{hidden[0]} is defined under `if __name__ == \"__main__\":`, which a spawned process does not "
                "run, so it cannot find it there: define it above that line")
    return None


class _MainNames(pickle.Pickler):
    """A pickler that notes the functions and classes of ``__main__`` it pickles by name, and
    the module classes of ``__main__`` in a model that travels as ``torch.save`` bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self.names: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            self.names.append(getattr(obj, "__qualname__", repr(obj)))
        elif isinstance(obj, ModelCopies):
            self.names += [type(m).__qualname__ for m in obj.model.modules() if type(m).__module__ == "__main__"]
        return NotImplemented


def _spawn_main_by(main: types.ModuleType | None) -> str | None:
    """How a spawned process runs this process's main module before its task, as
    :mod:`multiprocessing.spawn` does: ``"name"`` (imported by module name) or ``"path"`` (run from
    its file); None: it does not (an interactive session, ``python -c``, ``python -m`` of a
    package's ``__main__``)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else "name"
    path = getattr(main, "__file__", None)
    return None if path is None or os.path.splitext(os.path.basename(path))[0] == "ipython" else "path"


def _main_reruns(main: types.ModuleType | None) -> str | None:
    """Why the main script, which a spawned process runs before its task, would fail or do
    harm there: it is no file (a script read from standard input), or the call that starts the
    process sits at its top level, outside ``if __name__ == "__main__":``, so that the spawned
    process runs the script's work again (whatever comes before the call) and then fails to start
    processes of its own. None where the script is not run there, where the call is under that
    line, or where the call's line cannot be read (a thread; a script that cannot be parsed). A
    script edited since it started is read as it is now."""
    by = _spawn_main_by(main)
    path = getattr(main, "__file__", None)
    if by is None or path is None:
        return None
    if by == "path" and not os.path.isfile(path):
        return f"the main script {path!r} is not a file that a spawned process can run: run it from a file"
    frame = caller_frame(1)
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    tree = _script(path)
    if frame is None or tree is None or any(_in_guard(tree, frame.f_lineno)):
        return None
    return (f"{os.path.basename(path)} calls shrinkwrap at its top level (line {frame.f_lineno}), outside "
            "`if __name__ == \"__main__\":`, and a spawned process would run the script again: put the "
            "script's work under that line")


@functools.lru_cache(maxsize=8)
def _script(path: str) -> ast.Module | None:
    """The syntax tree of the script at ``path`` (its encoding as Python reads it), or None."""
    try:
        with open(path, "rb") as file:
            return ast.parse(file.read())
    except (OSError, SyntaxError, ValueError):
        return None


def _is_main_test(test: ast.expr) -> bool:
    """Whether ``test`` holds only where ``__name__ == "__main__"`` (alone, or in an ``and``)."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(v) for v in test.values)
    return _compares_name(test, ast.Eq)


def _compares_name(test: ast.expr, op: type) -> bool:
    """Whether ``test`` is ``__name__`` compared with ``"__main__"`` by ``op`` (either side first)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)):
        return False
    sides = [test.left, test.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def _guarded(node: ast.stmt) -> tuple[list[ast.stmt], list[ast.stmt]] | None:
    """For an ``if`` on the main guard, the branch that runs only in the main script and the
    other: ``if __name__ == "__main__":``'s body, or the ``else:`` of ``if __name__ != "__main__":``
    (``if not __name__ == "__main__":``); None for any other statement."""
    if not isinstance(node, ast.If):
        return None
    if _is_main_test(node.test):
        return node.body, node.orelse
    negated = isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not) and \
        _is_main_test(node.test.operand)
    if negated or _compares_name(node.test, ast.NotEq):
        return node.orelse, node.body
    return None


def _in_guard(tree: ast.Module, line: int) -> Iterator[ast.If]:
    """The main guards (:func:`_guarded`) whose guarded branch holds ``line``."""
    for node in ast.walk(tree):
        branches = _guarded(node)
        if branches and any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in branches[0]):
            yield node


def _defined_unguarded(tree: ast.Module) -> set[str]:
    """The names a script binds at its top level outside its main guards' guarded branches
    (functions, classes, assignments, imports), which a spawned process running it defines."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        branches = _guarded(node)
        if branches:
            todo += branches[1]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:  # if, try, with, for, while: their bodies run at the top level
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
    return names
