"""Compile the sm90 kernels a run logged into the disk kernel cache, on any machine (no GPU needed).

    FP4MOE_COMPILE_LOG=$OUT/kernels.log python -m pytest -m gpu      # any run on the GPU logs its kernels
    CUTE_DSL_ARCH=sm_90a FP4MOE_KERNEL_CACHE=<folder> python -m benchmarks.kernel_cache kernels.log

A later GPU run of the same fp4moe sources with `FP4MOE_KERNEL_CACHE=<folder>` then loads those
kernels instead of compiling them (`fp4moe.kernels.sm90.compiler`): the log stays valid across
source changes, the cache does not. Prints one line per configuration; exits 1 if any failed to compile.
"""

from __future__ import annotations

import argparse
import sys

from fp4moe.kernels.sm90.compiler import cache_directory, replay_compile_log


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a file written under FP4MOE_COMPILE_LOG")
    args = parser.parse_args(argv)
    print(f"kernel cache: {cache_directory()}", flush=True)
    total, failed = replay_compile_log(args.log, progress=lambda line: print(line, flush=True))
    print(f"{total - failed} of {total} configurations compiled or found in the cache", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
