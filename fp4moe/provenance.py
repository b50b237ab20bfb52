"""Which code is running: a digest of fp4moe's sources, the package and the folders it maps in."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import fp4moe

SOURCE_SUFFIXES = (".py", ".cpp")


@functools.cache
def source_digest() -> str:
    """SHA-256 over the names and contents of the `.py` and `.cpp` files of `fp4moe` and of the
    folders it maps in as `fp4moe.ops` and `fp4moe.meta_kernels`. It names the code a result measured
    where git metadata is missing or stale, and keys the kernel cache to the code that compiled it."""
    roots = [Path(module.__file__).resolve().parent for module in (fp4moe, fp4moe.ops, fp4moe.meta_kernels)]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
