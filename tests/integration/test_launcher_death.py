"""A launcher killed by SIGKILL takes its children along: the trainer and samplers of `tandem
launch`, and the ranks that torchrun or the deepspeed launcher started under it (real processes)."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

pytest.importorskip("zmq")

from integration.test_pipeline import REPO, env  # noqa: E402
from tandem.launch import Nodes, distributed_launch  # noqa: E402
from tandem.transport.channel import free_tcp_port  # noqa: E402
from tandem.transport.check import reach  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the death signal is Linux's prctl"),
]

GONE_WITHIN_S = 60  # SIGTERM ends a process at once; torchrun and deepspeed then stop their ranks


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie is gone too: whoever adopted it has yet to reap it)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def kill_and_check_all_follow(proc: subprocess.Popen, processes: list[psutil.Process]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    wait_for(lambda: all(gone(p) for p in processes), "every child to die with the launcher", GONE_WITHIN_S)


def test_a_killed_launcher_takes_its_trainer_and_sampler_along(make_run):
    run = make_run("launcher_killed", "training.max_steps=1000")
    proc = run.start("launch", "--sampling-devices", "cpu", "--training-devices", "cpu", log="launch")
    sampler_log = run.dir / "logs" / "sampler-s0.log"

    def up() -> bool:  # the trainer listens on both ports, the sampler has loaded its models
        started = sampler_log.is_file() and "sampler s0: trainer" in sampler_log.read_text(errors="replace")
        return (
            started
            and reach("127.0.0.1", run.data_port) is None
            and reach("127.0.0.1", run.sync_port) is None
        )

    wait_for(up, "the trainer and the sampler to start")
    children = descendants(proc)
    assert sorted("sample" in p.cmdline() for p in children) == [False, True]  # a trainer, a sampler
    kill_and_check_all_follow(proc, children)

    def free(port: int) -> bool:  # nothing listens, and a new trainer may bind it (SO_REUSEADDR, as ZeroMQ)
        if reach("127.0.0.1", port) is None:
            return False  # (a dying process whose threads are not all gone yet still holds it)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
        return True

    wait_for(lambda: free(run.data_port) and free(run.sync_port), "the ports to be free", GONE_WITHIN_S)


# a Launcher in a process of its own, with one child: a 2-rank job whose ranks are `sleep` (cheap)
DRIVER = """
import sys, time
from tandem.launch import Child, Launcher
Launcher([Child("trainer", sys.argv[1:])]).start()
time.sleep(600)
"""


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_killed_launcher_takes_the_ranks_of_its_distributed_trainer_along(launcher):
    if launcher == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    job = distributed_launch(Nodes(master_port=free_tcp_port(), launcher=launcher), 2)
    assert job[-2:] in (["-m", "tandem.cli"], ["--module", "tandem.cli"])
    no_python = "--no-python" if launcher == "torchrun" else "--no_python"
    cmd = [sys.executable, "-c", DRIVER, *job[:-2], no_python, "sleep", "600"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**env(), "DS_ACCELERATOR": "cpu"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def ranks() -> list[psutil.Process]:
        return [p for p in descendants(proc) if p.name() == "sleep"]

    try:
        wait_for(lambda: len(ranks()) == 2, "the two ranks to start")
        # torchrun's ranks sit in sessions of their own; deepspeed's beside a launcher of their own
        processes = descendants(proc)
        assert len(processes) >= 3
        kill_and_check_all_follow(proc, processes)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
