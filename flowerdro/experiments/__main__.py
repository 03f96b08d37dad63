"""``python -m flowerdro.experiments conf/<name>.toml [--seeds 0,1,2] [--rounds N] [--strategies a,b] [--out results] [--tracker tensorboard,mlflow,wandb]``.

``--strategies`` runs only the listed labels of the config (other labels' result
directories are left as they are; summary.json, table.md and comparison.png then cover
the listed labels only).
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m flowerdro.experiments", description=__doc__)
    parser.add_argument("config", help="experiment TOML file, e.g. conf/fmnist_one_class.toml")
    parser.add_argument("--seeds", help="override the seeds, e.g. 0,1,2")
    parser.add_argument("--rounds", type=int, help="override num-rounds")
    parser.add_argument("--strategies", help="run only these strategy labels of the config, e.g. drfa,afl")
    parser.add_argument("--out", default="results", help="output root (default: results); the trackers write "
                                                         "into <out>/trackers unless the file sets tracker-dir")
    parser.add_argument("--quiet", action="store_true", help="only print the final table")
    parser.add_argument("--resume", action="store_true",
                        help="continue the runs from their latest checkpoints (finished runs are kept)")
    parser.add_argument("--overwrite", action="store_true", help="replace results of another run with this name")
    parser.add_argument("--extend", action="store_true",
                        help="with --resume: let --rounds go beyond the rounds the runs were planned for")
    parser.add_argument("--tracker", help="log every run to these trackers (overrides the file's tracker), "
                                          "e.g. tensorboard,mlflow,wandb")
    args = parser.parse_args(argv)

    from flowerdro.experiments.runner import load_config, run

    cfg = load_config(args.config)
    if args.seeds:
        cfg["seeds"] = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.rounds:
        cfg["num-rounds"] = args.rounds
    if args.strategies:
        wanted = [x.strip() for x in args.strategies.split(",") if x.strip()]
        unknown = sorted(set(wanted) - {str(x) for x in cfg["strategies"]} - set(cfg.get("strategy", {})))
        if unknown:
            parser.error(f"--strategies: {', '.join(unknown)} not in the config's strategies "
                         f"({', '.join(map(str, cfg['strategies']))})")
        cfg["strategies"] = wanted
    if args.resume:
        cfg["resume"] = True
    if args.overwrite:
        cfg["overwrite"] = True
    if args.extend:
        cfg["extend"] = True
    if args.tracker is not None:
        cfg["tracker"] = args.tracker
    if args.quiet:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    result = run(cfg, output_root=args.out)
    from flowerdro.runs.settings import WATCH_KEYS, RunSettings
    from flowerdro.settings import read_settings
    from flowerdro.trackers.setup import where

    watch = read_settings(RunSettings, {k: cfg[k] for k in WATCH_KEYS if k in cfg})
    root = cfg.get("output-root", args.out)
    for line in where(watch, result.output_dir, tracker_output_dir=root or None):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
