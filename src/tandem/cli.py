"""The `tandem` command: `tandem COMMAND --help` for each.

tandem grpo [CONFIG.yaml] [key=value ...]   GRPO: sampler and trainer processes (pipeline.mode=colocated: one)
tandem train CONFIG [key=value ...]          the trainer alone (waits for samplers)
tandem sample CONFIG --trainer-host HOST     a sampler alone (feeds a trainer)
tandem sft [CONFIG.yaml] [key=value ...]    supervised fine-tuning
tandem rm [CONFIG.yaml] --task helpful      a reward model (helpful | harmless)
tandem dpo [CONFIG.yaml] [key=value ...]    DPO, or Safe-MM-DPO with dpo.safe_mm reward models
tandem ppo [CONFIG.yaml] [key=value ...]    PPO with a value head, on the GRPO sampler/trainer split
tandem launch CONFIG --sampling-devices 0 --training-devices 1   trainer and samplers on devices
tandem check-comm [serve|connect] ...        test both channels: latency, bandwidth, diagnosis
tandem keygen DIR [NAME ...]                 CURVE key pairs for authenticated multi-host runs
tandem eval --model PATH|embedded ...         answer/format accuracy of a model
tandem plot RUN_DIR [RUN_DIR ...]             PNG curves from metrics.jsonl
tandem config show CONFIG [key=value ...]     the fully resolved config, nothing loaded
tandem doctor                                 what this machine and install can run
tandem --version

Overrides (key=value) and options may come in any order after the command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import get_args

from tandem import __version__
from tandem.config import Method, PreferenceTask

log = logging.getLogger("tandem")


# `key=value` (dotted keys, list indices, non-ASCII names such as the seeds' λ_init)
OVERRIDE = re.compile(r"^[^\W\d][\w.\-]*=", re.UNICODE)
LAUNCHED_ENV = "TANDEM_LAUNCHED"  # set by `tandem launch` / `tandem grpo` in the processes it starts


def _config(args, *extra: str, method: str | None = None):
    from tandem.config import load_config

    return load_config(args.config, [*args.overrides, *extra], method=method)


def _require_method(cfg, command: str, allowed: tuple[str, ...]) -> None:
    if cfg.method not in allowed:
        from tandem.config import ConfigError

        raise ConfigError(
            f"`method` is {cfg.method!r}: `tandem {command}` runs {' and '.join(allowed)} configs; "
            f"run this config with `tandem {cfg.method}`"
        )


def _finished(cfg) -> None:
    """The run summary, printed once: by the command the user typed (not again by the trainer
    process a launcher started, nor by every rank of a torchrun job)."""
    if os.environ.get(LAUNCHED_ENV) or os.environ.get("RANK", "0") != "0":
        return
    final = cfg.run_dir / "final"
    what = "reward model" if cfg.method == "rm" else "policy"
    print(f"final {what}: {final}\nrun record:   {cfg.run_dir}\nplots:        tandem plot {cfg.run_dir}")


def _preflight(cfg, command: str) -> None:
    """Everything the config names on this machine, checked before any model loads (preflight.py).
    The hub is asked once per run: by the command the user typed, not again by each child or rank."""
    from tandem.preflight import check_run

    first = not os.environ.get(LAUNCHED_ENV) and os.environ.get("RANK", "0") == "0"
    check_run(cfg, command, probe=first)


def _prepare_run_dir(cfg) -> None:
    """Settle the run folder before any child starts (resume, refuse, or move an unfinished
    record aside): the samplers' logs go into it, and a refusal must come before anything loads."""
    from tandem.trainer.checkpoint import RunFolderTaken, prepare_run_dir

    try:
        prepare_run_dir(cfg.run_dir, cfg.training.resume_from_checkpoint)
    except RunFolderTaken as err:
        from tandem.config import ConfigError

        raise ConfigError(str(err)) from None


def _train_loop(method: str):
    """Each method's training function, imported when it runs (transformers is slow to import)."""
    if method == "grpo":
        from tandem.trainer.grpo import train_grpo

        return train_grpo
    if method == "ppo":
        from tandem.trainer.ppo import train_ppo

        return train_ppo
    if method == "sft":
        from tandem.trainer.sft import train_sft

        return train_sft
    if method == "rm":
        from tandem.trainer.rm import train_rm

        return train_rm
    if method == "dpo":
        from tandem.trainer.dpo import train_dpo

        return train_dpo
    raise ValueError(f"no training loop for method {method!r}")


def cmd_grpo(args) -> int:
    """grpo | ppo: colocated in this process, or trainer and sampler processes."""
    from tandem.launch import default_devices, launch

    cfg = _config(args, method=args.command)
    _preflight(cfg, args.command)
    if cfg.pipeline.mode == "colocated":
        _train_loop(cfg.method)(cfg)
        rc = 0
    else:
        sampling, training = default_devices(cfg)
        _prepare_run_dir(cfg)
        rc = launch(args.config, args.overrides, cfg, sampling, training, restarts=_restarts(args))
    if rc == 0:
        _finished(cfg)
    return rc


def cmd_train(args) -> int:
    extra = ["pipeline.mode=decoupled", *_port_overrides(args)]
    if args.no_deepspeed:
        extra.append("training.distributed_strategy=none")
    device = args.device or (f"cuda:{args.gpu_id}" if args.gpu_id is not None else None)
    if device is not None:
        extra.append(f"training.device={device}")
    cfg = _config(args, *extra)
    _require_method(cfg, "train", ("grpo", "ppo"))
    _preflight(cfg, "train")
    _train_loop(cfg.method)(cfg)
    _finished(cfg)
    return 0


def _port_overrides(args) -> list[str]:
    """--trainer-host / --data-port / --sync-port as pipeline.* overrides (flags win over the file)."""
    return [
        f"pipeline.{key}={value}"
        for key, value in (
            ("trainer_host", getattr(args, "trainer_host", None)),
            ("data_port", args.data_port),
            ("sync_port", args.sync_port),
        )
        if value is not None
    ]


def cmd_method(args) -> int:
    """sft | rm | dpo: one process, or every rank under torchrun / the deepspeed launcher."""
    extra = [f"rm.task={args.task}"] if getattr(args, "task", None) else []
    cfg = _config(args, *extra, method=args.command)
    _preflight(cfg, args.command)
    _train_loop(args.command)(cfg)
    _finished(cfg)
    return 0


def cmd_sample(args) -> int:
    from tandem.rewards.calling import RewardError
    from tandem.sampler.worker import TrainerGone, run_sampler

    cfg = _config(args, *_port_overrides(args))
    _require_method(cfg, "sample", ("grpo", "ppo"))
    _preflight(cfg, "sample")
    device = args.device or (f"cuda:{args.gpu_id}" if args.gpu_id is not None else "auto")
    if device != "auto":
        from tandem.preflight import check_device

        check_device(device, "--device")
    try:
        run_sampler(cfg, sampler_id=args.sampler_id, device=device)
    except TrainerGone as err:
        print(f"tandem sample: {err}", file=sys.stderr)
        return 3
    except RewardError as err:  # a bug in a reward function: the launcher does not restart this code
        print(f"tandem sample: error: {err}", file=sys.stderr)
        return RewardError.exit_code
    return 0


def _restarts(args) -> dict[str, int]:
    for flag in ("max_restarts", "max_sampler_restarts"):
        if getattr(args, flag) < 0:
            from tandem.config import ConfigError

            raise ConfigError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give a count >= 0")
    return {"max_restarts": args.max_restarts, "sampler_restarts": args.max_sampler_restarts}


def cmd_launch(args) -> int:
    from tandem.launch import (
        Nodes,
        choose_devices,
        describe,
        dry_run_config,
        launch_children,
        missing_gpus,
        plan,
    )

    cfg = _config(args)
    sampling, training = choose_devices(
        cfg, args.sampling_devices, args.training_devices, dry_run=args.dry_run
    )
    # a node without samplers checks only the trainer's side (no prompts, no reward functions);
    # a dry run checks all but the device, so that it shows a GPU plan on any machine
    command = "launch" if sampling or cfg.method in ("sft", "rm", "dpo") else "train"
    problem = None
    if args.dry_run:  # the plan is shown whatever this machine lacks; what would stop a run is said
        try:
            _preflight(dry_run_config(cfg), command)
        except USER_ERRORS as err:
            problem = str(err)
    else:
        _preflight(cfg, command)
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.launcher)
    children = plan(args.config, args.overrides, cfg, sampling, training, nodes)
    missing = missing_gpus(sampling + training)
    if args.dry_run:
        print(describe(children, cfg.run_dir, missing))
        if problem:
            print(f"\non this machine the run would stop before starting: {problem}")
        return 0
    if missing is not None:
        from tandem.config import ConfigError

        raise ConfigError(f"{missing}; --dry-run prints the plan without starting it")
    if nodes.node_rank == 0:  # the other nodes share node 0's output_dir, or keep none
        _prepare_run_dir(cfg)
    rc = launch_children(children, **_restarts(args))
    if rc == 0:
        _finished(cfg)
    return rc


def cmd_keygen(args) -> int:
    from tandem.transport.auth import keygen

    for path in keygen(args.directory, args.names):
        print(path)
    print(
        "give each sampler its NAME.key_secret (client_secret_key) and the trainer's public key "
        "(server_public_key); the trainer gets trainer.key_secret and the authorized/ folder"
    )
    return 0


def cmd_check_comm(args) -> int:
    from tandem.transport.check import run_check

    return run_check(args)


def cmd_eval(args) -> int:
    from tandem.evaluate import evaluate

    # settings left unset come from the model's run (its config.yaml, or --config), else the
    # defaults; evaluate() logs where each came from and records it in the summary
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
        config=args.config,
        difficulty=args.difficulty,
        system_prompt=args.system_prompt,
        num_shots=args.num_shots,
        prefill=args.prefill,
        max_new_tokens=args.max_new_tokens,
    )
    summary = {k: v for k, v in result.items() if k != "rows"}
    print(json.dumps(summary, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output}")
    return 0


def cmd_plot(args) -> int:
    from tandem.plots import plot_run, plot_runs

    for run_dir in args.run_dirs:
        for path in plot_run(Path(run_dir), smooth=args.smooth):
            print(path)
    if len(args.run_dirs) > 1:
        out = Path(args.out or Path(args.run_dirs[0]).parent / "compare")
        try:
            for path in plot_runs([Path(r) for r in args.run_dirs], out, smooth=args.smooth):
                print(path)
        except ValueError as err:  # each run's own figures are written; only the comparison is not
            print(f"tandem plot: no comparison figures: {err}", file=sys.stderr)
    return 0


def cmd_config_show(args) -> int:
    """The fully resolved config as YAML (every default written out, seed keys translated); the
    notes on how seed keys were read go to stderr. Nothing is loaded."""
    import yaml

    from tandem.config import config_to_dict

    cfg = _config(args, method=args.method)
    print(
        f"# {args.config or 'built-in defaults'}"
        + (f" with {' '.join(args.overrides)}" if args.overrides else "")
    )
    print(f"# run folder: {cfg.run_dir}")
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True), end="")
    return 0


def cmd_doctor(args) -> int:
    from tandem.doctor import report

    print(report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    # the deepspeed launcher passes --local_rank=N before the command (LOCAL_RANK is read from the env)
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p):
        p.add_argument("config", nargs="?", help="YAML config (default: built-in defaults)")
        p.add_argument(
            "overrides", nargs="*", help="dotted key=value overrides, e.g. training.learning_rate=1e-5"
        )

    def restart_args(p):
        from tandem.launch import SAMPLER_RESTARTS

        p.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            help="start a trainer that dies again from its latest checkpoint, up to N times (default 0)",
        )
        p.add_argument(
            "--max-sampler-restarts",
            type=int,
            default=SAMPLER_RESTARTS,
            help=f"start a sampler that dies again, up to N times each, with back-off (default {SAMPLER_RESTARTS})",
        )

    p = sub.add_parser("grpo", help="GRPO: sampler and trainer processes on this machine")
    config_args(p)
    restart_args(p)
    p.set_defaults(func=cmd_grpo)

    p = sub.add_parser(
        "train", help="the GRPO (or PPO) trainer alone: binds the ports and waits for samplers"
    )
    config_args(p)
    p.add_argument(
        "--no-deepspeed",
        action="store_true",
        help="plain PyTorch on one device (training.distributed_strategy=none)",
    )
    p.add_argument("--device", help="training.device: cpu | cuda | cuda:N")
    p.add_argument("--gpu-id", type=int, help="shorthand for --device cuda:N (the seeds' flag)")
    p.add_argument("--data-port", type=int, help="port the groups arrive on (pipeline.data_port, 5555)")
    p.add_argument("--sync-port", type=int, help="port weights are served on (pipeline.sync_port, 5556)")
    p.set_defaults(func=cmd_train)

    for name, text in (
        ("sft", "supervised fine-tuning (prompt/completion or chat messages)"),
        ("rm", "a Bradley-Terry reward model: a scalar head on a causal LM"),
        ("dpo", "DPO against a frozen reference; Safe-MM-DPO with dpo.safe_mm reward models"),
    ):
        p = sub.add_parser(name, help=text, description=f"{text}. Several ranks: torchrun or tandem launch.")
        config_args(p)
        if name == "rm":
            p.add_argument("--task", choices=get_args(PreferenceTask), help="rm.task (which preference set)")
        p.set_defaults(func=cmd_method)

    p = sub.add_parser(
        "ppo", help="PPO with a value head: sampler and trainer processes (pipeline.mode=colocated: one)"
    )
    config_args(p)
    restart_args(p)
    p.set_defaults(func=cmd_grpo)

    p = sub.add_parser("sample", help="a GRPO sampler alone: generates groups for a trainer")
    config_args(p)
    p.add_argument("--trainer-host", help="host of the trainer (pipeline.trainer_host)")
    p.add_argument("--data-port", type=int, help="the trainer's group port (pipeline.data_port, 5555)")
    p.add_argument("--sync-port", type=int, help="the trainer's weight port (pipeline.sync_port, 5556)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--gpu-id", type=int, help="shorthand for --device cuda:N")
    p.add_argument("--sampler-id", help="name in the trainer's metrics (default: host-pid)")
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("launch", help="start the trainer and samplers of one run on given devices")
    config_args(p)
    restart_args(p)
    p.add_argument(
        "--sampling-devices",
        help="one sampler per entry: cpu or GPU ids, e.g. 0 or 0,1 (indices count within an inherited "
        "CUDA_VISIBLE_DEVICES; GPU-/MIG- UUIDs too); none: no sampler on this node (default: as "
        "`tandem grpo` places them, by training.device and the GPUs present)",
    )
    p.add_argument(
        "--training-devices",
        help="one trainer rank per entry: cpu, cpu,cpu or GPU ids, e.g. 1 or 1,2,3 (several: "
        "torchrun/DeepSpeed; default: as `tandem grpo` places it)",
    )
    p.add_argument(
        "--launcher",
        default="torchrun",
        choices=["torchrun", "deepspeed"],
        help="starts the ranks (deepspeed: on one node, by GPU index)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the training job")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (0 runs the samplers)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, for the rendezvous")
    p.add_argument("--master-port", type=int, default=29500, help="rendezvous port on node 0")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print each process's command line and environment, start nothing (works without GPUs)",
    )
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("check-comm", help="check both channels between hosts: latency, bandwidth, diagnosis")
    p.add_argument(
        "role",
        nargs="?",
        default="local",
        choices=["local", "serve", "connect"],
        help="serve: stand in for the trainer on this host; connect: test a serving host (or a live "
        "trainer: reachability, latency and a weight fetch only); local: both here (default)",
    )
    p.add_argument("--trainer-host", help="default: pipeline.trainer_host (127.0.0.1)")
    p.add_argument("--bind-host", help="serve: the interface to bind (default: pipeline.bind_host, *)")
    p.add_argument("--data-port", type=int, help="default: pipeline.data_port (5555)")
    p.add_argument("--sync-port", type=int, help="default: pipeline.sync_port (5556)")
    p.add_argument("--megabytes", type=int, default=256, help="size of the test weights")
    p.add_argument("--seconds", type=float, default=0, help="serve: stop after this long (0 = Ctrl-C)")
    p.add_argument("--config", help="take ports and CURVE keys from this config's pipeline section")
    p.set_defaults(func=cmd_check_comm)

    p = sub.add_parser("keygen", help="CURVE key pairs (trainer + samplers) for pipeline.curve")
    p.add_argument("directory")
    p.add_argument("names", nargs="*", default=["trainer", "sampler"], help="default: trainer sampler")
    p.set_defaults(func=cmd_keygen)

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

    p = sub.add_parser("config", help="show the fully resolved config (nothing is loaded)")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="print CONFIG with overrides applied, every default written out, seed keys translated"
    )
    config_args(show)
    show.add_argument("--method", choices=get_args(Method), help="check it is for this method")
    show.set_defaults(func=cmd_config_show)

    p = sub.add_parser("doctor", help="what this machine and install can run")
    p.set_defaults(func=cmd_doctor)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line whose overrides and options come in any order: `tandem sample CONFIG
    --trainer-host HOST key=value` and `tandem grpo key=value CONFIG --flag` both work. Every
    positional is either the config file (at most one) or a key=value override."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    stray = [x for x in extras if x.startswith("-") or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)} (see `tandem {args.command} --help`)")
    if hasattr(args, "overrides"):
        items = ([args.config] if args.config is not None else []) + list(args.overrides) + extras
        files = [x for x in items if not OVERRIDE.match(x)]
        if len(files) > 1:
            parser.error(
                f"`tandem {args.command}` takes one config file, got {' '.join(files)}; overrides are "
                "written key=value (e.g. training.learning_rate=1e-5)"
            )
        args.config = files[0] if files else None
        args.overrides = [x for x in items if OVERRIDE.match(x)]
    return args


# errors that are the user's to fix: one line, no traceback (TANDEM_DEBUG=1 shows it)
USER_ERRORS = (ValueError, ImportError, OSError)


def main(argv: list[str] | None = None) -> int:
    from tandem.runlog import setup_logging

    args = parse_args(argv)
    setup_logging()
    try:
        rc = args.func(args)
    except USER_ERRORS as err:
        if os.environ.get("TANDEM_DEBUG"):
            raise
        print(f"tandem {args.command}: error: {_one_line(err)}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        rc = 130
    if argv is None and "LOCAL_RANK" in os.environ:
        # a rank of a torchrun / deepspeed job: everything is written and the process group is
        # gone; skip interpreter teardown, where a C++ thread of the distributed stack sometimes
        # aborts the process ("terminate called without an active exception", ~1 run in 10)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    return rc


def _one_line(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return text if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
