"""The shape checks ``tox -e lint`` runs: tools/check_private_access.py and tools/check_shape.py.

The package passes both; each workaround a reviewer used to reach another package's internals is caught; each
documented exception passes; a function over 60 lines (decorators included) is named with its length, an import
circle between modules (type-checking imports included) with the path round.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


private_access = load_tool("check_private_access")
shape = load_tool("check_shape")


def check_source(source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Run the private-access check on one module holding ``source``; return its exit status and output."""
    package = tmp_path / "lora_sampler"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "_wire.py").write_text("_TABLE = {}\n")
    (package / "module.py").write_text(source)
    status = private_access.main([str(package)])
    return status, capsys.readouterr().out


def test_the_package_passes_the_private_access_check(capsys: pytest.CaptureFixture[str]) -> None:
    """lora_sampler reaches into no other package (and no other object of its own), and swaps no class."""
    assert private_access.main([str(ROOT / "lora_sampler")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize(
    ("source", "found"),
    [
        # a private name the package also defines somewhere (self._content) is no longer exempt
        (
            "class A:\n    def __init__(self):\n        self._content = b''\n\ndef f(r):\n    r._content = b''\n",
            "r._content",
        ),
        ("import requests\nrequests.auth._basic_auth_str('a', 'b')\n", "._basic_auth_str"),
        ("def f(sock):\n    sock._io_refs += 1\n", "sock._io_refs"),
        ("def f(r):\n    return getattr(r, '_' + 'content')\n", "computed name"),
        ("def f(r, name):\n    setattr(r, name, b'')\n", "computed name"),
        ("def f(r, name):\n    return hasattr(r, name) or delattr(r, name)\n", "computed name"),
        ("def f(fs):\n    return getattr(fs, '_strip_protocol')('x')\n", "'_strip_protocol'"),
        ("def f(r):\n    vars(r)['_content'] = b''\n", "vars(r)"),
        ("def f(r):\n    r.__dict__['_content'] = b''\n", "r.__dict__"),
        ("def f(future):\n    object.__setattr__(future, '_state', 'FINISHED')\n", "object.__setattr__(future"),
        ("def f(future):\n    future.__setattr__('_state', 'FINISHED')\n", "future.__setattr__"),
        ("def f(future, cls):\n    future.__class__ = cls\n", "__class__"),
        ("def f(future, cls):\n    setattr(future, '__class__', cls)\n", "__class__"),
        ("def f(manager, pool):\n    manager.pool_classes_by_scheme['http'] = pool\n", "pool_classes_by_scheme"),
        ("def f(manager):\n    return getattr(manager, 'key_fn_by_scheme')\n", "key_fn_by_scheme"),
        ("def f(fs):\n    return fs.call_s3('get_object', Bucket='b', Key='k')\n", "call_s3"),
        ("def f(fs):\n    fs.dircache.clear()\n", "dircache"),
        ("def f(fs):\n    return fs.s3.get_object(Bucket='b', Key='k')\n", "aiobotocore client"),
        ("def f(manager):\n    manager.connection_pool_kw['maxsize'] = 64\n", "connection_pool_kw"),
        ("import importlib\nimportlib.import_module('urllib3._collections')\n", "_collections"),
        ("import importlib\nimportlib.import_module('urllib3.' + '_collections')\n", "_collections"),
        ("__import__('concurrent.futures._base')\n", "_base"),
        ("from requests.utils import _parse_content_type_header\n", "_parse_content_type_header"),
        ("from urllib3._collections import HTTPHeaderDict\n", "urllib3._collections"),
        ("import concurrent.futures._base\n", "concurrent.futures._base"),
        ("def f(r):\n    return getattr(r, '__dict__')\n", "'__dict__'"),
        ("import operator\n\ndef f(r, name):\n    return operator.attrgetter(name)(r)\n", "computed name"),
        ("import operator\noperator.attrgetter('raw._fp')\n", "private or internal"),
        ("import operator\noperator.methodcaller('_get_conn')\n", "private or internal"),
        ("import sys\nsys.modules['urllib3._collections']\n", "private module"),
        ("import sys\n\ndef f(name):\n    return sys.modules[name]\n", "computed name"),
        ("def f(cls_of):\n    return super(cls_of)._private()\n", "._private"),
        # the package's own classes keep their private names to themselves
        (
            "class Box:\n    def _helper(self):\n        return 1\n\ndef f(other: Box):\n    other._helper()\n",
            "other._helper",
        ),
        ("def f(client):\n    return client._fleet\n", "client._fleet"),
    ],
)
def test_each_workaround_is_caught(source: str, found: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each way around the rule is reported with its line, and the exit status is 1."""
    status, out = check_source(source, tmp_path, capsys)
    assert status == 1, out
    assert found in out
    assert "module.py:" in out


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys._getframe(0)\n",
        "def f(point):\n    return point._replace(x=1)._asdict(), point._fields, point._make([1])\n",
        "def f(fs, path):\n    return fs._info(path), fs._cat_file(path), fs._ls(path), fs._find(path)\n",
        "def f(args):\n    return vars(args)\n",
        "import dataclasses\n\n@dataclasses.dataclass(frozen=True)\nclass P:\n    x: int\n\n"
        "    def __post_init__(self):\n        object.__setattr__(self, 'x', int(self.x))\n",
        "class S:\n    def __getstate__(self):\n        return dict(self.__dict__), vars(self)\n",
        "class S:\n    def __init__(self):\n        self._x = 1\n\n    def get(self, name):\n"
        "        return self._x, getattr(self, name), getattr(self, '_x')\n",
        "def f(r):\n    return getattr(r, 'status', None), hasattr(r, 'read1')\n",
        "from lora_sampler import _wire\n_wire._TABLE.clear()\n",
        "from . import _wire\n_wire._TABLE.clear()\n",
        "import lora_sampler._wire\nlora_sampler._wire._TABLE.clear()\n",
        "import importlib\nimportlib.import_module('lora_sampler._wire')\n",
        "import importlib\n\ndef f(name):\n    return importlib.import_module(name)\n",
        "class C:\n    def __setattr__(self, name, value):\n        super().__setattr__(name, value)\n",
        "import sys\nsys.modules['lora_sampler._wire']\n",
        "import operator\noperator.attrgetter('name')\n",
    ],
)
def test_documented_exceptions_and_own_names_pass(
    source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Documented private-looking API (os._exit, namedtuple methods, fsspec's async methods, vars(args)), a frozen
    dataclass setting its own field, an object's own attributes and the package's own modules pass."""
    status, out = check_source(source, tmp_path, capsys)
    assert status == 0, out


def test_every_allowed_name_says_where_it_is_documented() -> None:
    """The allow-lists explain each entry (the reason is what a reviewer checks)."""
    for table in (private_access.ALLOWED, private_access.ALLOWED_CODE, private_access.INTERNALS):
        assert all(isinstance(reason, str) and len(reason) > 10 for reason in table.values())


def function_source(body_lines: int, decorators: int = 0) -> str:
    """A module with one function of ``decorators`` decorators, a ``def`` line and ``body_lines`` body lines."""
    lines = ["import functools", ""]
    lines += ["@functools.lru_cache"] * decorators
    lines += ["def long_one():"] + [f"    x{index} = {index}" for index in range(body_lines)]
    return "\n".join(lines) + "\n"


def test_the_package_has_no_function_over_60_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """No function of lora_sampler is longer than 60 lines, decorators included."""
    assert shape.main([str(ROOT / "lora_sampler")]) == 0, capsys.readouterr().out


@pytest.mark.parametrize(
    ("body_lines", "decorators", "length"),
    [(60, 0, 61), (59, 1, 61), (58, 3, 62)],
    ids=["plain", "one decorator", "decorators"],
)
def test_a_function_over_60_lines_is_named_with_its_length(
    body_lines: int, decorators: int, length: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The count runs from the first decorator to the last line; the finding is ``path:line: name is N lines``."""
    (tmp_path / "module.py").write_text(function_source(body_lines, decorators))
    assert shape.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"module.py:3: long_one is {length} lines (limit 60)" in out


def test_a_function_of_60_lines_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """60 lines (a decorator, the def line and 58 more) is the limit, not over it."""
    (tmp_path / "module.py").write_text(function_source(58, 1))
    assert shape.main([str(tmp_path)]) == 0, capsys.readouterr().out


def test_a_nested_function_counts_on_its_own(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A long function nested in another is named itself (its parent is longer still)."""
    inner = ["    def inner():"] + [f"        y{index} = {index}" for index in range(61)]
    (tmp_path / "module.py").write_text("def outer():\n" + "\n".join(inner) + "\n    return inner\n")
    assert shape.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "module.py:2: inner is 62 lines" in out and "module.py:1: outer is 64 lines" in out


def write_package(tmp_path: Path, modules: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` holding ``modules`` (dotted names under it -> source)."""
    package = tmp_path / "pkg"
    for name, source in {"__init__": "", **modules}.items():
        path = package.joinpath(*name.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return package


def test_the_package_has_no_import_circle_between_modules() -> None:
    """No module of lora_sampler imports, directly or through others, a module that imports it."""
    assert list(shape.import_circles(ROOT / "lora_sampler")) == []


@pytest.mark.parametrize(
    ("modules", "circle"),
    [
        ({"a": "from pkg.b import B\nA = 1\n", "b": "from pkg.a import A\nB = 1\n"}, "pkg.a -> pkg.b -> pkg.a"),
        (
            {
                "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
                "b": "from . import a\n",
            },
            "pkg.a -> pkg.b -> pkg.a",
        ),
        (
            {"a": "def f():\n    import pkg.b\n", "b": "import pkg.c\n", "c": "from .a import f\n"},
            "pkg.a -> pkg.b -> pkg.c",
        ),
        (
            {"sub.x": "from ..sub import y\n", "sub.y": "from pkg.sub.x import X\n"},
            "pkg.sub.x -> pkg.sub.y -> pkg.sub.x",
        ),
        ({"sub.x": "Y = 1\n", "sub.__init__": "from pkg.sub.x import Y\n", "sub.z": "from pkg.sub import Y\n"}, None),
    ],
    ids=["direct", "type-checking only", "through a third, in a function", "relative", "a package re-exporting"],
)
def test_an_import_circle_is_named_with_where_it_starts(
    modules: dict[str, str], circle: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every import statement counts (under TYPE_CHECKING, in a function, relative); ``from pkg import name`` is an
    import of the submodule when ``name`` is one, else of the package; the finding names the path round."""
    package = write_package(tmp_path, modules)
    status = shape.main([str(package)])
    out = capsys.readouterr().out
    if circle is None:
        assert status == 0, out
    else:
        assert status == 1 and f"import circle: {circle}" in out and "1 import circle(s)" in out, out
