"""Run the tool calls of many episodes at once, keeping every failure away from the sampler.

Calls of all episodes of a generation round run concurrently: async tools on the runner's own
event loop, sync tools in a bounded thread pool. Each call has a time limit
(`agent.tool_timeout_s`). An exception, a timeout, an unknown tool, an unreadable call or arguments
that do not fit the tool's schema become the call's result, an error text the policy reads in the
next turn, and are counted by kind; nothing a tool does can raise out of `ToolRunner.run`.

The trust boundary: tools run inside the sampler process, with its rights. A sync tool that
overruns its limit is abandoned, not killed (Python cannot stop a thread): it keeps a pool thread
until it returns, and calls beyond the pool's size wait for a free one within their own limit. A
tool that may hang or must not touch the host belongs in a separate process, as `tandem.tools:python`
does.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tandem.agent.calls import CallError, ToolCall, check_arguments
from tandem.agent.tools import Tool

MAX_ERROR_CHARS = 500  # of an exception's text in the message to the policy


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the policy reads in the tool message
    error: str | None = None  # kind: exception | timeout | unknown_tool | bad_json | bad_call | ...
    seconds: float = 0.0


class ToolRunner:
    def __init__(self, timeout_s: float, max_workers: int = 8) -> None:
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tandem-tool")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tandem-tool-loop", daemon=True)
        self.thread.start()
        self.errors: Counter[str] = Counter()  # by kind, since the runner started
        self.calls = 0

    def run(
        self, requests: list[tuple[dict[str, Tool], list[ToolCall | CallError]]]
    ) -> list[list[ToolResult]]:
        """For each episode (its tools by name, the calls of its turn): the results, in call order."""

        async def everything() -> list[list[ToolResult]]:
            return list(
                await asyncio.gather(
                    *(
                        asyncio.gather(*(self._one(tools, call) for call in calls))
                        for tools, calls in requests
                    )
                )
            )

        results = asyncio.run_coroutine_threadsafe(everything(), self.loop).result()
        for episode in results:
            for result in episode:
                self.calls += 1
                if result.error is not None:
                    self.errors[result.error] += 1
        return [list(r) for r in results]

    async def _one(self, tools: dict[str, Tool], call: ToolCall | CallError) -> ToolResult:
        start = time.perf_counter()
        if isinstance(call, CallError):
            return ToolResult(call.name or "unknown", f"Error: {call.message}", call.kind)
        tool = tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(tools)) or "none"
            return ToolResult(
                call.name, f"Error: there is no tool {call.name!r} (tools: {known})", "unknown_tool"
            )
        problem = check_arguments(call, tool.parameters)
        if problem is not None:
            return ToolResult(call.name, f"Error: {problem}", "bad_arguments")
        try:
            if tool.is_async:
                work = tool.fn(**call.arguments)
            else:
                work = self.loop.run_in_executor(self.pool, functools.partial(tool.fn, **call.arguments))
            value = await asyncio.wait_for(work, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            return ToolResult(
                call.name,
                f"Error: {call.name} did not finish within {self.timeout_s:g} s",
                "timeout",
                self.timeout_s,
            )
        except (
            BaseException
        ) as err:  # a tool's SystemExit or KeyboardInterrupt must not stop the sampler either
            if isinstance(err, asyncio.CancelledError):
                raise
            text = f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
            return ToolResult(call.name, f"Error: {text}", "exception", time.perf_counter() - start)
        content = value if isinstance(value, str) else str(value)  # TRL's rule: str() of what it returns
        return ToolResult(call.name, content, None, time.perf_counter() - start)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)


def truncate_text(text: str, tokenizer, max_tokens: int) -> tuple[str, bool]:
    """`text` cut to its first `max_tokens` tokens (`agent.max_tool_response_tokens`), and whether it was."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + " …[truncated]", True
