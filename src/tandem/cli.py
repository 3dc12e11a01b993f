"""The `tandem` command: `tandem COMMAND --help` for each.

tandem grpo [CONFIG.yaml] [key=value ...]   GRPO, colocated in one process
tandem eval --model PATH|embedded ...         answer/format accuracy of a model
tandem plot RUN_DIR [RUN_DIR ...]             PNG curves from metrics.jsonl
tandem doctor                                 what this machine and install can run
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("tandem")


def _config(args) -> object:
    from tandem.config import load_config

    return load_config(args.config, args.overrides)


def cmd_grpo(args) -> int:
    from tandem.trainer.grpo import train_grpo

    cfg = _config(args)
    final = train_grpo(cfg)
    print(f"final policy: {final}\nrun record:   {cfg.run_dir}\nplots:        tandem plot {cfg.run_dir}")
    return 0


def cmd_eval(args) -> int:
    from tandem.trainer.evaluate import evaluate, prompt_settings

    prompt = prompt_settings(args.model, args.config)
    for key in prompt:  # explicit flags win over the run's config
        if getattr(args, key, None) is not None:
            prompt[key] = getattr(args, key)
    result = evaluate(
        model=args.model,
        dataset=args.dataset,
        split=args.split,
        num_examples=args.num_examples,
        temperature=args.temperature,
        num_samples=args.num_samples,
        batch_size=args.batch_size,
        dtype=args.dtype,
        seed=args.seed,
        device=args.device,
        **prompt,
    )
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output}")
    return 0


def cmd_plot(args) -> int:
    from tandem.trainer.plots import plot_run, plot_runs

    for run_dir in args.run_dirs:
        for path in plot_run(Path(run_dir), smooth=args.smooth):
            print(path)
    if len(args.run_dirs) > 1:
        out = Path(args.out or Path(args.run_dirs[0]).parent / "compare")
        for path in plot_runs([Path(r) for r in args.run_dirs], out, smooth=args.smooth):
            print(path)
    return 0


def cmd_doctor(args) -> int:
    from tandem.doctor import report

    print(report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("grpo", help="GRPO in one process (generation and training colocated)")
    p.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
    p.add_argument(
        "overrides", nargs="*", help="dotted key=value overrides, e.g. training.learning_rate=1e-5"
    )
    p.set_defaults(func=cmd_grpo)

    p = sub.add_parser("eval", help="answer and format accuracy of a model on GSM8K-format data")
    p.add_argument(
        "--model", default="embedded", help="HF folder, checkpoint folder, .gguf, hub id or `embedded`"
    )
    p.add_argument("--dataset", default="synthetic", help="synthetic | gsm8k | path to .jsonl/.parquet")
    p.add_argument("--split", default="test", help="synthetic: any split other than train is held out")
    p.add_argument("--num-examples", type=int, default=200)
    p.add_argument(
        "--config",
        help="take the prompt settings (system prompt, shots, prefill, difficulty, max new tokens) from "
        "this config; default: the config.yaml of the run the model belongs to, if any",
    )
    p.add_argument("--difficulty", type=int, help="synthetic data: 1 one-step, 2 up to two steps")
    p.add_argument("--system-prompt")
    p.add_argument("--num-shots", type=int)
    p.add_argument("--prefill")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--num-samples", type=int, default=1, help="completions per question (sampled)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", help="write the summary and every completion as JSON here")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("plot", help="PNG curves (reward, accuracy, KL, length, loss, timing) of runs")
    p.add_argument("run_dirs", nargs="+")
    p.add_argument("--smooth", type=int, default=0, help="moving-average window")
    p.add_argument("--out", help="folder for the comparison figures when several runs are given")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("doctor", help="what this machine and install can run")
    p.set_defaults(func=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tandem.config import ConfigError
    from tandem.trainer.runtime import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError) as err:
        print(f"tandem {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
