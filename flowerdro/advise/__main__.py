"""``python -m flowerdro.advise conf/<name>.toml [--budget …] [--seeds …] [--trials …]``.

Runs (or resumes) the search of the file and writes ``<out>/<name>/{advice.md, advice.png,
advice.json, study.db}``; prints the verdict sentence.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(prog="python -m flowerdro.advise", description=__doc__)
    parser.add_argument("config", help="advisor (or experiment) TOML file, e.g. conf/advise_main_job.toml")
    parser.add_argument("--budget", help='"30 min", "2 h", "90 s" or "20000 client-rounds" (overrides [advise])')
    parser.add_argument("--seeds", help="search seeds, e.g. 0,1 (overrides [advise] seeds)")
    parser.add_argument("--verdict-seeds", help="fresh seeds of the test verdict, e.g. 10,11,12,13,14")
    parser.add_argument("--trials", type=int, help="trials in all (overrides [advise] trials)")
    parser.add_argument("--rounds", type=int, help="override num-rounds")
    parser.add_argument("--out", default="results", help="output root (default: results)")
    parser.add_argument("--figure", help="also draw the report's figure at this path")
    parser.add_argument("--overwrite", action="store_true", help="start afresh instead of resuming a stored search")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (Flower's round logs instead)")
    args = parser.parse_args(argv)

    from flowerdro.advise.search import load_config, run

    cfg = load_config(args.config)
    table = dict(cfg.get("advise", {}))
    if args.budget:
        table["budget"] = args.budget
    if args.seeds:
        table["seeds"] = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.verdict_seeds:
        table["verdict-seeds"] = [int(s) for s in args.verdict_seeds.split(",") if s.strip()]
    if args.trials:
        table["trials"] = args.trials
    cfg["advise"] = table
    if args.rounds:
        cfg["num-rounds"] = args.rounds
    advice = run(cfg, output_root=args.out, progress=False if args.no_progress else None, overwrite=args.overwrite,
                 figure=args.figure)
    print(advice.sentence)
    if advice.output_dir is not None:
        print(f"report: {advice.output_dir}/advice.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
