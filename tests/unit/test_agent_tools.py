"""Agent building blocks (tandem.agent): tools and environments in TRL's conventions, tool-call
parsing, argument checks, and a runner that turns every failure into a message for the policy."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types

import pytest

from tandem.agent.calls import MAX_CALLS_PER_TURN, CallError, ToolCall, check_arguments, parse_hermes
from tandem.agent.runner import ToolRunner, truncate_text
from tandem.agent.tools import (
    ToolSpecError,
    load_environment,
    load_tools,
    reset_environment,
    tool_from_callable,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


async def slow_echo(text: str) -> str:
    """Echo after a pause.

    Args:
        text: what to echo
    """
    await asyncio.sleep(0.05)
    return text


def sleeper(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def crash(reason: str) -> str:
    """Fail.

    Args:
        reason: why
    """
    raise RuntimeError(reason)


def leave(code: int) -> str:
    """Call sys.exit.

    Args:
        code: the status
    """
    sys.exit(code)


def undocumented(a: int):
    return a


class Counter:
    """A TRL-style environment: reset with the row, public methods are tools, get_reward scores."""

    def __init__(self):
        self.total = 0
        self.target = None

    def reset(self, target: int, **kwargs) -> str:
        self.total, self.target = 0, target
        return f"Reach {target}."

    def increment(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: the amount
        """
        self.total += by
        return str(self.total)

    def get_reward(self) -> float:
        return float(self.total == self.target)

    def _helper(self):
        return None

    @property
    def state(self):
        raise AssertionError("properties are never evaluated when listing tools")


class NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: a number
        """
        return x


class StrictReset:
    def reset(self, question: str):
        self.question = question


def module_with(**objects) -> str:
    name = f"agent_test_module_{len(sys.modules)}"
    module = types.ModuleType(name)
    module.__dict__.update(objects)
    sys.modules[name] = module
    return name


def test_a_trl_tool_function_gets_the_chat_template_schema():
    tool = tool_from_callable(add)
    assert tool.name == "add" and not tool.is_async
    assert tool.parameters["properties"] == {
        "a": {"type": "integer", "description": "the first"},
        "b": {"type": "integer", "description": "the second"},
    }
    assert tool_from_callable(slow_echo).is_async


def test_tools_load_by_path_and_bad_ones_say_what_to_fix():
    mod = module_with(add=add, undocumented=undocumented, not_a_function=3, Counter=Counter)
    assert [t.name for t in load_tools([f"{mod}:add"])] == ["add"]
    with pytest.raises(ToolSpecError, match="docstring"):
        load_tools([f"{mod}:undocumented"])
    with pytest.raises(ToolSpecError, match="int, not a function"):
        load_tools([f"{mod}:not_a_function"])
    with pytest.raises(ToolSpecError, match="Counter, not a function|type, not a function"):
        load_tools([f"{mod}:Counter"])
    with pytest.raises(ToolSpecError, match="package.module:name"):
        load_tools(["add"])
    with pytest.raises(ToolSpecError, match="two tools are named 'add'"):
        load_tools([f"{mod}:add", f"{mod}:add"])


def test_an_environment_class_runs_as_trl_defines_it():
    mod = module_with(Counter=Counter, NoReset=NoReset)
    env = load_environment(f"{mod}:Counter")
    assert env.methods == ("increment",) and env.has_reward
    one, two = env.new(), env.new()
    assert reset_environment(one, {"target": 3, "question": "q", "answer": "3"}) == "Reach 3."
    reset_environment(two, {"target": 5})
    (increment,) = env.tools(one)
    increment.fn(by=3)
    assert (one.get_reward(), two.get_reward()) == (1.0, 0.0)  # instances share no state
    with pytest.raises(ToolSpecError, match="no reset method"):
        load_environment(f"{mod}:NoReset")


def test_reset_gets_only_the_columns_it_accepts():
    env = StrictReset()
    assert reset_environment(env, {"question": "2 + 2?", "answer": "4"}) is None
    assert env.question == "2 + 2?"

    class Bad:
        def reset(self):
            return 7

    with pytest.raises(ToolSpecError, match="returned a int"):
        reset_environment(Bad(), {"question": "x"})


def test_hermes_calls_are_parsed_and_broken_ones_become_errors():
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call> then <tool_call>{"name": "add"'
    )
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]
    assert [c.kind for c in calls[2:]] == ["bad_json", "bad_call", "bad_call", "unclosed"]
    assert parse_hermes("The answer is 4.") == []
    many = "".join('<tool_call>{"name": "add", "arguments": {}}</tool_call>' for _ in range(40))
    parsed = parse_hermes(many)
    assert len(parsed) == MAX_CALLS_PER_TURN + 1 and parsed[-1].kind == "too_many"


def test_arguments_are_checked_against_the_schema():
    params = tool_from_callable(add).parameters
    assert check_arguments(ToolCall("add", {"a": 1, "b": 2}), params) is None
    assert "missing argument(s) b" in check_arguments(ToolCall("add", {"a": 1}), params)
    assert "no argument(s) c" in check_arguments(ToolCall("add", {"a": 1, "b": 2, "c": 3}), params)
    assert "must be integer, got str" in check_arguments(ToolCall("add", {"a": "1", "b": 2}), params)
    assert "must be integer, got bool" in check_arguments(ToolCall("add", {"a": True, "b": 2}), params)


def test_the_runner_turns_every_failure_into_a_message_and_counts_it():
    tools = {t.name: t for t in map(tool_from_callable, (add, slow_echo, sleeper, crash, leave))}
    runner = ToolRunner(timeout_s=0.5, max_workers=4)
    try:
        threads = threading.active_count()
        results = runner.run(
            [
                (tools, [ToolCall("add", {"a": 2, "b": 3}), ToolCall("slow_echo", {"text": "hi"})]),
                (tools, [ToolCall("sleeper", {"seconds": 3.0}), ToolCall("crash", {"reason": "boom"})]),
                (tools, [ToolCall("leave", {"code": 2}), ToolCall("nope", {}), CallError("bad_json", "x")]),
                (tools, [ToolCall("add", {"a": "2"})]),
            ]
        )
        assert [(r.content, r.error) for r in results[0]] == [("5", None), ("hi", None)]
        assert results[1][0].error == "timeout" and "did not finish within 0.5 s" in results[1][0].content
        assert results[1][1].error == "exception" and "RuntimeError: boom" in results[1][1].content
        assert results[2][0].error == "exception" and "SystemExit" in results[2][0].content
        assert results[2][1].error == "unknown_tool" and "there is no tool 'nope'" in results[2][1].content
        assert results[2][2].error == "bad_json"
        assert results[3][0].error == "bad_arguments"
        assert runner.calls == 8 and sum(runner.errors.values()) == 6
        # the runner is still usable, and the abandoned sleeper holds one pool thread at most
        assert runner.run([(tools, [ToolCall("add", {"a": 1, "b": 1})])])[0][0].content == "2"
        assert threading.active_count() <= threads + 4
    finally:
        runner.close()


def test_calls_of_different_episodes_run_concurrently():
    """Six calls meet at a barrier that opens only when all six are in flight at once: run one after
    another, the first would wait alone until the barrier breaks."""
    barrier = threading.Barrier(6, timeout=5)

    def meet(name: str) -> str:
        """Wait for the others.

        Args:
            name: who
        """
        barrier.wait()
        return name

    tools = {"meet": tool_from_callable(meet)}
    runner = ToolRunner(timeout_s=10, max_workers=8)
    try:
        results = runner.run([(tools, [ToolCall("meet", {"name": f"e{i}"})]) for i in range(6)])
        assert [r[0].content for r in results] == [f"e{i}" for i in range(6)]
        assert not runner.errors
    finally:
        runner.close()


def test_a_long_tool_result_is_cut_to_its_token_budget(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text, cut = truncate_text("word " * 200, tokenizer, 10)
    assert cut and text.endswith("…[truncated]")
    assert len(tokenizer(text.removesuffix(" …[truncated]"), add_special_tokens=False)["input_ids"]) <= 10
    assert truncate_text("short", tokenizer, 10) == ("short", False)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    from tandem.tools import calculator

    assert (
        calculator("(12 + 30) * 4") == "168" and calculator("7/2") == "3.5" and calculator("-3 + +4") == "1"
    )
    assert calculator("10 // 3") == "3" and calculator("2**10") == "1024" and calculator("8 / 4") == "2"
    assert "exponents above" in calculator("9**99**99")  # would not finish
    assert calculator("1/0") == "Error: division by zero"
    for hostile in ('__import__("os").system("true")', "a + 1", "(1).__class__", "[1, 2]", "'x' * 9"):
        assert calculator(hostile).startswith("Error: only numbers"), hostile
    assert "longer than" in calculator("1+" * 150 + "1")
    schema = tool_from_callable(calculator).schema["function"]
    assert schema["name"] == "calculator" and "expression" in schema["parameters"]["properties"]
