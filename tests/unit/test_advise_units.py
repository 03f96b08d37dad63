"""The advisor's pieces: strength knobs of every strategy, budgets, the Pareto front, Welch's test."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest

from flowerdro.advise.config import Budget, parse_budget
from flowerdro.advise.report import pareto_front
from flowerdro.advise.verdict import welch
from flowerdro.settings import Knob, Settings, knobs, setting
from flowerdro.strategies.registry import ALGORITHMS, build_strategy, strength_knobs


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("num_partitions", [None, 20, 100])
def test_every_strategy_accepts_every_corner_of_its_knob_ranges(name, num_partitions):
    # Prepare: the corners of the knob box (both ends of every range, in every combination)
    box = strength_knobs(name)
    extra = {} if num_partitions is None else {"num-partitions": num_partitions}
    # Execute / Assert: the settings accept each corner, and hold exactly its values
    for corner in itertools.product(*[(k.low, k.high) for k in box.values()]):
        values = dict(zip(box, corner, strict=True))
        strategy = build_strategy(name, {**extra, **values})
        held = strategy.config.to_config()
        for key, value in values.items():
            assert held[key] == value, (name, key)


def test_the_knobs_leave_out_what_a_registry_entry_fixes():
    assert set(strength_knobs("fedmgda+")) == {"eps"}
    assert strength_knobs("fedavg-n") == {}          # FedMGDA+ with ε = 0
    assert strength_knobs("fedmgda") == {}           # no box at all
    assert set(strength_knobs("mgda-prox")) == {"eps", "proximal-mu"}
    assert set(strength_knobs("afl")) == {"dual-lr", "lambda-floor"}
    assert set(strength_knobs("drfa-prox")) == {"dual-lr", "lambda-floor", "rho"}
    assert strength_knobs("fedavg") == {} and strength_knobs("scaffold") == {} and strength_knobs("dsgd") == {}
    with pytest.raises(ValueError, match="unknown strategy 'nope'; allowed: .*fedavg"):
        strength_knobs("nope")


def test_a_knob_declaration_is_checked():
    with pytest.raises(ValueError, match="low < high"):
        Knob(1.0, 0.5)
    with pytest.raises(ValueError, match="log-scale knob needs low > 0"):
        Knob(0.0, 1.0, "log")
    with pytest.raises(ValueError, match="allowed: log, linear"):
        Knob(0.1, 1.0, "cubic")

    @dataclass(frozen=True)
    class Bad(Settings):
        steps: int = setting(3, "an integer is no knob", knob=Knob(1.0, 5.0, "linear"))

    with pytest.raises(TypeError, match="Bad.steps: a strength knob must be a float setting"):
        knobs(Bad)


@pytest.mark.parametrize(("text", "expected"), [
    ("30 min", Budget(seconds=1800.0)), ("2h", Budget(seconds=7200.0)), ("90 s", Budget(seconds=90.0)),
    ("1.5 m", Budget(seconds=90.0)), ("20000 client-rounds", Budget(client_rounds=20000)), ("", Budget()),
])
def test_a_budget_is_wall_time_or_client_rounds(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["30 minutes later", "0 min", "2.5 client-rounds", "lots"])
def test_a_bad_budget_names_the_forms_allowed(text):
    with pytest.raises(ValueError, match="budget: "):
        parse_budget(text)


def test_the_pareto_front_of_a_hand_drawn_set():
    # (mean, worst-20%): (0.9, 0.3) and (0.7, 0.6) and (0.8, 0.5) trade off; (0.7, 0.4) is
    # dominated by (0.8, 0.5); (0.6, 0.6) by (0.7, 0.6) (equal worst-20%, lower mean)
    points = [(0.9, 0.3), (0.7, 0.4), (0.8, 0.5), (0.7, 0.6), (0.6, 0.6)]
    assert pareto_front(points) == [3, 2, 0]


def _t_cdf_df4(t: float) -> float:
    """Student's t CDF with ν = 4 in closed form: 1/2 + (3/4)·x·(1 − x²/3), x = t / √(4 + t²)."""
    x = t / math.sqrt(4 + t * t)
    return 0.5 + 0.75 * x * (1 - x * x / 3)


def test_welch_on_a_hand_worked_example():
    # a = 1, 2, 3 and b = 4, 5, 6: means 2 and 5, sample variances 1 and 1, so
    # t = (2 − 5) / √(1/3 + 1/3) = −3/√(2/3), and the Welch–Satterthwaite degrees of
    # freedom are (2/3)² / (2·(1/3)²/2) = 4.
    res = welch([1, 2, 3], [4, 5, 6])
    t = -3 / math.sqrt(2 / 3)
    assert res["diff"] == -3.0
    assert math.isclose(res["t"], t, rel_tol=1e-12)
    assert math.isclose(res["p"], 2 * _t_cdf_df4(t), rel_tol=1e-9)


def test_welch_of_two_constant_samples():
    assert welch([0.5, 0.5], [0.5, 0.5])["p"] == 1.0
    assert welch([0.6, 0.6], [0.5, 0.5])["p"] == 0.0



def test_the_advisor_modules_import_one_another_without_a_circle():
    """Every import counts: module level, inside functions and under TYPE_CHECKING."""
    import ast
    from pathlib import Path

    import networkx as nx

    import flowerdro

    root = Path(flowerdro.__file__).resolve().parent
    modules = {".".join(("flowerdro", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    circles = [sorted(c) for c in nx.strongly_connected_components(graph)
               if len(c) > 1 and any(m.startswith("flowerdro.advise") for m in c)]
    assert circles == []
    assert graph.has_edge("flowerdro.advise.search", "flowerdro.advise.report")  # the graph is read
