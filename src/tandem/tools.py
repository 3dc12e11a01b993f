"""Built-in tools for agent runs (`agent.tools: ["tandem.tools:calculator", "tandem.tools:python"]`).

`calculator` evaluates arithmetic by walking its syntax tree (numbers, + - * / // % **, unary signs and
parentheses, nothing else: no names, calls or attributes), with bounds on the expression's length and
on exponents, so no input can run code or exhaust the sampler.

`python` runs the policy's code in a separate, disposable process, because it is the first tool
users reach for and the one that can hurt a host the most. The process:

- is a fresh interpreter (`python -I`: no user site, no environment variables of the sampler);
- has no network: a new network namespace holds only a loopback interface that is down (as root
  directly, otherwise inside a new user namespace; where the host allows neither, the tool refuses
  to run and says so: it never runs code with the network open);
- runs as `nobody` when the sampler is root, so that the process limit holds (the kernel does not
  apply it to root);
- has limits on CPU seconds, address space, processes, file size and wall-clock time, and a
  temporary working directory that is removed afterwards;
- writes its output to files capped by the file-size limit; the tool returns at most
  `MAX_OUTPUT_CHARS` of it.

Whatever the code does (an infinite loop, a fork bomb, a memory hog, `os._exit`), the result is a
string for the policy; the sampler's process is never touched. The limits are module constants:
set them before the run starts (e.g. in your own module that wraps `python`) to change them.
"""

from __future__ import annotations

import ast
import contextlib
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CPU_SECONDS = 5
WALL_SECONDS = 10.0
MEMORY_BYTES = 512 * 2**20
MAX_PROCESSES = 16  # beyond the ones the sandbox's user already has
FILE_BYTES = 16 * 2**20
MAX_OUTPUT_CHARS = 4000
NOBODY = 65534

# runs first in the child, before a line of the policy's code: network namespace, limits, user
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
cpu, memory, nproc, fsize, drop = (int(x) for x in sys.argv[1:6])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
if libc.unshare(CLONE_NEWNET) != 0 and libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
    sys.stderr.write("tandem-sandbox: no network namespace available\n")
    os._exit(90)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
# loaded while the interpreter's files are still readable: an unprivileged user may not reach them
import bisect, cmath, collections, datetime, decimal, fractions, functools, heapq, itertools, json
import math, operator, random, re, socket, statistics, string, textwrap, time
import encodings.idna
if drop:
    os.setgroups([])
    os.setgid(drop)
    os.setuid(drop)
code = open("main.py", encoding="utf-8").read()
del ctypes, libc, resource, cpu, memory, nproc, fsize, drop, CLONE_NEWNET, CLONE_NEWUSER
sys.argv = ["main.py"]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 4"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: the expression is longer than {MAX_EXPRESSION_CHARS} characters"
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as err:
        return f"Error: {err}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not allowed")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    Args:
        code: the Python program to run; print the values you want to see.
    """
    workdir = Path(tempfile.mkdtemp(prefix="tandem-python-"))
    try:
        return _run(code, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(code: str, workdir: Path) -> str:
    drop = NOBODY if os.geteuid() == 0 else 0
    if drop:
        os.chmod(workdir, 0o777)  # nobody writes its own files here
    (workdir / "main.py").write_text(code, encoding="utf-8")
    nproc = MAX_PROCESSES + (0 if drop else _processes_of(os.getuid()))
    argv = [sys.executable, "-I", "-c", _BOOTSTRAP, str(CPU_SECONDS), str(MEMORY_BYTES), str(nproc)]
    argv += [str(FILE_BYTES), str(drop)]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    out_path, err_path = workdir / ".stdout", workdir / ".stderr"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            status = proc.wait(timeout=WALL_SECONDS)
            timed_out = False
        except subprocess.TimeoutExpired:
            status, timed_out = None, True
        finally:
            _kill_everything(proc)
    stdout = _head(out_path)
    stderr = _head(err_path)
    if status == 90 and "no network namespace" in stderr:
        return (
            "Error: the python tool refuses to run here: this host allows no network namespace (run the "
            "sampler as root, or enable unprivileged user namespaces), and it never runs code with the "
            "network open"
        )
    return _report(stdout, stderr, status, timed_out)


def _report(stdout: str, stderr: str, status: int | None, timed_out: bool) -> str:
    if timed_out:
        why = f"stopped: it ran longer than {WALL_SECONDS:g} s"
    elif status in (-signal.SIGXCPU, -signal.SIGKILL):
        why = f"stopped: it reached its CPU time ({CPU_SECONDS} s) or memory limit"
    elif status is not None and status < 0:
        why = f"stopped by signal {signal.Signals(-status).name}"
    elif status:
        why = f"exit status {status}"
    else:
        why = ""
    parts = [stdout.rstrip()] if stdout.strip() else []
    if stderr.strip() and (status or timed_out):
        parts.append(stderr.rstrip())
    if why:
        parts.append(f"[{why}]")
    text = "\n".join(parts) or "[no output]"
    return text if len(text) <= MAX_OUTPUT_CHARS else text[:MAX_OUTPUT_CHARS] + "\n…[output truncated]"


def _head(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(MAX_OUTPUT_CHARS + 1).decode("utf-8", errors="replace")


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.stat().st_uid == uid:
                    count += 1
    return count


def _kill_everything(proc: subprocess.Popen) -> None:
    """The child, its process group and every descendant that left the group (setsid)."""
    import psutil

    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    proc.kill()
    proc.wait()
    for _ in range(200):  # SIGKILL lands asynchronously: return once the group is gone (at most 2 s)
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.01)
