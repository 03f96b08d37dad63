"""Flower's quickstart-pytorch stand-ins, converted by the README's own snippets, and run.

The README's section "Use flowerdro in your own Flower project" holds the conversion as
fenced blocks between ``<!-- snippet:NAME -->`` and ``<!-- /snippet -->``. A line ending in
``# was: OLD`` replaces the statement of the project's file that begins with ``OLD``
(``...`` in ``OLD`` stands for the rest of the statement); the other lines are inserted
before the next replaced statement, or appended at the end of the file; a line ``...``
only separates. :func:`convert` applies the blocks to a copy of a stand-in project
(tests/fixtures/quickstart_pytorch) exactly as they are written, so the README and the
tests cannot drift apart.

Run as a script (``python _quickstart.py API STRATEGY SEED ROUNDS``) it converts and runs one
experiment in a fresh process and prints its digest as JSON (the run-isolation tests
compare it with the same experiment run in-process after others).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "quickstart_pytorch"
APIS = ("message-api", "legacy-api")
PACKAGE = "pytorchexample"
#: The README blocks of each API: file of the project → snippet name.
SNIPPETS = {
    "message-api": {"server_app.py": "message-api-server", "client_app.py": "message-api-client"},
    "legacy-api": {"server_app.py": "legacy-api-server", "client_app.py": "legacy-api-client"},
}

_BLOCK = re.compile(r"<!-- snippet:([\w-]+) -->\s*```(\w+)\n(.*?)```\s*<!-- /snippet -->", re.DOTALL)


def readme_snippets(readme: Path = REPO / "README.md") -> dict[str, tuple[str, str]]:
    """Snippet name → (language, text) of every marked block of the README."""
    return {m.group(1): (m.group(2), m.group(3)) for m in _BLOCK.finditer(readme.read_text())}


def _normal(text: str) -> str:
    return " ".join(text.split())


def _target(source: str, old: str) -> tuple[int, int, str]:
    """(first line, end line, indentation) of the one simple statement of ``source`` that begins with ``old``."""
    prefix = _normal(old.split("...")[0])
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.stmt) or hasattr(node, "body"):
            continue
        text = _normal("\n".join(lines[node.lineno - 1:node.end_lineno]))
        if (text.startswith(prefix) if "..." in old else text == prefix):
            found.append((node.lineno - 1, node.end_lineno, lines[node.lineno - 1][:node.col_offset]))
    if len(found) != 1:
        raise ValueError(f"snippet: {len(found)} statements begin with {old!r} (expected exactly one)")
    return found[0]


def apply_snippet(source: str, snippet: str) -> str:
    """``source`` with the snippet's lines put in, as the module docstring says."""
    pending: list[str] = []
    for line in snippet.rstrip("\n").splitlines():
        if line.strip() == "...":
            continue
        code, sep, old = line.partition("# was:")
        if not sep:
            pending.append(line)
            continue
        first, end, indent = _target(source, old.strip())
        lines = source.splitlines()
        lines[first:end] = [(indent + new) if new.strip() else "" for new in [*pending, line]]
        source, pending = "\n".join(lines) + "\n", []
    if any(p.strip() for p in pending):
        source = source.rstrip("\n") + "\n\n" + "\n".join(pending) + "\n"
    return source


def convert(api: str, dest: Path) -> Path:
    """A copy of the ``api`` stand-in under ``dest``, converted by the README's snippets; returns its root."""
    snippets = readme_snippets()
    root = dest / api
    shutil.copytree(FIXTURES / api, root, ignore=shutil.ignore_patterns("__pycache__"))
    for name, snippet in SNIPPETS[api].items():
        path = root / PACKAGE / name
        path.write_text(apply_snippet(path.read_text(), snippets[snippet][1]))
    return root


def run_config(root: Path, **overrides: Any) -> dict[str, Any]:
    """The project's ``[tool.flwr.app.config]`` with the README's keys added, then ``overrides``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    added = tomllib.loads(readme_snippets()["run-config"][1])["tool"]["flwr"]["app"]["config"]
    return {**project, **added, **overrides}


def load(root: Path) -> tuple[ModuleType, ModuleType]:
    """The project's client and server modules, imported afresh from ``root``."""
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return (importlib.import_module(f"{PACKAGE}.client_app"), importlib.import_module(f"{PACKAGE}.server_app"))
    finally:
        sys.path.remove(str(root))


def run_in_process(api: str, root: Path, rc: dict[str, Any], num_nodes: int = 4,
                   modules: tuple[ModuleType, ModuleType] | None = None) -> dict[str, Any]:
    """Run the converted project's ServerApp against its ClientApp on an in-process grid.

    ``modules``: the project's (client, server) modules when already imported (:func:`load`),
    else they are imported afresh. Returns ``{"strategies": [...], "results": [...]}``: each
    strategy the server built (the ``LegacyStrategy`` on the legacy API) and, on the Message
    API, each ``Result`` of its ``start``.
    """
    from flwr.app import Context, RecordDict

    from flowerdro.experiments import InProcessGrid

    client, server = modules or load(root)
    grid = InProcessGrid(client.app, num_nodes, rc)
    grid.set_run(SimpleNamespace(run_id=grid.run_id))
    out: dict[str, Any] = {"strategies": [], "results": []}
    builder = "build_strategy" if api == "message-api" else "LegacyStrategy"
    original = getattr(server, builder)

    def spy(*args: Any, **kwargs: Any) -> Any:
        strategy = original(*args, **kwargs)
        out["strategies"].append(strategy)
        if api == "message-api":
            start = strategy.start

            def recorded(*a: Any, **kw: Any) -> Any:
                out["results"].append(start(*a, **kw))
                return out["results"][-1]

            strategy.start = recorded
        return strategy

    setattr(server, builder, spy)
    server.app(grid, Context(run_id=grid.run_id, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return out


def digest(api: str, out: dict[str, Any]) -> dict[str, Any]:
    """What a run must repeat: every round's client accuracies and the final model's checksum."""
    import numpy as np

    strategy = out["strategies"][-1]
    inner = strategy.strategy if api == "legacy-api" else strategy
    final = strategy.final_parameters if api == "legacy-api" else out["results"][-1].arrays
    if api == "legacy-api":
        from flwr.common import parameters_to_ndarrays

        values = parameters_to_ndarrays(final)
    else:
        values = [final[k].numpy() for k in final.keys()]
    flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in values])
    return {"client_acc": [r.get("client_acc") for r in inner.history], "model_sum": float(flat.sum()),
            "model_sq": float((flat ** 2).sum())}


def experiment(api: str, root: Path, modules: tuple[ModuleType, ModuleType], strategy: str, seed: int,
               rounds: int = 2) -> dict[str, Any]:
    """One seeded experiment on the loaded project: ``torch.manual_seed(seed)``, a new grid and strategy.

    Returns its :func:`digest`. One torch thread, so that a run's sums do not depend on the
    process's thread count.
    """
    import torch

    torch.set_num_threads(1)
    rc = run_config(root, strategy=strategy, **{"num-server-rounds": rounds})
    torch.manual_seed(seed)
    return digest(api, run_in_process(api, root, rc, modules=modules))


if __name__ == "__main__":
    import os
    import tempfile

    api_, strategy_, seed_, rounds_ = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # the Message-API ServerApp saves final_model.pt in the working folder
        project = convert(api_, Path(tmp))
        print(json.dumps(experiment(api_, project, load(project), strategy_, seed_, rounds_)))
