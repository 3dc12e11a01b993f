"""`tandem launch`: start the trainer and the samplers of one run as child processes.

    tandem launch CONFIG [key=value ...] --sampling-devices 0 --training-devices 1
    tandem launch CONFIG --sampling-devices cpu,cpu --training-devices cpu
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3            # 3 trainer ranks
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3 --launcher deepspeed
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2 --dry-run   # print the plan only
    # two nodes: on the first (samplers there), then on the second (none there)
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3 --nnodes 2 --node-rank 0 --master-addr HOST0
    tandem launch CONFIG --sampling-devices none --training-devices 0,1,2,3 --nnodes 2 --node-rank 1 --master-addr HOST0

Each sampling device gets one sampler (`s0`, `s1`, ... in order); a GPU is exposed to its child as
CUDA_VISIBLE_DEVICES. GPU indices count within an inherited CUDA_VISIBLE_DEVICES (SLURM,
containers): with CUDA_VISIBLE_DEVICES=4,5,6, device 1 is GPU 5; without one they are the
machine's. GPU-/MIG- UUIDs pass through as they are. Several training devices (or several nodes)
make the trainer a torchrun (or, on one node, `deepspeed` launcher) job with one rank per device;
its rank 0, on node 0, is where the samplers send their groups (`pipeline.trainer_host`). Under
torchrun the ranks share the trainer's CUDA_VISIBLE_DEVICES; the deepspeed launcher drops any it
inherits and sets its own from `--include localhost:<GPUs>`. A config whose
`training.distributed_strategy` is none gets `auto` (DDP below 1B parameters, ZeRO otherwise). On
the CPU the cores are split between the processes unless `sampling.num_threads` /
`training.num_threads` say otherwise. `plan` builds the children (commands and environments)
without starting anything; `describe` is what `--dry-run` prints. The trainer keeps this terminal;
the samplers write to `<run_dir>/logs/sampler-<id>.log`. Ctrl-C (SIGINT) and SIGTERM are
forwarded to every child. A sampler that dies is started again with the same id (it continues its
prompt stream and takes the newest weights), after a back-off of 1, 2, 4, ... s (at most 60), up to
`--max-sampler-restarts` times (5), except one stopped by an error in a reward function (exit code 4:
a restart would meet it again); with `--max-restarts N` a trainer that dies is started again
from its latest checkpoint (`training.resume_from_checkpoint=latest`) up to N times while the
samplers keep running, so a kill -9 costs at most the steps since the last save. Each restart is
logged. When a child fails beyond that, the others are stopped and the launcher says which one
failed and shows the end of its log. Children die with the launcher, however it dies
(even by SIGKILL): on Linux each gets SIGTERM when the launcher is gone (prctl PR_SET_PDEATHSIG),
which torchrun passes on to its ranks; the deepspeed launcher does not, so its process group is
kept by `keep_group`, which takes all of it down.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config import Config, ConfigError
from tandem.rewards.calling import RewardError

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # after the trainer finished, or after Ctrl-C, before children are killed
SAMPLER_RESTARTS = 5  # --max-sampler-restarts: each sampler's
MAX_BACKOFF_S = 60.0
KEEP_GRACE_S = 10  # keep_group: after SIGTERM, before what is left of the group is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
CVD = "CUDA_VISIBLE_DEVICES"
GPU_UUID_PREFIXES = ("GPU-", "MIG-")  # what nvidia-smi -L names; CUDA takes them in CVD as they are


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set over the launcher's environment
    unset: list[str] = field(default_factory=list)  # removed from the launcher's environment
    log_path: Path | None = None  # None: share the launcher's terminal
    gpus: str | None = None  # the CVD the process (each of its ranks) runs with; None: the CPU
    where: str = ""  # where it runs, in words (the dry run's heading)
    note: str = ""  # said when it starts (vLLM's pinned cores on the CPU)
    proc: subprocess.Popen | None = None
    restarts: int = 0  # how many times the launcher has started it again
    restart_at: float | None = None  # monotonic time of the next start after a death (back-off)


@dataclass
class Nodes:
    """Where this node's trainer ranks sit in a multi-node job (torchrun's rendezvous flags)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "torchrun"  # torchrun | deepspeed


def parse_devices(spec: str, option: str) -> list[str]:
    """`cpu`, `cpu,cpu`, GPU indices `0,1` or GPU-/MIG- UUIDs: one entry per process (sampling)
    or rank (training); `none` (sampling only): no sampler on this node."""
    if spec.strip() == "none" and option == "--sampling-devices":
        return []
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    for d in devices:
        if d != "cpu" and not d.isdigit() and not d.startswith(GPU_UUID_PREFIXES):
            raise ConfigError(
                f"{option} {spec!r}: each device is `cpu`, a GPU index (e.g. 0,1) or a GPU-/MIG- UUID"
            )
    if not devices:
        raise ConfigError(f"{option} is empty: give `cpu` or GPU indices such as 0,1")
    return devices


def physical_gpus(devices: list[str], option: str, inherited: str | None) -> list[str]:
    """The GPUs behind `devices` as the children's CUDA_VISIBLE_DEVICES must name them: an index
    counts within the CUDA_VISIBLE_DEVICES this process inherited (`inherited`; None: the
    machine's own numbering), so that 1 under CUDA_VISIBLE_DEVICES=4,5,6 is 5. UUIDs and cpu stay."""
    if inherited is None:
        return list(devices)
    visible = [v.strip() for v in inherited.split(",") if v.strip()]
    physical = []
    for d in devices:
        if d.isdigit() and int(d) >= len(visible):
            seen = f"{len(visible)} GPU(s), indices 0..{len(visible) - 1}" if visible else "no GPU"
            raise ConfigError(
                f"{option}: GPU {d} is not in the inherited {CVD}={inherited} ({seen}); indices "
                f"count within that list, so give one below {len(visible)}, a GPU- UUID, or unset {CVD}"
            )
        physical.append(visible[int(d)] if d.isdigit() else d)
    return physical


def choose_devices(
    cfg: Config, sampling_spec: str | None, training_spec: str | None, *, dry_run: bool = False
) -> tuple[list[str], list[str]]:
    """`tandem launch`'s devices: the flags, or where unset as `tandem grpo` places them (by
    training.device and the GPUs here: a config that says cuda is never quietly run on the CPU)."""
    if sampling_spec is None or training_spec is None:
        try:
            default_sampling, default_training = default_devices(cfg)
        except ConfigError as err:
            if not dry_run:
                raise
            raise ConfigError(
                f"{err}; or give --sampling-devices and --training-devices: --dry-run shows a GPU plan "
                "on any machine"
            ) from None
    sampling = (
        parse_devices(sampling_spec, "--sampling-devices") if sampling_spec is not None else default_sampling
    )
    training = (
        parse_devices(training_spec, "--training-devices") if training_spec is not None else default_training
    )
    if cfg.training.device.startswith("cuda") and "cpu" in training:
        raise ConfigError(
            f"`training.device` is {cfg.training.device} but --training-devices puts the trainer on the "
            "CPU; give GPU ids (e.g. --training-devices 1), or set training.device=cpu"
        )
    return sampling, training


def default_devices(cfg: Config) -> tuple[list[str], list[str]]:
    """`tandem grpo`'s placement: CPU for a CPU config; with GPUs, sampler(s) on the first
    and the trainer on the next (or sharing the only one)."""
    n = cfg.pipeline.num_samplers
    if cfg.training.device == "cpu":
        return ["cpu"] * n, ["cpu"]
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0 and cfg.training.device.startswith("cuda"):  # never train on the CPU unasked
        raise ConfigError(
            f"`training.device` is {cfg.training.device} but torch sees no CUDA device (torch "
            f"{torch.__version__}); set training.device=cpu, or install a CUDA build of torch"
        )
    if gpus == 0:
        return ["cpu"] * n, ["cpu"]
    if gpus == 1:
        return ["0"] * n, ["0"]
    return [str(i % (gpus - 1)) for i in range(n)], [str(gpus - 1)]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def plan(
    config_path: str | None,
    overrides: list[str],
    cfg: Config,
    sampling_devices: list[str],
    training_devices: list[str],
    nodes: Nodes | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> list[Child]:
    """This node's children, nothing started and nothing written: each one's command, what it
    changes in `environ` (the launcher's environment, os.environ by default) and its log. The
    devices are the user's: GPU indices count within environ's CUDA_VISIBLE_DEVICES."""
    nodes = nodes or Nodes()
    environ = os.environ if environ is None else environ
    if len(set(training_devices)) != len(training_devices) and "cpu" not in training_devices:
        raise ConfigError(f"--training-devices {','.join(training_devices)}: a GPU may hold one trainer rank")
    if "cpu" in training_devices and len(set(training_devices)) > 1:
        raise ConfigError("--training-devices: all ranks on the CPU (cpu,cpu) or all on GPUs (0,1), not both")
    if nodes.launcher == "deepspeed" and nodes.nnodes > 1:
        # its runner starts other nodes' ranks from a hostfile, over ssh; without one it refuses
        raise ConfigError(
            f"--launcher deepspeed with --nnodes {nodes.nnodes}: the deepspeed launcher needs a hostfile "
            "and ssh for several nodes; use --launcher torchrun (the default), under which "
            "training.distributed_strategy=deepspeed runs as well"
        )
    # sft, rm and dpo learn from a fixed data set: trainer ranks only; grpo and ppo trainers take
    # groups from samplers (`tandem train` runs the loop of the config's method)
    supervised = cfg.method in ("sft", "rm", "dpo")
    command = cfg.method if supervised else "train"
    if supervised:
        sampling_devices = []
    elif not sampling_devices and nodes.node_rank == 0:
        raise ConfigError("--sampling-devices none: node 0 must run the samplers (give e.g. cpu or 0)")
    sampling_gpus = physical_gpus(sampling_devices, "--sampling-devices", environ.get(CVD))
    training_gpus = physical_gpus(training_devices, "--training-devices", environ.get(CVD))
    base = [sys.executable, "-m", "tandem.cli"]
    head = [config_path] if config_path else []
    # the method travels with the overrides: `tandem train` and `tandem sample` default to grpo
    shared = [*overrides, f"method={cfg.method}"]
    if sampling_devices:
        shared.append(f"pipeline.num_samplers={len(sampling_devices)}")
    if cfg.pipeline.trainer_host in ("127.0.0.1", "localhost") and cfg.pipeline.bind_host == "*":
        shared.append("pipeline.bind_host=127.0.0.1")  # a local run listens on loopback only
    on_cpu = [d == "cpu" for d in sampling_devices + training_devices]
    threads = max(1, cpu_count() // len(on_cpu)) if all(on_cpu) else 0
    trainer_extra, sampler_extra = [], []
    if threads and not cfg.training.num_threads:
        trainer_extra.append(f"training.num_threads={threads}")
    if threads and not cfg.sampling.num_threads:
        sampler_extra.append(f"sampling.num_threads={threads}")

    children = [_trainer(command, [*head, *shared, *trainer_extra], cfg, training_gpus, nodes)]
    for i, dev in enumerate(sampling_gpus):
        sid = f"s{i}"
        cmd = base + ["sample", *head, *shared, *sampler_extra, "--sampler-id", sid]
        child = Child(f"sampler {sid}", cmd, log_path=cfg.run_dir / "logs" / f"sampler-{sid}.log")
        if dev == "cpu":
            child.cmd += ["--device", "cpu"]
            child.where = "1 process on the CPU"
            if cfg.sampling.backend == "vllm":  # vLLM pins its threads: say where, beside the trainer's
                threads = cfg.sampling.num_threads or threads
                from tandem.sampler.vllm_engine import cpu_cores  # imports torch: only here

                bind = cpu_cores(cfg.sampling.vllm.cpu_threads_bind, threads)
                child.note = f"vLLM's threads bound to cores {bind} (sampling.vllm.cpu_threads_bind)"
                child.where += f", {child.note}"
        else:
            child.env[CVD] = child.gpus = dev
            child.cmd += ["--device", "cuda:0"]
            child.where = f"1 process, sees {CVD}={dev} (its cuda:0)"
        children.append(child)
    for child in children:
        child.env["TANDEM_LAUNCHED"] = "1"  # the launcher prints the run summary, not each child
    return children


def _trainer(command: str, args: list[str], cfg: Config, gpus: list[str], nodes: Nodes) -> Child:
    """The trainer child: one process, or this node's ranks under torchrun / the deepspeed
    launcher; `gpus` are physical (the children's CUDA_VISIBLE_DEVICES) or all `cpu`."""
    ranks, on_cpu = len(gpus), gpus[0] == "cpu"
    if ranks == 1 and nodes.nnodes == 1:
        trainer = Child("trainer", [sys.executable, "-m", "tandem.cli", command, *args])
        jobs = "1 process"
    else:
        if cfg.training.distributed_strategy == "none":
            args = [*args, "training.distributed_strategy=auto"]
        job = distributed_launch(nodes, ranks, None if on_cpu else gpus)
        trainer = Child("trainer", [*job, command, *args])
        node = f" (node {nodes.node_rank} of {nodes.nnodes})" if nodes.nnodes > 1 else ""
        jobs = f"{ranks} rank{'s' if ranks > 1 else ''}{node} under {nodes.launcher}"
    if on_cpu:
        trainer.cmd.append("training.device=cpu")
        trainer.env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed (and its launcher) on the CPU
        trainer.where = f"{jobs} on the CPU"
        return trainer
    trainer.cmd.append("training.device=cuda")
    if trainer.cmd[1:3] == ["-m", "deepspeed.launcher.runner"]:
        # it drops an inherited CUDA_VISIBLE_DEVICES (saying it ignores it) and gives each rank
        # the slots of --include, sorted: remove it here, so that nothing contradicts --include
        trainer.unset.append(CVD)
        trainer.gpus = ",".join(sorted(gpus, key=int))
        trainer.where = f"{jobs}, which gives each {CVD}={trainer.gpus} (--include); rank r takes cuda:r"
    else:
        trainer.env[CVD] = trainer.gpus = ",".join(gpus)
        sees = (
            f"each rank sees {CVD}={trainer.gpus}; rank r takes cuda:r"
            if ranks > 1
            else f"sees {CVD}={trainer.gpus}"
        )
        trainer.where = f"{jobs}, {sees}"
    return trainer


def distributed_launch(nodes: Nodes, ranks: int, gpus: list[str] | None = None) -> list[str]:
    """The torchrun (or deepspeed launcher) command that starts this node's `ranks` trainer ranks;
    `gpus`: the physical GPUs of a deepspeed job (None: its ranks run on the CPU)."""
    if nodes.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
        if gpus is None:  # CPU ranks: a count (DS_ACCELERATOR=cpu has one slot per NUMA node)
            cmd.append(f"--num_gpus={ranks}")
        else:
            # not --num_gpus N, which takes GPUs 0..N-1: given any resource flag the runner ignores
            # and drops CUDA_VISIBLE_DEVICES, then sets each rank's to the slots it chose; so the
            # slots of --include are the physical GPUs, and indices only (it parses them as int)
            uuids = [g for g in gpus if not g.isdigit()]
            if uuids:
                raise ConfigError(
                    f"--launcher deepspeed picks GPUs by index (--include localhost:N,...), but a training "
                    f"device is {uuids[0]}; give indices, or use --launcher torchrun"
                )
            cmd.append(f"--include=localhost:{','.join(gpus)}")
        cmd += [f"--master_addr={nodes.master_addr}", f"--master_port={nodes.master_port}"]
        return cmd + ["--no_local_rank", "--module", "tandem.cli"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={ranks}",
        f"--nnodes={nodes.nnodes}",
        f"--node-rank={nodes.node_rank}",
        f"--master-addr={nodes.master_addr}",
        f"--master-port={nodes.master_port}",
        "-m",
        "tandem.cli",
    ]


def command_line(child: Child) -> list[str]:
    """What `Launcher.start` runs for `child`: the deepspeed launcher inside `keep_group`, since it
    leaves its ranks running on SIGTERM."""
    if child.cmd[1:3] == ["-m", "deepspeed.launcher.runner"]:
        return [sys.executable, "-m", "tandem.launch", "--keep-group", *child.cmd]
    return child.cmd


def child_environ(child: Child, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment `child` starts with: the launcher's (`environ`), less `unset`, plus `env`."""
    return {**{k: v for k, v in environ.items() if k not in child.unset}, **child.env}


def missing_gpus(devices: list[str]) -> str | None:
    """What this machine lacks for the GPU entries of `devices` (as the user gave them), or None."""
    gpus = list(dict.fromkeys(d for d in devices if d != "cpu"))
    if not gpus:
        return None
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (
            f"this machine has no CUDA device torch can use (torch {torch.__version__}, {build}), "
            f"and the plan puts processes on GPU(s) {','.join(gpus)}"
        )
    count = torch.cuda.device_count()
    beyond = [d for d in gpus if d.isdigit() and int(d) >= count]
    if beyond:
        return f"GPU {beyond[0]} is not among the {count} GPU(s) torch sees here (0..{count - 1})"
    return None


def describe(
    children: list[Child],
    run_dir: Path,
    missing: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """What `tandem launch --dry-run` prints: one block per child with where it runs, what tandem
    sets or removes in the launcher's environment (`environ`), its output and its command line."""
    environ = os.environ if environ is None else environ
    lines = [f"tandem launch --dry-run: {len(children)} process(es) on this node; none is started"]
    if CVD in environ:
        lines.append(f"inherited {CVD}={environ[CVD]}: the GPU indices given count within it")
    for child in children:
        lines += ["", f"{child.name}: {child.where}"]
        for key, value in child.env.items():
            was = environ.get(key)
            lines.append(
                f"  set    {key}={value}" + ("" if was in (None, value) else f"  (inherited: {was})")
            )
        lines += [f"  unset  {key}  (inherited: {environ[key]})" for key in child.unset if key in environ]
        lines.append(f"  output {child.log_path or 'this terminal'}")
        lines.append(f"  run    {shlex.join(command_line(child))}")
    lines += ["", f"run folder {run_dir}: not created or changed by a dry run"]
    if missing:
        lines.append(f"note: {missing}; the plan is for a machine that has them")
    return "\n".join(lines)


def dry_run_config(cfg: Config) -> Config:
    """`cfg` as the dry run's preflight checks it: training.device=cpu, so that a GPU plan can be
    shown on a machine without GPUs (`missing_gpus` says what it lacks); all else is checked."""
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, device="cpu"))


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child sent `sig` when this process (strictly: the thread that
    starts it) dies, however it dies; None where prctl is missing (not Linux): there a child
    outlives a launcher killed by SIGKILL.

    SIGTERM, not SIGKILL: torchrun stops its ranks on SIGTERM, while a SIGKILL would leave them
    running (they sit in sessions of their own)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
        if os.getppid() != parent:  # the launcher died before prctl: nobody will send `sig` now
            os._exit(1)

    return preexec


def keep_group(cmd: list[str]) -> int:
    """Run `cmd` in this process group and exit as it does; on SIGTERM (the launcher's death
    signal, `die_with_parent`), terminate the whole group and kill what is left of it after
    KEEP_GRACE_S seconds. For a command that does not pass SIGTERM on to its own children: the
    deepspeed launcher leaves its ranks running. `python -m tandem.launch --keep-group CMD...`"""
    terminating = False

    def terminate(signum, frame) -> None:
        nonlocal terminating
        terminating = True
        # a handler, not SIG_IGN (which `cmd` would inherit): the killpg reaches this process too
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        signal.signal(signal.SIGALRM, lambda signum, frame: os.killpg(0, signal.SIGKILL))
        signal.alarm(KEEP_GRACE_S)
        os.killpg(0, signal.SIGTERM)

    # Ctrl-C and the launcher's SIGINT reach the whole group already: `cmd` handles them
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, terminate)
    child = subprocess.Popen(cmd)
    if terminating:  # told to stop while `cmd` was starting
        os.killpg(0, signal.SIGTERM)
    rc = child.wait()
    if terminating:  # the rest of the group got SIGTERM too: wait for it (the alarm ends this)
        while _others_in_group():
            time.sleep(0.1)
    if rc < 0:  # die of the same signal, so that the launcher reports it as it is
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


def _others_in_group() -> bool:
    import psutil

    group, me = os.getpgid(0), os.getpid()
    for proc in psutil.process_iter(["pid", "status"]):
        if proc.info["pid"] == me or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(proc.info["pid"]) == group:
                return True
    return False


class Launcher:
    def __init__(
        self, children: list[Child], *, max_restarts: int = 0, sampler_restarts: int = SAMPLER_RESTARTS
    ) -> None:
        self.children = children
        self.max_restarts, self.sampler_restarts = max_restarts, sampler_restarts
        self._stopping = False

    def start(self) -> None:
        for child in self.children:
            self._start(child)

    def _start(self, child: Child) -> None:
        out = None
        if child.log_path is not None:
            child.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = child.log_path.open("ab")
        # a session of its own: the launcher alone decides when a child gets a signal, and
        # SIGTERM when the launcher is gone (called from this thread: its exit is what counts)
        child.proc = subprocess.Popen(
            command_line(child),
            env=child_environ(child, os.environ),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        child.restart_at = None
        if out is not None:
            out.close()
        where = f" (log: {child.log_path})" if child.log_path else ""
        again = f" again (restart {child.restarts})" if child.restarts else ""
        note = f"; {child.note}" if child.note else ""
        log.info("started %s%s, pid %d%s%s", child.name, again, child.proc.pid, where, note)

    def signal_all(self, sig: int) -> None:
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, sig)

    def stop_all(self, grace: float = STOP_GRACE_S) -> None:
        self.signal_all(signal.SIGINT)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children):
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)
        for child in self.children:
            child.proc.wait()

    def wait(self) -> int:
        """Until the trainer finishes (0) or a child fails beyond its restarts (its exit code)."""
        trainer, samplers = self.children[0], self.children[1:]
        while True:
            rc = trainer.proc.poll() if trainer.restart_at is None else None
            if rc == 0:
                self._wait_samplers(samplers)
                return 0
            if rc is not None and not self._restart_later(trainer, rc, self.max_restarts):
                self._failed(trainer, rc)
                return rc
            for child in samplers:
                rc = child.proc.poll() if child.restart_at is None else None
                # 0: the trainer said it has finished, and is writing its final model; a reward
                # function's error (its message ends the log shown) would meet a restart again
                if rc == RewardError.exit_code or (
                    rc and not self._restart_later(child, rc, self.sampler_restarts)
                ):
                    self._failed(child, rc)
                    return rc
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None and now >= child.restart_at:
                    if child is trainer:  # from its newest checkpoint, whatever the first start said
                        child.cmd = [*child.cmd, "training.resume_from_checkpoint=latest"]
                    self._start(child)
            time.sleep(0.2)

    def _restart_later(self, child: Child, rc: int, allowed: int) -> bool:
        """Schedule `child`'s next start after a back-off, if it has restarts left."""
        if child.restarts >= allowed:
            return False
        child.restarts += 1
        delay = min(MAX_BACKOFF_S, 2.0 ** (child.restarts - 1))
        child.restart_at = time.monotonic() + delay
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        log.warning(
            "%s %s; starting it again in %.0f s (restart %d of %d)",
            child.name,
            how,
            delay,
            child.restarts,
            allowed,
        )
        return True

    def _wait_samplers(self, samplers: list[Child]) -> None:
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in samplers):
            time.sleep(0.2)
        self.stop_all(grace=5.0)

    def _failed(self, child: Child, rc: int) -> None:
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        print(f"tandem launch: {child.name} {how}; stopping the other processes", file=sys.stderr)
        if child.log_path is not None and child.log_path.is_file():
            tail = child.log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"--- last lines of {child.log_path}:", *tail, "---", sep="\n", file=sys.stderr)
        self.stop_all()


def launch(
    config_path: str | None,
    overrides: list[str],
    cfg: Config,
    sampling_devices: list[str],
    training_devices: list[str],
    nodes: Nodes | None = None,
    *,
    restarts: Mapping[str, int] | None = None,
) -> int:
    """`plan`, then `launch_children`: the decoupled `tandem grpo` / `tandem ppo`."""
    children = plan(config_path, overrides, cfg, sampling_devices, training_devices, nodes)
    return launch_children(children, **(restarts or {}))


def launch_children(
    children: list[Child], *, max_restarts: int = 0, sampler_restarts: int = SAMPLER_RESTARTS
) -> int:
    """Start `children` (from `plan`) and wait: 0 when the trainer finished, else the failed
    child's exit code, or 130 after Ctrl-C / SIGTERM. `max_restarts`: the trainer's restarts,
    `sampler_restarts`: each sampler's."""
    launcher = Launcher(children, max_restarts=max_restarts, sampler_restarts=sampler_restarts)

    def forward(signum, frame):
        raise KeyboardInterrupt

    # SIGINT explicitly too: a launcher started in the background (nohup, `&`, some CI runners)
    # inherits SIGINT as ignored, and Python then leaves it ignored
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launcher.start()
        return launcher.wait()
    except KeyboardInterrupt:
        print("tandem launch: interrupted; stopping every process", file=sys.stderr)
        launcher.stop_all()
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__" and sys.argv[1:2] == ["--keep-group"]:
    sys.exit(keep_group(sys.argv[2:]))
