"""The consumer probe's variants (`benchmarks.sm90_consumer_probe`, no GPU needed) remove what they say
they remove from the default GEMM1 of DeepSeek-V3 decode, and nothing of the producer."""

import textwrap

import pytest

from tests.sm90_compile import compile_in_subprocess, sass

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from benchmarks import sm90_consumer_probe as probe
    out = Path(sys.argv[1])
    _, configs1, _ = probe.gemm_configurations(1, 132)
    for name in probe.VARIANTS:
        compiled = probe.compile_variant(name, "gemm1", configs1[0][0])
        (out / f"{name}.cubin").write_bytes(compiled.__cubin__)
    """
)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    out = compile_in_subprocess(_SCRIPT, {}, tmp_path_factory.mktemp("consumer_probe"))
    return {name: sass(out / f"{name}.cubin") for name in ("default", "no_decode", "no_mma", "barriers_only")}


def test_each_variant_drops_its_part_of_the_consumer_k_step(variants):
    def count(name, instruction):
        return variants[name].count(instruction)

    assert count("default", "HGMMA") > 0 and count("default", "HMUL2.BF16_V2") > 0
    assert count("no_decode", "HGMMA") == count("default", "HGMMA") and count("no_decode", "HMUL2.BF16_V2") == 0
    assert count("no_mma", "HGMMA") == 0 and count("no_mma", "HMUL2.BF16_V2") == count("default", "HMUL2.BF16_V2")
    assert count("barriers_only", "HGMMA") == 0 and count("barriers_only", "HMUL2.BF16_V2") == 0
    for name in variants:  # the producer's bulk copies and gathers are every variant's
        assert "UBLKCP.S.G" in variants[name] and "LDGSTS" in variants[name], name
