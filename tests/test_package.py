"""The package as a user imports it: the op folders mapped into `fp4moe` come from its own checkout."""

from pathlib import Path

import fp4moe


def test_ops_and_fakes_come_from_the_checkout_of_fp4moe():
    # With an editable install of another checkout on the machine, setuptools' finder would map
    # fp4moe.ops and fp4moe.meta_kernels to that checkout's folders (silently testing other code).
    checkout = Path(fp4moe.__file__).resolve().parent.parent
    for package in (fp4moe.ops, fp4moe.meta_kernels, fp4moe.ops.quantize, fp4moe.meta_kernels.moe):
        assert Path(package.__file__).resolve().is_relative_to(checkout), package.__file__
