"""The sandboxed Python tool (tandem.tools:python): what it returns, and that an infinite loop, a fork
bomb, a memory hog, a network connection and an exit each end as a message with the calling process
unharmed (real processes, real limits)."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from tandem import tools
from tandem.agent.calls import ToolCall
from tandem.agent.runner import ToolRunner
from tandem.agent.tools import tool_from_callable

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX only")


def started_since(when: float) -> list[psutil.Process]:
    """Processes of the sandbox's user created since `when` (root runs the sandbox as nobody)."""
    uid = tools.NOBODY if os.geteuid() == 0 else os.getuid()
    found = []
    for p in psutil.process_iter(["uids", "create_time"]):
        if (
            p.info["uids"]
            and p.info["uids"].real == uid
            and p.info["create_time"] >= when
            and p.pid != os.getpid()
        ):
            found.append(p)
    return found


@pytest.fixture
def sandbox():
    before = (os.getpid(), threading.active_count(), len(psutil.Process().children(recursive=True)))
    yield tools.python
    # the caller: same process, no stray threads or children
    assert (os.getpid(), threading.active_count(), len(psutil.Process().children(recursive=True))) == before


def test_it_returns_what_the_code_prints(sandbox):
    assert sandbox("print(sum(range(10)))") == "45"
    assert sandbox("import math\nprint(round(math.sqrt(2), 6))") == "1.414214"
    assert sandbox("x = 1") == "[no output]"
    out = sandbox("print('a')\nraise ValueError('bad')")
    assert out.startswith("a\n") and "ValueError: bad" in out and out.endswith("[exit status 1]")


def test_an_infinite_loop_ends_at_the_cpu_limit(sandbox, monkeypatch):
    monkeypatch.setattr(tools, "CPU_SECONDS", 1)
    assert "reached its CPU time (1 s) or memory limit" in sandbox("while True:\n    pass")


def test_a_sleeping_program_ends_at_the_wall_clock_limit(sandbox, monkeypatch):
    monkeypatch.setattr(tools, "WALL_SECONDS", 1.0)
    assert "ran longer than 1 s" in sandbox("import time\ntime.sleep(60)")


def test_a_fork_bomb_is_contained(sandbox):
    start = time.time() - 1
    out = sandbox("import os\nwhile True:\n    os.fork()")
    assert "BlockingIOError" in out or "stopped" in out
    assert not started_since(start), "a forked process outlived the call"


def test_a_memory_hog_gets_a_memory_error(sandbox):
    out = sandbox("x = bytearray(4 * 1024 ** 3)")
    assert "MemoryError" in out


def test_there_is_no_network(sandbox):
    code = "import socket\nprint(socket.if_nameindex())\ns = socket.socket()\ns.settimeout(3)\ns.connect(('1.1.1.1', 80))"
    out = sandbox(code)
    if "refuses to run here" in out:
        pytest.skip("this host allows no network namespace: the tool refuses (checked by the message)")
    assert out.startswith("[(1, 'lo')]")  # a namespace of its own: only loopback
    assert "Network is unreachable" in out or "OSError" in out


def test_output_is_capped(sandbox):
    out = sandbox("print('x' * 10**6)")
    assert len(out) <= tools.MAX_OUTPUT_CHARS + 30 and out.endswith("…[output truncated]")


def test_through_the_runner_a_hostile_call_is_just_a_result():
    runner = ToolRunner(timeout_s=30)
    python = tool_from_callable(tools.python)
    try:
        results = runner.run(
            [
                ({"python": python}, [ToolCall("python", {"code": "import os\nos._exit(7)"})]),
                ({"python": python}, [ToolCall("python", {"code": "print(6 * 7)"})]),
            ]
        )
        assert results[0][0].content == "[exit status 7]" and results[0][0].error is None
        assert results[1][0].content == "42"
    finally:
        runner.close()
