"""Fail on a use of another package's internals in lora_sampler: private names, computed names, reflection.

lora_sampler uses only the public, documented API of the libraries below it (requests, urllib3, fsspec, s3fs,
tinker, the standard library): a minor release of one of them may change anything private and break every user at
once. This check reads the package's source (``ast``, nothing is imported) and reports:

- an attribute with one leading underscore (``obj._name``), read or written, on anything but ``self``, ``cls`` or a
  module of the package itself; the package's own classes keep their private names to themselves too;
- ``getattr``/``setattr``/``hasattr``/``delattr`` with a computed (non-literal) name on anything but ``self`` or
  ``cls``, or with a literal private name (the same rule as an attribute); ``operator.attrgetter`` and
  ``methodcaller`` with a computed or private name;
- ``vars(obj)``, ``obj.__dict__``, ``obj.__setattr__`` / ``object.__setattr__(obj, ...)`` on anything but ``self``
  or ``cls`` (a frozen dataclass sets its own fields that way, as the dataclasses documentation says);
- an import of a name with a leading underscore, or from a private module, of another package, also through
  ``importlib.import_module``, ``__import__`` (any literal part of the module name is read) or ``sys.modules[...]``;
- a known undocumented internal whose name has no underscore (``INTERNALS``: ``pool_classes_by_scheme``,
  ``call_s3``, ...), as an attribute or a literal ``getattr`` name;
- an assignment to ``__class__`` (``obj.__class__ = ...``, ``setattr(obj, "__class__", ...)``).

Documented exceptions are in ``ALLOWED`` (names) and ``ALLOWED_CODE`` (exact expressions), each with where its
library documents it. Nothing is exempt because the package happens to define a name of the same spelling.

    python tools/check_private_access.py [PACKAGE_DIR ...]     (default: lora_sampler)

Exit status 1 and one line per finding (``path:line: what``) when anything is found; 0 otherwise.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Set, Tuple

#: Private-looking names that are public and documented, and where each library documents it.
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
# fsspec's async file systems (s3fs among them): "Async methods have names beginning with an underscore and are
# listed in the asyn module" (https://filesystem-spec.readthedocs.io/en/latest/async.html, the list is
# fsspec.asyn.async_methods); they are the documented way to call a store from a coroutine, run with
# fsspec.asyn.sync(loop, coroutine, timeout=...).
ALLOWED.update(
    (name, "fsspec's documented async method (fsspec async guide, fsspec.asyn.async_methods)")
    for name in (
        "_ls",
        "_cat_file",
        "_get_file",
        "_put_file",
        "_rm_file",
        "_cp_file",
        "_pipe_file",
        "_expand_path",
        "_info",
        "_isfile",
        "_isdir",
        "_exists",
        "_walk",
        "_glob",
        "_find",
        "_du",
        "_size",
        "_mkdir",
        "_makedirs",
    )
)

#: Exact expressions (``ast.unparse`` of the call) that a rule above would report, and where each is documented.
ALLOWED_CODE: Dict[str, str] = {
    # https://docs.python.org/3/library/argparse.html#the-namespace-object: "If you prefer to have dict-like view of
    # the attributes, you can use the standard Python idiom, vars()".
    "vars(args)": "argparse documents vars() on its Namespace",
    # https://peps.python.org/pep-0562/: a module's __getattr__ imports a name on first use with
    # importlib.import_module; `home` and `name` come from the package's own table of public names.
    "getattr(importlib.import_module(home), name)": "PEP 562 lazy import of the package's own public names",
}

#: Undocumented internals of the libraries below lora_sampler whose names carry no underscore: a client is tempted
#: by them to reach into a connection pool, a store's client or a cache, and each is reported like a private name.
INTERNALS: Dict[str, str] = {
    "pool_classes_by_scheme": "urllib3 PoolManager's scheme -> pool class table (undocumented)",
    "key_fn_by_scheme": "urllib3 PoolManager's scheme -> pool key function table (undocumented)",
    "ConnectionCls": "urllib3 HTTPConnectionPool's connection class (undocumented; pass a pool class instead)",
    "ResponseCls": "urllib3 HTTPConnectionPool's response class (undocumented)",
    "QueueCls": "urllib3 ConnectionPool's queue class (undocumented)",
    "num_connections": "urllib3 HTTPConnectionPool's connection counter (undocumented)",
    "num_requests": "urllib3 HTTPConnectionPool's request counter (undocumented)",
    "proxy_manager": "requests HTTPAdapter's proxy -> ProxyManager table (undocumented; use proxy_manager_for)",
    "pools": "urllib3 PoolManager's container of pools (undocumented; use connection_from_url and clear())",
    "connection_pool_kw": "urllib3 PoolManager's pool keywords (undocumented; pass them to the constructor)",
    "is_connection_dropped": "urllib3.util.connection's socket check (undocumented)",
    "call_s3": "s3fs S3FileSystem's raw botocore call (undocumented; use the file system's methods)",
    "s3": "s3fs S3FileSystem's aiobotocore client (undocumented attribute; use the file system's methods)",
    "dircache": "fsspec's listings cache (undocumented; use invalidate_cache() or use_listings_cache=False)",
    "iothread": "fsspec.asyn's event-loop thread (undocumented; use fsspec.asyn.get_loop())",
}

#: The package whose own modules may be reached into.
OWN_PACKAGE = "lora_sampler"
#: Names through which a class reaches its own attributes.
SELF_NAMES = ("self", "cls")
#: Attributes that read or write an object's attributes around its class.
REFLECTION = ("__dict__", "__setattr__", "__getattribute__", "__delattr__")
#: Builtins that take an object and an attribute name.
NAME_TAKERS = ("getattr", "setattr", "hasattr", "delattr")
#: ``operator`` helpers that take an attribute (or method) name first: a getattr in another spelling.
OPERATOR_NAME_TAKERS = ("attrgetter", "methodcaller")


def is_private(name: str) -> bool:
    """Whether ``name`` has a leading underscore and is not a dunder (``__init__``) name."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def python_files(roots: Iterable[Path]) -> List[Path]:
    """Every ``.py`` file under ``roots``, sorted."""
    return sorted(path for root in roots for path in ([root] if root.is_file() else root.rglob("*.py")))


def own_module_names(path: Path, tree: ast.Module) -> Set[str]:
    """The local names one module binds to modules of the package itself (``from . import _sources``, ...)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == OWN_PACKAGE:
                    names.add(alias.asname or OWN_PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            folder = _own_folder(path, node)
            for alias in node.names:
                if folder is not None and _is_module(folder / alias.name):
                    names.add(alias.asname or alias.name)
    return names


def findings(path: Path, tree: ast.Module) -> Iterator[Tuple[int, str]]:
    """Yield ``(line, what)`` for each use of another package's internals in one module."""
    modules = own_module_names(path, tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield from _attribute_findings(node, modules)
        elif isinstance(node, ast.Call) and ast.unparse(node) not in ALLOWED_CODE:
            yield from _call_findings(node, modules)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from _import_findings(node)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            yield from _module_table_findings(node)


def main(argv: List[str]) -> int:
    """Check the packages named in ``argv`` (default: lora_sampler); print findings; return the exit status."""
    roots = [Path(arg) for arg in argv] or [Path(__file__).resolve().parents[1] / OWN_PACKAGE]
    found: List[Tuple[Path, int, str]] = []
    for path in python_files(roots):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        found.extend((path, line, what) for line, what in sorted(set(findings(path, tree))))
    for path, line, what in found:
        print(f"{path}:{line}: {what}")
    if found:
        print(
            f"{len(found)} private name(s) or internal(s) reached from outside their owner; use the public API "
            "(or list a documented exception in tools/check_private_access.py ALLOWED or ALLOWED_CODE, with where "
            "it is documented)"
        )
    return 1 if found else 0


def _attribute_findings(node: ast.Attribute, modules: Set[str]) -> Iterator[Tuple[int, str]]:
    if node.attr == "__class__" and isinstance(node.ctx, ast.Store):
        yield node.lineno, "assigns __class__ (a class swapped on a live object)"
    elif node.attr in REFLECTION:
        if not _is_self(node.value) and not _is_own(node.value, modules) and not _is_object_on_self(node):
            yield node.lineno, f"uses {ast.unparse(node)}, reflection on an object that is not self"
    elif node.attr in INTERNALS and not _is_self(node.value):
        yield node.lineno, f"uses .{node.attr}: {INTERNALS[node.attr]}"
    elif _is_private_use(node.attr) and not _is_self(node.value) and not _is_own(node.value, modules):
        yield node.lineno, f"uses {ast.unparse(node)}, a private name of an object that is not self or own module"


def _call_findings(node: ast.Call, modules: Set[str]) -> Iterator[Tuple[int, str]]:
    function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
    if function in NAME_TAKERS and isinstance(node.func, ast.Name) and len(node.args) >= 2:
        yield from _name_taker_findings(node, function, modules)
    elif function in OPERATOR_NAME_TAKERS and node.args:
        name = node.args[0]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            yield node.lineno, f"{ast.unparse(node)}: {function}() with a computed name"
        elif _is_private_use(name.value.split(".")[-1]) or name.value in INTERNALS:
            yield node.lineno, f"{ast.unparse(node)}: {function}() of a private or internal name"
    elif function == "vars" and isinstance(node.func, ast.Name) and not _first_is_self(node):
        yield node.lineno, f"{ast.unparse(node)}: vars() of an object that is not self"
    elif (
        _is_object_on_self(node.func) and not _is_super(getattr(node.func, "value", None)) and not _first_is_self(node)
    ):
        yield node.lineno, f"{ast.unparse(node)}: reflection on an object that is not self"
    elif function in ("import_module", "__import__") and node.args:
        parts = _literal_parts(node.args[0])
        private = [part for part in parts if is_private(part)]
        if private and parts[0] != OWN_PACKAGE:
            yield node.lineno, f"{ast.unparse(node)}: imports a private module ({private[0]}) of another package"


def _name_taker_findings(node: ast.Call, function: str, modules: Set[str]) -> Iterator[Tuple[int, str]]:
    target, name = node.args[0], node.args[1]
    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        if not _is_self(target):
            yield node.lineno, f"{ast.unparse(node)}: {function}() with a computed name on an object that is not self"
    elif function == "setattr" and name.value == "__class__":
        yield node.lineno, "assigns __class__ through setattr (a class swapped on a live object)"
    elif name.value in REFLECTION and not _is_self(target):
        yield node.lineno, f"{function}(..., {name.value!r}): reflection on an object that is not self"
    elif name.value in INTERNALS and not _is_self(target):
        yield node.lineno, f"{function}(..., {name.value!r}): {INTERNALS[name.value]}"
    elif _is_private_use(name.value) and not _is_self(target) and not _is_own(target, modules):
        yield node.lineno, f"{function}(..., {name.value!r}): a private name of an object that is not self"


def _import_findings(node: ast.AST) -> Iterator[Tuple[int, str]]:
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module.split(".")[0] == OWN_PACKAGE:
            return
        if any(is_private(part) for part in node.module.split(".")):
            yield node.lineno, f"imports from {node.module}, a private module of another package"
        for alias in node.names:
            if _is_private_use(alias.name):
                yield node.lineno, f"imports {alias.name} from {node.module}, a private name"
    elif isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] != OWN_PACKAGE and any(is_private(part) for part in parts):
                yield node.lineno, f"imports {alias.name}, a private module of another package"


def _module_table_findings(node: ast.Subscript) -> Iterator[Tuple[int, str]]:
    """``sys.modules[...]``: a module reached around ``import`` must be named, and not be another's private one."""
    parts = _literal_parts(node.slice)
    if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        yield node.lineno, f"{ast.unparse(node)}: a module looked up by a computed name"
    elif parts and parts[0] != OWN_PACKAGE and any(is_private(part) for part in parts):
        yield node.lineno, f"{ast.unparse(node)}: a private module of another package"


def _is_private_use(name: str) -> bool:
    return is_private(name) and name not in ALLOWED


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in SELF_NAMES


def _is_own(node: ast.AST, modules: Set[str]) -> bool:
    """Whether ``node`` is a module of the package (``_sources``, ``lora_sampler._wire``, ``types.something``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in modules


def _is_object_on_self(node: ast.AST) -> bool:
    """``object.__setattr__`` / ``super().__setattr__``: checked where called (the first argument must be self)."""
    if not isinstance(node, ast.Attribute) or node.attr not in REFLECTION:
        return False
    return (isinstance(node.value, ast.Name) and node.value.id == "object") or _is_super(node.value)


def _first_is_self(node: ast.Call) -> bool:
    return bool(node.args) and _is_self(node.args[0])


def _is_super(node: Optional[ast.AST]) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _own_folder(path: Path, node: ast.ImportFrom) -> Optional[Path]:
    """The folder of the package module ``node`` imports from, or None when it imports from another package."""
    if node.level == 0:
        parts = (node.module or "").split(".")
        if parts[0] != OWN_PACKAGE:
            return None
        root = next((parent for parent in path.parents if parent.name == OWN_PACKAGE), None)
        return None if root is None else root.joinpath(*parts[1:])
    folder = path.parent
    for _ in range(node.level - 1):
        folder = folder.parent
    return folder.joinpath(*(node.module or "").split(".")) if node.module else folder


def _is_module(path: Path) -> bool:
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _literal_parts(node: ast.AST) -> List[str]:
    """The dotted parts of the literal text in a module-name expression (``"urllib3." + name`` -> urllib3)."""
    text = "".join(
        str(element.value)
        for element in ast.walk(node)
        if isinstance(element, ast.Constant) and isinstance(element.value, str)
    )
    return [part for part in text.split(".") if part]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
