"""`tandem launch`: start the trainer and the samplers of one run as child processes.

    tandem launch CONFIG [key=value ...] --sampling-devices 0 --training-devices 1
    tandem launch CONFIG --sampling-devices cpu,cpu --training-devices cpu
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3            # 3 trainer ranks
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3 --launcher deepspeed
    # two nodes: on the first (samplers there), then on the second (none there)
    tandem launch CONFIG --sampling-devices 0 --training-devices 1,2,3 --nnodes 2 --node-rank 0 --master-addr HOST0
    tandem launch CONFIG --sampling-devices none --training-devices 0,1,2,3 --nnodes 2 --node-rank 1 --master-addr HOST0

Each sampling device gets one sampler (`s0`, `s1`, ... in order); a GPU id is exposed to its
child as CUDA_VISIBLE_DEVICES. Several training devices (or several nodes) make the trainer a
torchrun (or `deepspeed` launcher) job with one rank per device; its rank 0, on node 0, is where
the samplers send their groups (`pipeline.trainer_host`). A config whose
`training.distributed_strategy` is none gets `auto` (DDP below 1B parameters, ZeRO otherwise). On the CPU the cores are split between the processes unless
`sampling.num_threads` / `training.num_threads` say otherwise. The trainer keeps this terminal;
the samplers write to `<run_dir>/logs/sampler-<id>.log`. Ctrl-C (SIGINT) and SIGTERM are
forwarded to every child; when one child fails, the others are stopped and the launcher says
which one failed and shows the end of its log. Children die with the launcher, however it dies
(even by SIGKILL): on Linux each gets SIGTERM when the launcher is gone (prctl PR_SET_PDEATHSIG),
which torchrun passes on to its ranks; the deepspeed launcher does not, so its process group is
kept by `keep_group`, which takes all of it down.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.config import Config, ConfigError

log = logging.getLogger(__name__)

STOP_GRACE_S = 30.0  # after the trainer finished, or after Ctrl-C, before children are killed
KEEP_GRACE_S = 10  # keep_group: after SIGTERM, before what is left of the group is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None  # None: share the launcher's terminal
    proc: subprocess.Popen | None = None


@dataclass
class Nodes:
    """Where this node's trainer ranks sit in a multi-node job (torchrun's rendezvous flags)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "torchrun"  # torchrun | deepspeed


def parse_devices(spec: str, option: str) -> list[str]:
    """`cpu`, `cpu,cpu` or GPU ids `0,1`: one entry per process (sampling) or rank (training);
    `none` (sampling only): no sampler on this node."""
    if spec.strip() == "none" and option == "--sampling-devices":
        return []
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    for d in devices:
        if d != "cpu" and not d.isdigit():
            raise ConfigError(f"{option} {spec!r}: each device is `cpu` or a GPU index, e.g. 0,1")
    if not devices:
        raise ConfigError(f"{option} is empty: give `cpu` or GPU indices such as 0,1")
    return devices


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
) -> list[Child]:
    nodes = nodes or Nodes()
    if len(set(training_devices)) != len(training_devices) and "cpu" not in training_devices:
        raise ConfigError(f"--training-devices {','.join(training_devices)}: a GPU may hold one trainer rank")
    if "cpu" in training_devices and len(set(training_devices)) > 1:
        raise ConfigError("--training-devices: all ranks on the CPU (cpu,cpu) or all on GPUs (0,1), not both")
    # sft, rm and dpo learn from a fixed data set: trainer ranks only; grpo and ppo trainers take
    # groups from samplers (`tandem train` runs the loop of the config's method)
    supervised = cfg.method in ("sft", "rm", "dpo")
    command = cfg.method if supervised else "train"
    if supervised:
        sampling_devices = []
    elif not sampling_devices and nodes.node_rank == 0:
        raise ConfigError("--sampling-devices none: node 0 must run the samplers (give e.g. cpu or 0)")
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

    run_logs = cfg.run_dir / "logs"
    children = []
    train_dev = training_devices[0]
    ranks = len(training_devices)
    if ranks > 1 or nodes.nnodes > 1:
        if cfg.training.distributed_strategy == "none":
            trainer_extra.append("training.distributed_strategy=auto")
        trainer = Child(
            "trainer", distributed_launch(nodes, ranks) + [command, *head, *shared, *trainer_extra]
        )
    else:
        trainer = Child("trainer", base + [command, *head, *shared, *trainer_extra])
    if train_dev == "cpu":
        trainer.cmd.append("training.device=cpu")
        trainer.env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed (and its launcher) on the CPU
    else:
        trainer.env["CUDA_VISIBLE_DEVICES"] = ",".join(training_devices)
        trainer.cmd.append("training.device=cuda")
    children.append(trainer)
    for i, dev in enumerate(sampling_devices):
        sid = f"s{i}"
        cmd = base + ["sample", *head, *shared, *sampler_extra, "--sampler-id", sid]
        child = Child(f"sampler {sid}", cmd, log_path=run_logs / f"sampler-{sid}.log")
        if dev == "cpu":
            child.cmd += ["--device", "cpu"]
        else:
            child.env["CUDA_VISIBLE_DEVICES"] = dev
            child.cmd += ["--device", "cuda:0"]
        children.append(child)
    for child in children:
        child.env["TANDEM_LAUNCHED"] = "1"  # the launcher prints the run summary, not each child
    return children


def distributed_launch(nodes: Nodes, ranks: int) -> list[str]:
    """The torchrun (or deepspeed launcher) command that starts this node's trainer ranks."""
    if nodes.launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--num_gpus={ranks}"]
        if nodes.nnodes > 1:  # no hostfile or ssh: each node starts its own ranks, as torchrun does
            cmd += ["--no_ssh", f"--num_nodes={nodes.nnodes}", f"--node_rank={nodes.node_rank}"]
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
    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self._stopping = False

    def start(self) -> None:
        for child in self.children:
            env = {**os.environ, **child.env}
            out = None
            if child.log_path is not None:
                child.log_path.parent.mkdir(parents=True, exist_ok=True)
                out = child.log_path.open("ab")
            cmd = child.cmd
            if cmd[1:3] == ["-m", "deepspeed.launcher.runner"]:  # it leaves its ranks behind on SIGTERM
                cmd = [sys.executable, "-m", "tandem.launch", "--keep-group", *cmd]
            # a session of its own: the launcher alone decides when a child gets a signal, and
            # SIGTERM when the launcher is gone (called from this thread: its exit is what counts)
            child.proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
            if out is not None:
                out.close()
            where = f" (log: {child.log_path})" if child.log_path else ""
            log.info("started %s, pid %d%s", child.name, child.proc.pid, where)

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
        """Until the trainer finishes (0) or a child fails (its exit code, or 1)."""
        trainer, samplers = self.children[0], self.children[1:]
        while True:
            rc = trainer.proc.poll()
            if rc == 0:
                self._wait_samplers(samplers)
                return 0
            if rc is not None:
                self._failed(trainer, rc)
                return rc
            for child in samplers:
                rc = child.proc.poll()
                if rc:  # 0: the trainer said it has finished, and is writing its final model
                    self._failed(child, rc)
                    return rc
            time.sleep(0.2)

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
) -> int:
    launcher = Launcher(plan(config_path, overrides, cfg, sampling_devices, training_devices, nodes))

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
