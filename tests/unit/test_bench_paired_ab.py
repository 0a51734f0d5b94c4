"""bench/paired_ab.py: the order of a paired A/B's runs and what its summary says."""

from __future__ import annotations

from pathlib import Path

from bench.paired_ab import paired, quartiles, run_in_tree

OLD, NEW = Path("old"), Path("new")


def test_runs_go_old_new_old_and_the_summary_sets_the_difference_beside_the_noise() -> None:
    seen: list[Path] = []
    figures = iter([10.0, 7.0, 11.0, 10.0, 8.0, 10.0, 12.0, 9.0, 12.0, 10.0, 6.0, 11.0])

    def measure(tree: Path) -> float:
        seen.append(tree)
        return next(figures)

    result = paired(measure, OLD, NEW, runs=4)
    assert seen == [OLD, NEW, OLD] * 4
    assert (result.old, result.new, result.again) == ([10, 10, 12, 10], [7, 8, 9, 6], [11, 10, 12, 11])
    assert result.summary() == ("new - old median -3.0 (IQR -3.8..-2.2), A/A median +0.5 (IQR +0.0..+1.0); 4 runs")
    assert quartiles([1.0, 2.0, 3.0, 4.0]) == "+1.2..+3.8"


def test_a_measurement_runs_the_script_in_the_tree_it_names(tmp_path: Path) -> None:
    """The figure comes from a fresh process whose working directory and import path are the tree."""
    (tmp_path / "where.py").write_text("import os, sys\nprint(len(os.getcwd()) + len(sys.argv))\n")
    assert run_in_tree(str(tmp_path / "where.py"), tmp_path, ["where", "a", "b"]) == len(str(tmp_path)) + 3


def test_the_metrics_harness_measures_this_trees_finish() -> None:
    from bench.metrics_ab import one_run

    assert one_run(batches=1, per_batch=50) > 0
