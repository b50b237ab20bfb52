"""The sm90 kernels' disk cache (`fp4moe.kernels.sm90.compiler`): a second process loads what the first
compiled, keys that differ compile apart, concurrent writers leave whole files, a compile log replayed in
another process fills another cache. CPU only: export and load need no GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fp4moe
from fp4moe import provenance
from fp4moe.kernels.sm90 import compiler

_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from fp4moe.kernels.sm90 import compiler, moe_launch
    start = time.perf_counter()
    kernels = [
        moe_launch.compile_finalize("fused", int(sys.argv[1]), 8, torch.bfloat16),
        moe_launch.compile_plan(32, 8, None),
    ]
    print(json.dumps({"compilations": compiler.compilations, "seconds": time.perf_counter() - start,
                      "callable": all(callable(k) for k in kernels)}))
    """
)


def _run(cache: Path, hidden: int = 7168) -> dict:
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FP4MOE_KERNEL_CACHE=str(cache))
    root = Path(fp4moe.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(hidden)], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    first = _run(tmp_path)
    assert first == {**first, "compilations": 2, "callable": True}
    assert len(list(tmp_path.glob("*.o"))) == 2 and not list(tmp_path.glob("*.partial.o"))
    second = _run(tmp_path)
    assert second == {**second, "compilations": 0, "callable": True}
    other_shape = _run(tmp_path, hidden=2048)  # a different static configuration compiles
    assert other_shape["compilations"] == 1


def test_concurrent_processes_leave_whole_files(tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FP4MOE_KERNEL_CACHE=str(tmp_path))
    root = Path(fp4moe.__file__).resolve().parents[1]
    processes = [
        subprocess.Popen([sys.executable, "-c", _SCRIPT, "4096"], env=env, cwd=root, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for process in processes:
        stdout, _ = process.communicate(timeout=300)
        assert process.returncode == 0 and json.loads(stdout.strip().splitlines()[-1])["callable"]
    assert len(list(tmp_path.glob("*.o"))) == 2 and not list(tmp_path.glob("*.partial.o"))
    assert _run(tmp_path, hidden=4096)["compilations"] == 0


def test_the_file_name_depends_on_the_key_the_architecture_and_the_toolchain(tmp_path):
    base = compiler.cache_file(tmp_path, ("k", 1), "sm_90a", "f")
    assert base == compiler.cache_file(tmp_path, ("k", 1), "sm_90a", "f")
    for other in (("k", 2), ("j", 1)):
        assert compiler.cache_file(tmp_path, other, "sm_90a", "f") != base
    assert compiler.cache_file(tmp_path, ("k", 1), "sm_100a", "f") != base
    assert compiler.cache_file(tmp_path, ("k", 1), "sm_90a", "g") != base


_CODE = textwrap.dedent(
    '''
    """A module."""
    SCALE = 2.0  # a constant


    class Kernel:
        """A kernel."""

        def body(self, x):
            """Doubles."""
            return x * SCALE
    '''
)


def test_the_kernel_cache_key_ignores_comments_docstrings_and_layout_but_not_code():
    """`provenance.python_code` is what keys compiled kernels to fp4moe's sources: editing documentation
    or the C++ host launcher must not throw away a precompiled cache, changing code must."""
    same = _CODE.replace('"""A kernel."""', '"""A kernel, documented anew."""').replace("# a constant", "")
    same = same.replace("return x * SCALE", "return (x *\n                    SCALE)  # wrapped")
    same = same.replace("SCALE = 2.0", 'SCALE = 2.0\n"""The factor: a docstring under a constant."""')
    assert provenance.python_code(same) == provenance.python_code(_CODE)
    for changed in (_CODE.replace("2.0", "3.0"), _CODE.replace("x * SCALE", "SCALE * x"), _CODE.replace("body", "run")):
        assert provenance.python_code(changed) != provenance.python_code(_CODE)
    # A string that is a value is code.
    assert provenance.python_code(_CODE.replace("x * SCALE", "x * SCALE, 'a value'")) != provenance.python_code(_CODE)


def test_the_cache_lives_in_the_user_cache_folder_unless_moved_or_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv(compiler.CACHE_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compiler.cache_directory() == tmp_path / "xdg" / "fp4moe" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compiler.cache_directory() == Path.home() / ".cache" / "fp4moe" / "kernels"
    monkeypatch.setenv(compiler.CACHE_VARIABLE, "off")
    assert compiler.cache_directory() is None
    monkeypatch.setenv(compiler.CACHE_VARIABLE, str(tmp_path))
    assert compiler.cache_directory() == tmp_path


def test_a_compile_log_replayed_elsewhere_fills_the_cache(tmp_path):
    # A run with FP4MOE_COMPILE_LOG records each configuration once; replaying the log in a fresh
    # process compiles them into another cache, which a third process then loads.
    log = tmp_path / "kernels.log"
    root = Path(fp4moe.__file__).resolve().parents[1]
    logged = dict(
        os.environ, CUTE_DSL_ARCH="sm_90a", FP4MOE_KERNEL_CACHE=str(tmp_path / "first"), FP4MOE_COMPILE_LOG=str(log)
    )
    script = _SCRIPT.replace("kernels = [", "kernels = [moe_launch.compile_plan(32, 8, None),")  # twice: logged once
    result = subprocess.run(
        [sys.executable, "-c", script, "4096"], env=logged, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(log.read_bytes().splitlines()) == 2
    replay = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FP4MOE_KERNEL_CACHE=str(tmp_path / "second"))
    replay.pop("FP4MOE_COMPILE_LOG", None)
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernel_cache", str(log)], env=replay, cwd=root, capture_output=True,
        text=True, timeout=300,
    )
    assert result.returncode == 0 and "2 of 2 configurations" in result.stdout, result.stdout + result.stderr
    assert len(list((tmp_path / "second").glob("*.o"))) == 2
    assert _run(tmp_path / "second", hidden=4096)["compilations"] == 0
