"""Which code is running: a digest of fp4moe's sources, the package and the folders it maps in."""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

import fp4moe

SOURCE_SUFFIXES = (".py", ".cpp")


def _source_files(suffixes: tuple[str, ...]):
    """(name relative to its root's parent, path) of every file with one of `suffixes` in `fp4moe` and in
    the folders it maps in as `fp4moe.ops` and `fp4moe.meta_kernels`, in a fixed order."""
    roots = [Path(module.__file__).resolve().parent for module in (fp4moe, fp4moe.ops, fp4moe.meta_kernels)]
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in suffixes):
            yield str(path.relative_to(root.parent)), path


@functools.cache
def source_digest() -> str:
    """SHA-256 over the names and contents of the `.py` and `.cpp` files of `fp4moe` and of the
    folders it maps in. It names the code a result measured where git metadata is missing or stale."""
    digest = hashlib.sha256()
    for name, path in _source_files(SOURCE_SUFFIXES):
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


PYTHON_VERSION_FIELDS = frozenset({"type_params"})
"""AST fields that some Python versions have and others lack (3.12 added `type_params`); left out of
`python_code`, so that every version spells code without them alike."""


def python_code(source: str) -> str:
    """`source`'s syntax tree, spelled the same by every Python version from 3.11, without its comments,
    its layout and its string statements (the docstrings of its module, classes and functions, and those
    written under constants), which do nothing when run: what `kernel_source_digest` hashes."""

    def documents(statement) -> bool:
        return (
            isinstance(statement, ast.Expr)
            and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str)
        )

    def spelled(node) -> str:
        if isinstance(node, ast.AST):
            fields = [f"{field}={spelled(getattr(node, field, None))}" for field in node._fields if field not in PYTHON_VERSION_FIELDS]
            return f"{type(node).__name__}({','.join(fields)})"
        if isinstance(node, list):
            return f"[{','.join(spelled(item) for item in node if not documents(item))}]"
        return repr(node)

    return spelled(ast.parse(source))


@functools.cache
def kernel_source_digest() -> str:
    """SHA-256 over the names and `python_code` of fp4moe's Python sources: what keys the kernel cache.
    The kernels are compiled from Python alone, so the C++ sources, comments and the docstrings of modules,
    classes and functions are left out, and an edit of them keeps the kernels compiled before it (a cache
    filled on another machine by `benchmarks.precompile` included). Strings documenting constants are left out too."""
    digest = hashlib.sha256()
    for name, path in _source_files((".py",)):
        digest.update(name.encode())
        digest.update(python_code(path.read_text()).encode())
    return digest.hexdigest()
