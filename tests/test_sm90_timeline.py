"""`benchmarks.sm90_timeline` (needs a GPU to run) reads kernel spans out of a profiler trace: checked here
on a synthetic trace; and it refuses unknown probe variants before it looks for a GPU."""

import pytest

from benchmarks.sm90_timeline import kernel_role, main, replay_spans


def _replay(first_ts, kernels):
    """A flush, then `kernels` as (name, start after the flush's end, duration)."""
    events = [{"name": "at::native::reduce_kernel<...>", "ts": first_ts, "dur": 100.0}]
    events += [{"name": name, "ts": first_ts + 100.0 + start, "dur": dur} for name, start, dur in kernels]
    return events


def test_replay_spans_are_medians_from_each_replays_first_kernel():
    plan, gemm = "kernel_cutlass_kernel_fp4moe_MoEPlanSm90_object", "kernel_cutlass_kernel_MoEGemmSm90_object"
    events = _replay(0.0, [(plan, 0.0, 50.0)])  # the first replay (the profiler's start) is dropped
    events += _replay(1000.0, [(plan, 5.0, 2.0), (gemm, 6.0, 40.0)])
    events += _replay(2000.0, [(plan, 7.0, 3.0), (gemm, 7.5, 42.0)])
    events += _replay(3000.0, [(plan, 6.0, 4.0), (gemm, 9.0, 38.0)])
    events += _replay(4000.0, [(plan, 1.0, 2.0)])  # a replay of another kernel count is left out
    spans = replay_spans(events)
    assert [role for role, *_ in spans] == ["Plan", "Gemm"]
    assert spans[0] == ("Plan", 0.0, 3.0, 3.0)
    assert spans[1] == ("Gemm", 1.0, 41.0, 40.0)


def test_kernel_roles_come_from_the_kernel_class_names():
    assert kernel_role("kernel_cutlass_kernel_fp4moekernelssm90quantizeQuantizeSm90_object_at") == "Quantize"
    assert kernel_role("kernel_cutlass_kernel_fp4moekernelssm90moe_finalizeMoEFinalizeSm90_obj") == "Finalize"
    assert kernel_role("void something_else<float>()") == "void something_else<float>()"


def test_an_unknown_probe_variant_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--variants", "skeleton", "no_such_variant"])
    assert exit_info.value.code == 2
    assert "unknown variants ['no_such_variant']" in capsys.readouterr().err
