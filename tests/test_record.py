"""`benchmarks.record` runs the record's three steps in order and returns them as one archive (no GPU
needed: the steps are stood in for)."""

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks import record


def fake_steps(monkeypatch, outcome):
    """Stands in for the steps: each writes one result file into its `--out-dir` and a line of output,
    then `outcome(number, module)` gives its exit status (or raises). Returns the calls made."""
    calls = []

    def fake_run(command, stdout, stderr, env):
        calls.append((command, env.get("FP4MOE_KERNEL_CACHE")))
        module, results = command[2], Path(command[command.index("--out-dir") + 1])
        (results / f"{module}_{len(calls)}.json").write_text("{}")
        stdout.write(f"{module} ran\n")
        stdout.flush()
        return subprocess.CompletedProcess(command, outcome(len(calls), module))

    monkeypatch.setattr(record.subprocess, "run", fake_run)
    return calls


def archive_names(out_dir: Path) -> list[str]:
    with tarfile.open(out_dir / "record.tgz") as packed:
        return sorted(packed.getnames())


def test_the_record_runs_every_step_in_order_and_packs_them_into_one_archive(tmp_path, monkeypatch):
    calls = fake_steps(monkeypatch, lambda number, module: 3 if number == 1 else 0)
    assert record.main(["--out-dir", str(tmp_path / "out"), "--replays", "7", "--kernel-cache", str(tmp_path / "kc")]) == 1

    # The first step failed; the other two still ran, in order, each its own process with the cache set.
    results = calls[0][0][-1]
    assert [command[1:] for command, _ in calls] == [
        ["-m", "benchmarks.moe", "--replays", "7", "--shapes", "glm", "qwen3_30b_a3b", "deepseek_v3_ep32",
         "--out-dir", results],
        ["-m", "benchmarks.moe", "--replays", "7", "--shapes", "deepseek_v3", "--out-dir", results],
        ["-m", "benchmarks.moe_host", "--out-dir", results],
    ]
    assert all(command[0] == sys.executable for command, _ in calls)
    assert {cache for _, cache in calls} == {str((tmp_path / "kc").resolve())}
    # One file comes back; the working folder, outside it, is gone.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["record.tgz"]
    assert not Path(results).exists()
    assert archive_names(tmp_path / "out") == [
        "record", "record/benchmarks.moe_1.json", "record/benchmarks.moe_2.json", "record/benchmarks.moe_host_3.json",
        "record/moe_deepseek_v3.log", "record/moe_glm.log", "record/moe_host.log",
    ]
    with tarfile.open(tmp_path / "out" / "record.tgz") as packed:
        assert packed.extractfile("record/moe_glm.log").read().decode() == "benchmarks.moe ran\n"


def test_the_record_passes_when_every_step_passes_and_sets_no_cache_unasked(tmp_path, monkeypatch):
    monkeypatch.delenv("FP4MOE_KERNEL_CACHE", raising=False)
    calls = fake_steps(monkeypatch, lambda number, module: 0)
    assert record.main(["--out-dir", str(tmp_path)]) == 0
    assert len(calls) == 3 and {cache for _, cache in calls} == {None}
    assert all(command[command.index("--replays") + 1] == "100" for command, _ in calls[:2])


def test_a_record_cut_off_keeps_the_steps_it_finished(tmp_path, monkeypatch):
    def outcome(number, module):
        if number == 2:
            raise KeyboardInterrupt  # as the call's time limit stops it
        return 0

    fake_steps(monkeypatch, outcome)
    with pytest.raises(KeyboardInterrupt):
        record.run(tmp_path, 100, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.tgz"]
    names = archive_names(tmp_path)
    assert "record/benchmarks.moe_1.json" in names and "record/moe_glm.log" in names
    assert "record/benchmarks.moe_2.json" in names  # what the interrupted step had written
    assert "record/moe_host.log" not in names
