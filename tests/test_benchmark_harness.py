"""The benchmark harness: the MoE benchmark end to end (its smoke preset into a temporary directory, with a
deliberately wrong and a broken implementation registered beside the real ones; on the CPU a smoke test
without ceilings or ratios), where results go by default, the interleaved timing the quantizer benchmark
uses, the quantizer benchmark's report, and its refusal to run without a GPU."""

import contextlib
import io
import json
import subprocess
import tempfile
import time

import pytest
import torch

from benchmarks import moe, moe_implementations, moe_report, report, timing
from benchmarks import quantize as quantize_benchmark
from benchmarks.moe_cases import W4A16
from fp4moe import provenance
from benchmarks.moe_implementations import FUSED_MOE_TOLERANCE, REGISTRY, Implementation
from tests.devices import DEVICES

REFERENCE_CAP = 4


def _build_wrong(case):
    right = REGISTRY["fused_moe_w4a16"].build(case)
    # Off by 5% plus an offset, so that even a case whose tokens all go to other ranks (output 0) is wrong.
    return lambda: right() * 1.05 + 0.01


def _build_broken(case):
    raise RuntimeError("this kernel does not exist")


@pytest.fixture(scope="module", params=DEVICES)
def smoke_run(request, tmp_path_factory):
    """One run per device serves every test: (exit status, JSON results, stdout, output directory)."""
    device = request.param
    out_dir = tmp_path_factory.mktemp(f"moe_benchmark_{device}")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        for implementation in (
            Implementation("wrong", _build_wrong, lambda case: {"backend": "test"}, W4A16, FUSED_MOE_TOLERANCE),
            Implementation("broken", _build_broken, lambda case: {"backend": "test"}, W4A16, FUSED_MOE_TOLERANCE),
        ):
            patch.setitem(moe_implementations.REGISTRY, implementation.name, implementation)
        status = moe.main(
            ["--smoke", "--device", device, "--out-dir", str(out_dir), "--reference-max-tokens", str(REFERENCE_CAP),
             "--impls", *REGISTRY]
        )
    (json_path,) = out_dir.glob("moe_*.json")
    return status, json.loads(json_path.read_text()), stdout.getvalue(), out_dir


def test_smoke_run_measures_every_implementation(smoke_run):
    status, results, _, _ = smoke_run
    assert status == 1  # the wrong and the broken implementation
    on_gpu = results["config"]["device"] == "cuda"
    ceilings = results["ceilings"]
    if on_gpu:
        assert ceilings["read_bytes_per_s"] > 0 and ceilings["gemm_flops_per_s"] > 0
    else:  # a CPU run is a smoke test: nothing to judge by
        assert ceilings is None and results["config"]["smoke_test_only"] is True
    env = results["environment"]
    assert "--smoke" in env["command"] and env["torch"] == torch.__version__ and env["date"]
    assert env["fp4moe_source_sha256"] == provenance.source_digest()  # names the code without git
    assert results["config"]["cold_l2_applied"] is on_gpu
    assert results["config"]["l2_flush"] == ("read" if on_gpu else None)  # the default, where it applies

    assert [s["shape"]["name"] for s in results["shapes"]] == ["smoke", "smoke_ep"]
    cells = 0
    for shape in results["shapes"]:
        assert [row["num_tokens"] for row in shape["rows"]] == moe.SMOKE["tokens"]
        for row in shape["rows"]:
            assert row["bytes"] > 0 and row["flops"] >= 0
            if on_gpu:
                assert row["floor_s"] > 0
            else:
                assert "floor_s" not in row
            assert 0 <= row["touched_experts"] <= row["local_pairs"] <= row["num_tokens"] * shape["shape"]["top_k"]
            for name in (
                "bf16_grouped_mm", "fused_moe_w4a4_tensor", "fused_moe_w4a4_token", "fused_moe_w4a16", "aligned_moe",
            ):
                cell = row["results"][name]
                capped = cell["backend"] == "reference" and row["num_tokens"] > REFERENCE_CAP
                if capped:
                    assert cell["status"] == "skipped" and cell["reason"] == "cap"
                    continue
                assert cell["status"] == "ok", cell
                assert cell["rel_err"] <= cell["tolerance"]
                assert cell["median_s"] > 0 and cell["min_s"] <= cell["median_s"] <= cell["max_s"]
                assert cell["min_s"] <= cell["trimmed_mean_s"] <= cell["max_s"]
                if on_gpu:
                    assert cell["bandwidth_pct"] > 0 and cell["flops_pct"] >= 0
                else:
                    assert "bandwidth_pct" not in cell and "flops_pct" not in cell
                replays = "reference_replays" if cell["backend"] == "reference" else "replays"
                assert cell["replays"] == results["config"][replays]
                cells += 1
    assert cells > 0


def test_smoke_run_reports_wrong_and_broken_implementations(smoke_run):
    _, results, _, _ = smoke_run
    for shape in results["shapes"]:
        for row in shape["rows"]:
            wrong, broken = row["results"]["wrong"], row["results"]["broken"]
            assert wrong["status"] == "fail" and "median_s" not in wrong
            rel_err = float(wrong["rel_err"])  # "inf" where the expected rows are all zeros
            assert rel_err > wrong["tolerance"]
            assert broken["status"] == "error" and "this kernel does not exist" in broken["error"]


def test_smoke_run_writes_the_tables(smoke_run):
    _, results, stdout, out_dir = smoke_run
    assert "FAIL: rel err" in stdout and "ERROR: RuntimeError" in stdout
    on_gpu = results["config"]["device"] == "cuda"
    # Cells on the reference backend above the cap are skipped: on the CPU some always are; on a Hopper
    # GPU every fp4moe cell may run the kernels.
    capped = any(
        cell["status"] == "skipped" for shape in results["shapes"] for row in shape["rows"]
        for cell in row["results"].values()
    )
    assert ("skipped (cap)" in stdout) == capped
    # Column labels name the backend that ran: the W4A4 GEMMs are the sm90 kernels on a Hopper GPU.
    w4a4_backend = "cute_sm90" if on_gpu and torch.cuda.get_device_capability()[0] == 9 else "reference"
    assert f"fused_moe_w4a4_token [{w4a4_backend}]" in stdout and "bf16_grouped_mm [torch]" in stdout
    for shape in results["shapes"]:
        assert f"## {shape['shape']['name']}" in stdout
    (md_path,) = out_dir.glob("moe_*.md")
    assert md_path.read_text().strip() == stdout.strip()
    # The plot (it needs matplotlib) draws ratios: a GPU run's only.
    assert len(list(out_dir.glob("moe_*.png"))) == (on_gpu and report.pyplot() is not None)
    if not on_gpu:
        assert "Smoke test: on cpu" in stdout and "not performance numbers" in stdout and capped
        assert "%" not in stdout and "floor us" not in stdout and "Ceilings" not in stdout
        assert moe_report.CLOCK_COLUMN not in stdout  # no NVML samples without a GPU


def test_the_gpu_state_sampler_records_the_power_cap_share(monkeypatch):
    """`benchmarks.gpu_state` against a stand-in NVML: the share of samples whose clock event reasons carry
    the software power cap bit; an NVML that cannot say leaves the share None and still records clocks."""
    import itertools
    import sys
    import types

    from benchmarks import gpu_state

    reasons = itertools.cycle([gpu_state.SW_POWER_CAP, 0])
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlDeviceGetCurrentClocksEventReasons=lambda h: next(reasons)))
    monkeypatch.setattr(torch.cuda, "_get_pynvml_handler", lambda device: "handle", raising=False)
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device: 1740)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device: 700_000)
    with gpu_state.GpuStateSampler(torch.device("cuda")) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()
    assert summary["sm_clock_mhz_median"] == 1740 and summary["power_w_max"] == 700.0 and summary["samples"] >= 3
    assert 0.3 <= summary["power_capped_share"] <= 0.7

    def cannot_say(handle):
        raise RuntimeError("not supported")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlDeviceGetCurrentClocksEventReasons=cannot_say))
    with gpu_state.GpuStateSampler(torch.device("cuda")) as sampler:
        time.sleep(0.01)
    assert sampler.summary()["power_capped_share"] is None and sampler.summary()["sm_clock_mhz_min"] == 1740


def test_the_moe_table_gives_each_row_its_slowest_clock_and_power_cap_share():
    """Where cells were sampled (`benchmarks.gpu_state`), a row's clock column is the lowest median SM clock
    of its cells and the largest share of samples under the power cap; unsampled rows read "-"."""
    def cell(clock=None, capped=None):
        state = None if clock is None else {"sm_clock_mhz_median": clock, "sm_clock_mhz_min": clock - 100,
                                             "power_w_max": 700.0, "power_capped_share": capped, "samples": 50}
        return {"status": "ok", "median_s": 1e-3, "backend": "cute_sm90", "gpu_state": state}

    def row(tokens, results):
        return {"num_tokens": tokens, "local_pairs": 8 * tokens, "touched_experts": 8, "bytes": 1e6, "results": results}

    rows = [row(1, {"a": cell(1980, 0.0), "b": cell(1980, 0.0)}), row(4096, {"a": cell(1740, 0.9), "b": cell(1755, 0.95)}),
            row(8192, {"a": cell(), "b": cell()})]
    table = moe_report.shape_table({"shape": {"name": "s", "description": "d"}, "rows": rows}, ["a", "b"])
    lines = table.splitlines()
    assert moe_report.CLOCK_COLUMN in lines[2] and table.endswith(moe_report.CLOCK_NOTE)
    assert lines[4].endswith("| 1980 (0%) |") and lines[5].endswith("| 1740 (95%) |") and lines[6].endswith("| - |")
    unsampled = [row(1, {"a": cell(), "b": cell()})]
    assert moe_report.CLOCK_COLUMN not in moe_report.shape_table({"shape": {"name": "s", "description": "d"}, "rows": unsampled}, ["a", "b"])


def test_results_go_to_a_temporary_folder_unless_asked(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    kept = set(report.RESULTS_DIR.iterdir())
    args = ["--smoke", "--device", "cpu", "--shapes", "smoke", "--tokens", "1", "--impls", "fused_moe_w4a16"]
    assert moe.main(args) == 0
    (folder,) = tmp_path.glob("fp4moe-moe-*")
    assert len(list(folder.glob("moe_*.json"))) == 1 and len(list(folder.glob("moe_*.md"))) == 1
    assert str(folder) in capsys.readouterr().err  # the run says where its results went
    assert set(report.RESULTS_DIR.iterdir()) == kept


def test_the_source_revision_is_the_head_of_the_tree_own_checkout_only(monkeypatch, tmp_path):
    """`git_commit` names HEAD (with `-dirty` when tracked files differ) only where the benchmarks' tree is
    the top of its git checkout; a copy of the tree inside another repository's folder (an A/B copy)
    records None, not that repository's HEAD."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "tracked.txt").write_text("a\n")
    subprocess.run([*git, "-C", str(tmp_path), "add", "tracked.txt"], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-qm", "first"], check=True)
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(report, "REPOSITORY", tmp_path.resolve())
    assert report._source_revision() == head
    (tmp_path / "tracked.txt").write_text("b\n")
    assert report._source_revision() == f"{head}-dirty"
    copy = tmp_path / "copy"
    copy.mkdir()
    monkeypatch.setattr(report, "REPOSITORY", copy.resolve())
    assert report._source_revision() is None


def test_quantizer_benchmark_says_plainly_that_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in ([], ["--host-only"]):
        with pytest.raises(SystemExit, match=r"need a CUDA GPU \(Hopper, sm_90\); this machine has none"):
            quantize_benchmark.main(argv)


def test_routing_benchmark_says_plainly_that_it_needs_a_hopper_gpu(monkeypatch):
    from benchmarks import routing as routing_benchmark

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"need a Hopper \(sm_90\) GPU"):
        routing_benchmark.main([])


def test_interleaved_timing_rotates_the_calls_and_times_each_once_per_round():
    log = []

    def call(name, seconds):
        def run():
            log.append(name)
            time.sleep(seconds)

        return run

    replays, warmup = 5, 1
    fast, slow = timing.time_interleaved([call("a", 0.0), call("b", 0.004)], "cpu", replays, warmup)
    assert log == ["a", "b"] * warmup + ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert fast.replays == slow.replays == replays
    assert slow.median_s >= 0.004 > fast.median_s


def test_the_trimmed_mean_leaves_out_a_tenth_of_the_replays_at_each_end():
    seconds = [1.0] * 12 + [2.0] * 6 + [100.0, 0.001]  # two clusters, one outlier at each end
    t = timing.Timing.of(seconds)
    assert (t.median_s, t.min_s, t.max_s, t.replays) == (1.0, 0.001, 100.0, 20)
    assert t.trimmed_mean_s == (11 * 1.0 + 5 * 2.0) / 16


def test_an_unknown_l2_flush_is_refused():
    with pytest.raises(ValueError, match="l2_flush"):
        timing.time_interleaved([lambda: None], "cpu", 1, cold_l2=True, l2_flush="evict")


def test_quantizer_report_sets_each_shape_beside_the_yardstick_at_its_size():
    """The markdown of a made-up quantizer run: one table row per cell, the aux / rescan ratios, and per
    shape the yardstick (`torch.sum` over the bytes `quantize` moves) next to `quantize`."""
    env = {key: "x" for key in ("device", "driver", "torch", "nvidia-cutlass-dsl", "apache-tvm-ffi", "date", "command")}
    env["host_launcher"] = "cpp"
    shapes = [(rows, k) for k in quantize_benchmark.KS for rows in quantize_benchmark.ROWS]
    results = [
        {"quantizer": q, "rows": rows, "k": k, "us_per_call": 10.0 + i, "effective_GBps": 100.0,
         "percent_of_read_bw": 50.0 + i, "gpu_state": None}
        for rows, k in shapes
        for i, q in enumerate(quantize_benchmark.QUANTIZERS)
    ]
    yardsticks = [
        {"rows": rows, "k": k, "bytes_read": 4 * rows * k, "us_per_call": 2.5, "percent_of_read_bw": 77.7}
        for rows, k in shapes
        if rows >= quantize_benchmark.YARDSTICK_MIN_ROWS
    ]
    text = quantize_benchmark.markdown(
        {"environment": env, "read_bytes_per_s": 4.4e12, "results": results, "yardstick_at_size": yardsticks,
         "host_overhead_us": {"op quantize": 9.5}}
    )
    lines = text.splitlines()
    assert "| quantize | 8192 | 2048 | 10.00 | 100 | 50.0 | n/a |" in lines
    assert "| per_token_aux | 65536 | 7168 | 12.00 | 100 | 52.0 | n/a |" in lines
    assert "| 8192 | 2048 | 1.091 |" in lines  # aux 12 us / rescan 11 us
    assert "| 65536 | 7168 | 2.50 | 77.7 | 50.0 |" in lines
    assert sum(line.endswith("| 77.7 | 50.0 |") for line in lines) == len(yardsticks) == 2 * 3  # M >= 1024
    assert "| op quantize | 9.5 |" in lines
