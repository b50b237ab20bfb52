"""`benchmarks.record` runs the record's three steps in order and returns them as one archive (no GPU
needed: the steps are stood in for)."""

import subprocess
import sys
import tarfile

from benchmarks import record


def test_the_record_runs_its_steps_in_order_and_packs_everything_into_one_archive(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, stdout, stderr, env):
        commands.append((command, env.get("FP4MOE_KERNEL_CACHE")))
        module, results = command[2], command[command.index("--out-dir") + 1]
        (tmp_path / "record").joinpath(f"{module}_{len(commands)}.json").write_text("{}")
        assert results == str(tmp_path / "record")
        stdout.write(f"{module} ran\n")
        return subprocess.CompletedProcess(command, 1 if module == "benchmarks.moe_host" else 0)

    monkeypatch.setattr(record.subprocess, "run", fake_run)
    failed = record.run(tmp_path, 7, tmp_path / "cache")

    assert failed == 1  # the host step's nonzero status is counted, after every step ran
    assert [command[1:] for command, _ in commands] == [
        ["-m", "benchmarks.moe", "--replays", "7", "--shapes", "glm", "qwen3_30b_a3b", "deepseek_v3_ep32",
         "--out-dir", str(tmp_path / "record")],
        ["-m", "benchmarks.moe", "--replays", "7", "--shapes", "deepseek_v3", "--out-dir", str(tmp_path / "record")],
        ["-m", "benchmarks.moe_host", "--out-dir", str(tmp_path / "record")],
    ]
    assert all(command[0] == sys.executable for command, _ in commands)
    assert {cache for _, cache in commands} == {str((tmp_path / "cache").resolve())}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.tgz"]  # the folder packed, then removed
    with tarfile.open(tmp_path / "record.tgz") as packed:
        names = sorted(packed.getnames())
        host_log = packed.extractfile("record/moe_host.log").read().decode()
    assert names == [
        "record", "record/benchmarks.moe_1.json", "record/benchmarks.moe_2.json", "record/benchmarks.moe_host_3.json",
        "record/moe_deepseek_v3.log", "record/moe_glm.log", "record/moe_host.log",
    ]
    assert host_log == "benchmarks.moe_host ran\n"
