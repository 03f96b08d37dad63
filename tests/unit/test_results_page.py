"""scripts/results_page.py: the tables and figures of docs/results.md regenerated from results/."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "scripts" / "results_page.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("results_page", mod)
    spec.loader.exec_module(mod)
    return mod


def _summary(root: Path, name: str, summaries: dict) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    seeds = list(range(len(next(iter(summaries.values())))))
    (root / name / "summary.json").write_text(json.dumps({"config": {"name": name}, "seeds": seeds,
                                                          "summaries": summaries}))


def _rounds(root: Path, name: str, label: str, seed: int, records: list[dict]) -> None:
    run = root / name / label / f"seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


PAGE = """# Results

## An experiment

<!-- table:exp columns=acc_mean,acc_worst -->
| strategy | mean acc | worst |
|---|---|---|
| fedavg | 0 | 0 |
| paper (Fig. 2) | 0.9 | – |
<!-- /table -->

Text between blocks stays.

<!-- table:absent -->
| strategy | mean acc |
|---|---|
| fedavg | 0.1234 |
<!-- /table -->
"""


@pytest.fixture()
def folders(tmp_path):
    results = tmp_path / "results"
    # Prepare: three seeds of two labels
    _summary(results, "exp", {
        "fedavg": [{"acc_mean": 0.5, "acc_worst": 0.1}, {"acc_mean": 0.6, "acc_worst": 0.2},
                   {"acc_mean": 0.7, "acc_worst": 0.6}],
        "drfa": [{"acc_mean": 0.4, "acc_worst": 0.3}, {"acc_mean": 0.4, "acc_worst": 0.3},
                 {"acc_mean": 0.4, "acc_worst": 0.3}],
    })
    page = tmp_path / "results.md"
    page.write_text(PAGE)
    return page, results


def test_table_cells_are_mean_and_population_std_over_seeds(folders, capsys):
    page, results = folders
    # Execute
    assert _script().main(["--page", str(page), "--results", str(results)]) == 0
    text = page.read_text()
    # Assert: by hand, acc_mean 0.5, 0.6, 0.7: mean 0.6, std sqrt((0.01 + 0 + 0.01)/3) = 0.08165;
    # acc_worst 0.1, 0.2, 0.6: mean 0.3, std sqrt((0.04 + 0.01 + 0.09)/3) = 0.21602; the runner's
    # table.md (flowerdro.runs.report) uses numpy's default ddof = 0, so the page does too.
    assert np.std([0.1, 0.2, 0.6], ddof=0) == pytest.approx(np.sqrt(0.14 / 3))
    assert "| fedavg | 0.6000 ± 0.0816 | 0.3000 ± 0.2160 |" in text
    assert "| drfa | 0.4000 ± 0.0000 | 0.3000 ± 0.0000 |" in text
    # the paper's hand-written row is kept after the generated ones, the rest of the page unchanged
    block = text.split("<!-- table:exp columns=acc_mean,acc_worst -->\n")[1].split("<!-- /table -->")[0]
    assert block.splitlines() == ["| strategy | mean acc | worst |", "|---|---|---|",
                                  "| fedavg | 0.6000 ± 0.0816 | 0.3000 ± 0.2160 |",
                                  "| drfa | 0.4000 ± 0.0000 | 0.3000 ± 0.0000 |", "| paper (Fig. 2) | 0.9 | – |"]
    assert "Text between blocks stays." in text
    # an experiment missing under results/ is reported and its block left as it is
    assert "| fedavg | 0.1234 |" in text
    assert "missing, left unchanged: table:absent" in capsys.readouterr().out


def test_check_detects_a_stale_table_and_writes_nothing(folders):
    page, results = folders
    script = _script()
    args = ["--page", str(page), "--results", str(results)]
    assert script.main([*args, "--check"]) == 1  # the page's placeholder row is stale
    assert page.read_text() == PAGE
    assert script.main(args) == 0
    assert script.main([*args, "--check"]) == 0
    current = page.read_text()
    summary = json.loads((results / "exp" / "summary.json").read_text())
    summary["summaries"]["drfa"][0]["acc_mean"] = 0.7
    (results / "exp" / "summary.json").write_text(json.dumps(summary))
    assert script.main([*args, "--check"]) == 1
    assert page.read_text() == current


def test_options_scale_digits_rows_and_an_empty_block(tmp_path):
    results = tmp_path / "results"
    _summary(results, "main_job", {"fedavg": [{"acc_worst20": 0.25}, {"acc_worst20": 0.35}],
                                   "afl": [{"acc_worst20": 0.5}, {"acc_worst20": 0.5}]})
    page = tmp_path / "results.md"
    page.write_text("<!-- table:main_job columns=acc_worst20 rows=afl,fedavg scale=100 digits=1 -->\n"
                    "<!-- /table -->\n")
    assert _script().main(["--page", str(page), "--results", str(results)]) == 0
    # 25 and 35 percent: mean 30.0, std 5.0; the rows in the order asked for
    assert page.read_text() == ("<!-- table:main_job columns=acc_worst20 rows=afl,fedavg scale=100 digits=1 -->\n"
                                "| strategy | worst-20% |\n|---|---|\n| afl | 50.0 ± 0.0 |\n"
                                "| fedavg | 30.0 ± 5.0 |\n<!-- /table -->\n")


def test_last_k_rounds_are_read_from_the_round_logs(tmp_path):
    results = tmp_path / "results"
    for seed, accs in ((0, [0.1, 0.2, 0.4]), (1, [0.3, 0.5, 0.6])):
        _rounds(results, "exp", "fedavg", seed, [{"round": r + 1, "acc_mean": a} for r, a in enumerate(accs)]
                + [{"round": 4}])  # a round without evaluation does not count
    page = tmp_path / "results.md"
    page.write_text("<!-- table:exp columns=acc_mean last=2 digits=3 -->\n<!-- /table -->\n")
    assert _script().main(["--page", str(page), "--results", str(results)]) == 0
    # seed 0: (0.2 + 0.4)/2 = 0.3, seed 1: (0.5 + 0.6)/2 = 0.55; mean 0.425, std 0.125
    assert "| fedavg | 0.425 ± 0.125 |" in page.read_text()


def test_robustness_reports_give_sweep_points(tmp_path):
    results = tmp_path / "results" / "rob"
    results.mkdir(parents=True)
    seeds = {"0": {"clean": 0.9, "affine_lambda": {"0.4": 0.7}}, "1": {"clean": 0.8, "affine_lambda": {"0.4": 0.5}}}
    (results / "robustness.json").write_text(json.dumps({"strategies": {"fedrobust": {"seeds": seeds, "clean": 0.85}}}))
    page = tmp_path / "results.md"
    page.write_text("<!-- table:rob source=robustness columns=clean,affine_lambda@0.4 digits=3 -->\n<!-- /table -->\n")
    assert _script().main(["--page", str(page), "--results", str(results.parent)]) == 0
    # clean 0.9, 0.8: 0.850 ± 0.050; affine 0.7, 0.5: 0.600 ± 0.100
    assert "| fedrobust | 0.850 ± 0.050 | 0.600 ± 0.100 |" in page.read_text()


def test_unknown_option_and_label_are_named(folders):
    page, results = folders
    page.write_text("<!-- table:exp colums=acc_mean -->\n<!-- /table -->\n")
    with pytest.raises(SystemExit, match="unknown option 'colums'; allowed: columns, rows"):
        _script().main(["--page", str(page), "--results", str(results)])
    page.write_text("<!-- table:exp rows=fedavg,afl -->\n<!-- /table -->\n")
    with pytest.raises(SystemExit, match="'afl' is not a label of its results"):
        _script().main(["--page", str(page), "--results", str(results)])


def test_figure_is_redrawn_and_check_compares_it(tmp_path):
    results = tmp_path / "results"
    for label, shift in (("fedavg", 0.0), ("drfa", 0.1)):
        _rounds(results, "exp", label, 0, [
            {"round": r, "acc_mean": 0.5 + shift, "acc_worst20": 0.2 + shift,
             "client_acc": {"0": 0.2 + shift, "1": 0.8}} for r in (1, 2)])
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    page.write_text("<!-- figure:exp -->\n![fairness](figures/exp.png)\n<!-- /figure -->\n")
    script = _script()
    args = ["--page", str(page), "--results", str(results)]
    assert script.main([*args, "--check"]) == 1  # no figure yet
    assert script.main(args) == 0
    assert (page.parent / "figures" / "exp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert script.main([*args, "--check"]) == 0  # drawing is deterministic
    _rounds(results, "exp", "drfa", 0, [{"round": 1, "acc_mean": 0.9, "acc_worst20": 0.9, "client_acc": {"0": 0.9}}])
    assert script.main([*args, "--check"]) == 1


def test_reach_column_counts_the_seeds_that_never_reach(tmp_path):
    results = tmp_path / "results"
    worst = {0: [0.2, 0.5, 0.6], 1: [0.1, 0.2, 0.3, 0.7], 2: [0.4, 0.3, 0.2]}  # first round >= 0.5: 2, 4, never
    _summary(results, "exp", {"drfa": [{"acc_worst": w[-1]} for w in worst.values()]})
    for seed, ws in worst.items():
        _rounds(results, "exp", "drfa", seed, [{"round": r + 1, "acc_worst": w} for r, w in enumerate(ws)])
    page = tmp_path / "results.md"
    page.write_text("<!-- table:exp columns=reach:acc_worst:0.5,acc_worst scale=100 digits=1 -->\n<!-- /table -->\n")
    assert _script().main(["--page", str(page), "--results", str(results)]) == 0
    # rounds 2 and 4: mean 3, std 1, in whole rounds whatever digits says; the third seed never;
    # final worst 60, 70, 20 %: mean 50.0, std sqrt((100 + 400 + 900)/3) = 21.6
    assert ("| strategy | first round worst ≥ 0.5 | worst |\n|---|---|---|\n"
            "| drfa | 3 ± 1 (1 of 3 never) | 50.0 ± 21.6 |\n") in page.read_text()


def test_the_results_pages_parse_and_link_existing_figures(tmp_path, capsys):
    # every block of docs/results.md has valid options (an empty results/ leaves them all as they are) ...
    page = ROOT / "docs" / "results.md"
    new, changed, missing = _script().update_page(page, tmp_path / "results", check=True)
    assert new == page.read_text() and changed == []
    assert "table:main_job (no " in " ".join(missing)
    text = page.read_text()
    assert len(missing) == len(re.findall(r"^<!-- (?:table|figure):", text, re.M))  # no marker went unparsed
    # ... and every image the results pages show exists
    for md in [page, *sorted((ROOT / "docs" / "results").glob("*.md"))]:
        for link in re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", md.read_text()):
            assert (md.parent / link).is_file(), f"{md.name} links a missing figure {link}"


def test_per_seed_table_shows_every_seed_then_mean_and_std(tmp_path):
    results = tmp_path / "results"
    _summary(results, "main_job", {"fedavg": [{"acc_worst20": 0.2}, {"acc_worst20": 0.3}, {"acc_worst20": 0.4}],
                                   "drfa": [{"acc_worst20": 0.5}, {"acc_worst20": 0.5}, {"acc_worst20": 0.8}]})
    page = tmp_path / "results.md"
    page.write_text("<!-- table:main_job per-seed=acc_worst20 scale=100 digits=1 -->\n<!-- /table -->\n")
    assert _script().main(["--page", str(page), "--results", str(results)]) == 0
    # fedavg 20, 30, 40 %: mean 30, std sqrt(200/3) = 8.2; drfa 50, 50, 80: mean 60, std sqrt(600/3) = 14.1
    assert page.read_text() == ("<!-- table:main_job per-seed=acc_worst20 scale=100 digits=1 -->\n"
                                "| strategy | seed 0 | seed 1 | seed 2 | worst-20%, mean ± std |\n"
                                "|---|---|---|---|---|\n"
                                "| fedavg | 20.0 | 30.0 | 40.0 | 30.0 ± 8.2 |\n"
                                "| drfa | 50.0 | 50.0 | 80.0 | 60.0 ± 14.1 |\n<!-- /table -->\n")
