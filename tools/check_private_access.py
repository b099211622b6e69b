"""Fail on a use of another package's private names, or a class swapped on a live object, in lora_sampler.

lora_sampler uses only the public, documented API of the libraries below it (requests, urllib3, fsspec, s3fs,
tinker, the standard library): a minor release of one of them may change anything private and break every user at
once. This check reads the package's source (``ast``, nothing is imported) and reports:

- an attribute with one leading underscore (``obj._name``, ``getattr(obj, "_name")``), read or written, that
  lora_sampler does not define anywhere itself (as a module, a class, a function, a module or class variable, an
  attribute assigned on ``self`` or ``cls``, or a ``__slots__`` entry);
- an import of a name with a leading underscore, or from a private module, of another package;
- an assignment to ``__class__`` (``obj.__class__ = ...``, ``setattr(obj, "__class__", ...)``).

Documented exceptions are in ``ALLOWED``, each with where its library documents it.

    python tools/check_private_access.py [PACKAGE_DIR ...]     (default: lora_sampler)

Exit status 1 and one line per finding (``path:line: what``) when anything is found; 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Set, Tuple

#: Private-looking names that are public and documented, and why each may be used.
ALLOWED: Dict[str, str] = {
    # https://docs.python.org/3/library/os.html#os._exit: "exit the process ... without calling cleanup handlers".
    "_exit": "os._exit, documented in the os module",
    # https://docs.python.org/3/library/collections.html#collections.somenamedtuple._replace: the leading
    # underscore only keeps a namedtuple's methods apart from its field names.
    "_replace": "namedtuple._replace, documented in collections",
    "_fields": "namedtuple._fields, documented in collections",
    "_asdict": "namedtuple._asdict, documented in collections",
    "_make": "namedtuple._make, documented in collections",
    "_field_defaults": "namedtuple._field_defaults, documented in collections",
    # https://docs.python.org/3/library/sys.html#sys._getframe: documented (CPython-specific).
    "_getframe": "sys._getframe, documented in the sys module",
    # https://filesystem-spec.readthedocs.io/en/latest/async.html: an AsyncFileSystem's coroutines are its methods
    # with a leading underscore (listed in fsspec.asyn), run on its loop with fsspec.asyn.sync(loop, ..., timeout=).
    "_info": "AsyncFileSystem._info, fsspec's async guide",
    "_find": "AsyncFileSystem._find, fsspec's async guide",
    "_glob": "AsyncFileSystem._glob, fsspec's async guide",
    "_exists": "AsyncFileSystem._exists, fsspec's async guide",
    "_cat_file": "AsyncFileSystem._cat_file, fsspec's async guide",
}
#: The package whose own names are allowed.
OWN_PACKAGE = "lora_sampler"


def is_private(name: str) -> bool:
    """Whether ``name`` has a leading underscore and is not a dunder (``__init__``) name."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def python_files(roots: Iterable[Path]) -> List[Path]:
    """Every ``.py`` file under ``roots``, sorted."""
    return sorted(path for root in roots for path in ([root] if root.is_file() else root.rglob("*.py")))


def defined_names(files: Iterable[Path], trees: Dict[Path, ast.Module]) -> Set[str]:
    """Every private name the package defines itself: modules, classes, functions, assigned attributes, slots."""
    names: Set[str] = set()
    for path in files:
        names.update(part.removesuffix(".py") for part in path.parts)
        for node in ast.walk(trees[path]):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.add(node.attr)  # self._x = ...: the class defines it (obj._x = ... on another's object does not)
            elif isinstance(node, ast.Assign) and any(_is_name(t, "__slots__") for t in node.targets):
                names.update(_strings(node.value))
    return {name for name in names if is_private(name)}


def findings(path: Path, tree: ast.Module, own: Set[str]) -> Iterator[Tuple[int, str]]:
    """Yield ``(line, what)`` for each private use of another package and each class swap in one module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
                yield node.lineno, "assigns __class__ (a class swapped on a live object)"
            elif _is_foreign(node.attr, own):
                yield node.lineno, f"uses .{node.attr}, a private name lora_sampler does not define"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args[1:2]:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if node.func.id == "setattr" and name.value == "__class__":
                    yield node.lineno, "assigns __class__ through setattr (a class swapped on a live object)"
                elif node.func.id in ("getattr", "setattr", "hasattr", "delattr") and _is_foreign(name.value, own):
                    yield node.lineno, f"{node.func.id}(..., {name.value!r}): a private name of another package"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == OWN_PACKAGE:
                continue
            if any(is_private(part) for part in node.module.split(".")):
                yield node.lineno, f"imports from {node.module}, a private module of another package"
            for alias in node.names:
                if is_private(alias.name) and alias.name not in ALLOWED:
                    yield node.lineno, f"imports {alias.name} from {node.module}, a private name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] != OWN_PACKAGE and any(is_private(part) for part in parts):
                    yield node.lineno, f"imports {alias.name}, a private module of another package"


def main(argv: List[str]) -> int:
    """Check the packages named in ``argv`` (default: lora_sampler); print findings; return the exit status."""
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parents[1] / OWN_PACKAGE]
    files = python_files(roots)
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), str(path)) for path in files}
    own = defined_names(files, trees)
    found = [(path, line, what) for path in files for line, what in findings(path, trees[path], own)]
    for path, line, what in found:
        print(f"{path}:{line}: {what}")
    if found:
        print(
            f"{len(found)} private use(s) of other packages; use their public API (or list a documented exception in "
            "tools/check_private_access.py ALLOWED, with its reason)"
        )
    return 1 if found else 0


def _is_foreign(name: str, own: Set[str]) -> bool:
    return is_private(name) and name not in own and name not in ALLOWED


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _strings(node: ast.AST) -> Iterator[str]:
    for element in ast.walk(node):
        if isinstance(element, ast.Constant) and isinstance(element.value, str):
            yield element.value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
