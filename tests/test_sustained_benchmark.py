"""`benchmarks.sustained`: the settled window's arithmetic on the CPU, the whole run on the GPU."""

import json
import types

import pytest
import torch

from benchmarks import sustained


def sampler_of(clocks, power, capped):
    return types.SimpleNamespace(clocks_mhz=clocks, power_w=power, power_capped=capped)


def test_the_settled_state_is_the_second_half_of_the_samples():
    state = sustained.settled_state(
        sampler_of([1980, 1980, 1900, 1740, 1700, 1720], [500, 600, 690, 700, 690, 695], [False, False, True, True, True, False])
    )
    assert state == {"sm_clock_mhz_median": 1720, "power_w_mean": 695, "power_capped_share": 2 / 3, "samples": 3}
    unknown_cap = sustained.settled_state(sampler_of([1980, 1700], [300.0, 650.0], []))
    assert unknown_cap["power_capped_share"] is None and unknown_cap["power_w_mean"] == 650.0


def test_energy_per_flop_is_mean_power_over_the_flop_rate():
    result = sustained.with_rates({"seconds_per_call": 2e-3, "power_w_mean": 700.0}, flops=10**12)
    assert result["tflops_per_s"] == pytest.approx(500.0)
    assert result["pj_per_flop"] == pytest.approx(1.4)  # 700 W / 5e14 FLOP/s


def test_a_row_names_a_failed_or_broken_cell():
    ok = sustained.table_row(
        "dense", {"status": "ok", "seconds_per_call": 1.5e-3, "tflops_per_s": 667.2, "sm_clock_mhz_median": 1470,
                  "power_capped_share": 1.0, "power_w_mean": 692.4, "pj_per_flop": 1.0377}
    )
    assert ok == ["dense", "1,500.0", "667", "1470", "100%", "692", "1.04", "-"]
    failed = sustained.table_row("moe", {"status": "fail", "rel_err": 0.5, "tolerance": 1e-3})
    assert failed[-1] == "FAIL (5.0e-01 > 1e-03)" and len(failed) == len(sustained.HEADERS)
    broken = sustained.table_row("moe", {"status": "error", "error": "ValueError: a call takes 60 us"})
    assert broken[-1] == "ERROR: ValueError: a call takes 60 us"


@pytest.mark.parametrize("argv", [["--seconds", "0"], ["--tokens", "0"], ["--gemm-size", "-1"], ["--impls", "nope"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        sustained.parse_args(argv)


def test_without_a_hopper_gpu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sustained.main([]) == 2
    assert "needs a Hopper GPU" in capsys.readouterr().err


def test_a_call_under_the_minimum_is_refused_before_it_is_timed(monkeypatch):
    """A call shorter than `MIN_CALL_S` (on the GPU: GLM at T = 1, tens of microseconds) is refused with the
    reason, before any window is timed. Tested here rather than on the GPU: there the refusal holds only on
    an otherwise idle GPU, since other processes' kernels (a parallel test run) lengthen a call past it."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(sustained, "_one_call_s", lambda call, device: sustained.MIN_CALL_S / 4)
    monkeypatch.setattr(sustained, "GpuStateSampler", None)  # a timed window would fail on it
    with pytest.raises(ValueError, match="host's launch rate would bound it"):
        sustained.sustain(lambda: calls.append(1), torch.device("cpu"), seconds=1.0)
    assert calls == [1]  # the warm-up call only


@pytest.mark.gpu
def test_a_sustained_run_checks_and_times_a_dense_gemm_and_a_moe_call(tmp_path):
    """GLM at T = 1024 (about 0.8 ms a call on the H200) is checked and timed, after the dense GEMM."""
    argv = ["--shapes", "glm", "--tokens", "1024", "--impls", "fused_moe_w4a16", "--seconds", "0.5",
            "--gemm-size", "8192", "--out-dir", str(tmp_path)]
    assert sustained.main(argv) == 0
    (result_file,) = tmp_path.glob("sustained_*.json")
    rows = {row["workload"]: row for row in json.loads(result_file.read_text())["rows"]}
    assert set(rows) == {"dense bf16 GEMM 8192^3", "glm T=1024 fused_moe_w4a16"}
    for row in rows.values():
        assert row["status"] == "ok" and row["replays"] >= 3 and row["samples"] >= 1
        assert 0 < row["tflops_per_s"] < 1000 and 0.1 < row["pj_per_flop"] < 100 and 300 < row["sm_clock_mhz_median"] <= 2100
    timed = rows["glm T=1024 fused_moe_w4a16"]
    assert timed["rel_err"] <= timed["tolerance"]
