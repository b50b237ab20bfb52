"""`benchmarks.ab` (the same-lease A/B of the MoE benchmark) on stub trees: no GPU needed."""

import json
import textwrap

from benchmarks import ab

_STUB = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out-dir") + 1])
    assert sys.argv[-1] == "--smoke" and os.environ["FP4MOE_KERNEL_CACHE"].endswith("{name}")
    result = {{"median_s": {seconds}, "trimmed_mean_s": 3 * {seconds}, "status": "{status}"}}
    report = {{"shapes": [{{"shape": {{"name": "tiny"}}, "rows": [{{"num_tokens": 1, "results": {{"fused_moe_w4a16": result}}}}]}}]}}
    (out / "moe_stub.json").write_text(json.dumps(report))
    """
)


def _tree(root, name, seconds, status="ok"):
    package = root / name / "benchmarks"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "moe.py").write_text(_STUB.format(name=name, seconds=seconds, status=status))
    return root / name


def test_rounds_alternate_the_order_of_the_trees():
    assert ab.round_orders(["main", "change"], 3) == [["main", "change"], ["change", "main"], ["main", "change"]]


def test_each_tree_runs_in_its_own_process_and_the_ratios_are_per_round(tmp_path):
    trees = [_tree(tmp_path, "main", 2e-6), _tree(tmp_path, "change", 1e-6), _tree(tmp_path, "broken", 1e-6, "error")]
    out = tmp_path / "out"
    assert ab.run(trees, 2, out, tmp_path / "caches", ["--smoke"]) == 0
    assert sorted(p.parent.name for p in (out / "main").glob("r*/*.json")) == ["r1", "r2"]
    lines = ab.compare(out, "main", ["change", "broken"])
    assert "main:       2.0" in lines[0] and "change:       1.0 ratio 2.000 [2.000 2.000]" in lines[0]
    assert lines[1:] == ["broken: tiny 1 fused_moe_w4a16 status error"]


def test_the_comparison_takes_the_chosen_statistic(tmp_path):
    trees = [_tree(tmp_path, "main", 2e-6), _tree(tmp_path, "change", 1e-6)]
    out = tmp_path / "out"
    assert ab.run(trees, 1, out, tmp_path / "caches", ["--smoke"]) == 0
    assert "main:       6.0" in ab.compare(out, "main", ["change"], "trimmed_mean")[0]
    assert "main:       2.0" in ab.compare(out, "main", ["change"])[0]


def test_a_failed_run_is_counted_and_the_others_go_on(tmp_path):
    good = _tree(tmp_path, "main", 2e-6)
    bad = _tree(tmp_path, "change", 1e-6)
    (bad / "benchmarks" / "moe.py").write_text("raise SystemExit(3)")
    assert ab.run([good, bad], 1, tmp_path / "out", tmp_path / "caches", ["--smoke"]) == 1
    assert json.loads(next((tmp_path / "out" / "main").glob("r1/*.json")).read_text())["shapes"]


def test_a_tree_with_fewer_rounds_is_compared_over_the_rounds_both_finished_and_named(tmp_path):
    trees = [_tree(tmp_path, "main", 2e-6), _tree(tmp_path, "change", 1e-6)]
    out = tmp_path / "out"
    assert ab.run(trees, 2, out, tmp_path / "caches", ["--smoke"]) == 0
    assert ab.compare(out, "main", ["change"])[1:] == []
    for result in (out / "change" / "r2").iterdir():  # as a time limit cutting the second round leaves it
        result.unlink()
    lines = ab.compare(out, "main", ["change"])
    assert "ratio 2.000 [2.000]" in lines[0]
    assert lines[1] == (
        "change: rounds r1 of main's r1 r2: its ratios are over the rounds both finished, main's times over all of its own"
    )


def test_no_round_starts_that_would_end_past_the_time_limit(tmp_path, capsys):
    assert ab.fits_another_round(0.0, [], 0.0)  # the first round always runs
    assert ab.fits_another_round(50.0, [30.0, 40.0], 90.0) and not ab.fits_another_round(51.0, [30.0, 40.0], 90.0)
    trees = [_tree(tmp_path, "main", 2e-6), _tree(tmp_path, "change", 1e-6)]
    out = tmp_path / "out"
    assert ab.run(trees, 3, out, tmp_path / "caches", ["--smoke"], time_limit_s=1e-3) == 0
    for tree in ("main", "change"):
        assert sorted(p.parent.name for p in (out / tree).glob("r*/*.json")) == ["r1"]
    assert "[ab] stopping before round 2/3" in capsys.readouterr().out
