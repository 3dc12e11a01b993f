"""TRL's calling convention in real rollouts on a tiny random model: what a reward receives there, and
TRL's own shipped reward functions (trl.rewards) running unchanged inside `tandem grpo` (colocated, and
decoupled: a sampler process and a trainer process) and `tandem ppo`, on a chat-format data file with a
`solution` column.

The TRL tests need the `trl` extra (pip install -e '.[trl]'); they skip without it.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_pipeline import REPO, env
from transformers import AutoTokenizer

from tandem.config import RewardSpec
from tandem.data.prompts import PromptStyle, build_messages, worked_shots
from tandem.rewards.registry import RewardSet
from tandem.sampler.rollout import Rollout
from tandem.transport.channel import free_tcp_port
from tandem.types import Example

SYSTEM = "Think inside <think></think>, then give the answer in \\boxed{}."
CHAT_ROWS = [
    Example(
        f"chat-{i}",
        question,
        solution,
        prompt=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        columns={"solution": solution, "source": "handmade"},
    )
    for i, (question, solution) in enumerate(
        [("What is 8 * 9?", "72"), ("Simplify 2/6.", "\\frac{1}{3}"), ("Name a colour.", "")]
    )
]
LEGACY_ROW = Example("old-0", "What is 2 + 3?", "5")

RECORDER = """
CALLS = []

def record(prompts, completions, completion_ids, **columns):
    CALLS.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, columns=columns))
    return [0.0 for _ in completions]
"""


def rollout_with(model, tokenizer, rewards: RewardSet, **fields) -> Rollout:
    settings = dict(
        policy=model,
        reference=None,
        tokenizer=tokenizer,
        rewards=rewards,
        # rows built from a question: the math task's form; a row's own chat gets only the prefill
        question_style=PromptStyle("Be brief.", tuple(worked_shots(1)), "<think>"),
        row_style=PromptStyle("", (), "<think>"),
        num_generations=2,
        max_new_tokens=8,
        generator=torch.Generator().manual_seed(0),
    )
    return Rollout(**{**settings, **fields})


def test_reward_prompts_in_a_rollout(tiny_model, tiny_model_dir, tmp_path, monkeypatch) -> None:
    """Rollout.run calls each reward once per batch: a row's own prompt (chat messages here) or, for a
    row without one, the messages its question is rendered from; completions as assistant messages
    holding prefill + text; the generated token ids; the columns repeated per completion."""
    (tmp_path / "recorder.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    recorder = importlib.import_module("recorder")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = rollout_with(
        tiny_model, tokenizer, RewardSet.from_specs([RewardSpec("function", function="recorder:record")])
    )
    groups = rollout.run([CHAT_ROWS[0], LEGACY_ROW], policy_version=0)
    sys.modules.pop("recorder")

    assert len(recorder.CALLS) == 1
    call = recorder.CALLS[0]
    legacy_messages = build_messages(LEGACY_ROW.question, "Be brief.", worked_shots(1))
    assert call["prompts"] == [CHAT_ROWS[0].prompt] * 2 + [legacy_messages] * 2
    completions = [c for g in groups for c in g.completions]
    assert call["completions"] == [
        [{"role": "assistant", "content": "<think>" + c.text}] for c in completions
    ]
    assert call["completion_ids"] == [c.generated_token_ids for c in completions]
    assert call["columns"] == {
        "solution": ["72", "72", None, None],
        "source": ["handmade", "handmade", None, None],
    }


# --- TRL's own reward functions


def trl_rewards():
    pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[trl]'")
    pytest.importorskip("math_verify", reason="math-verify is not installed: pip install -e '.[trl]'")
    from trl import rewards

    return rewards


TRL_SPECS = "[{type: function, function: 'trl.rewards:think_format_reward'}, {type: function, function: 'trl.rewards:accuracy_reward'}, {type: function, function: 'trl.rewards:get_soft_overlong_punishment', kwargs: {max_completion_len: 8, soft_punish_cache: 4}}]"  # noqa: E501


def trl_reward_set() -> RewardSet:
    return RewardSet.from_specs(
        [
            RewardSpec("function", function="trl.rewards:think_format_reward"),
            RewardSpec("function", function="trl.rewards:accuracy_reward"),
            RewardSpec(
                "function",
                function="trl.rewards:get_soft_overlong_punishment",
                kwargs={"max_completion_len": 8, "soft_punish_cache": 4},
            ),
        ]
    )


def test_trl_reward_functions_score_as_in_trl() -> None:
    """The values TRL's functions give when TRL calls them, through tandem's call, on chosen completions."""
    trl = trl_rewards()
    rewards = trl_reward_set()
    assert rewards.names == ["think_format_reward", "accuracy_reward", "get_soft_overlong_punishment"]
    texts = ["<think>8 nines</think> \\boxed{72}", "no think \\boxed{\\frac{1}{3}}", "<think>x</think> red"]
    ids = [[1] * 3, [1] * 6, [1] * 9]  # within the limit; 2 tokens into the 4-token cache; over the limit
    scored = rewards.score_batch(texts, CHAT_ROWS, ids)
    assert [info for _, info in scored] == [
        {"think_format_reward": 1.0, "accuracy_reward": 1.0, "get_soft_overlong_punishment": 0.0},
        {"think_format_reward": 0.0, "accuracy_reward": 1.0, "get_soft_overlong_punishment": -0.5},
        # an empty gold: accuracy_reward returns None (does not apply), left out of the sum
        {"think_format_reward": 1.0, "accuracy_reward": None, "get_soft_overlong_punishment": -1.0},
    ]
    assert [total for total, _ in scored] == [2.0, 0.5, 0.0]
    # the oracle: TRL's functions called as TRL's GRPOTrainer calls them
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    solution = [row.columns["solution"] for row in CHAT_ROWS]
    overlong = trl.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
    assert [info["accuracy_reward"] for _, info in scored] == trl.accuracy_reward(completions, solution)
    assert [info["think_format_reward"] for _, info in scored] == trl.think_format_reward(completions)
    assert [info["get_soft_overlong_punishment"] for _, info in scored] == overlong(completion_ids=ids)


def test_trl_reward_functions_in_a_rollout_match_trl(tiny_model, tiny_model_dir) -> None:
    """Sampled completions of chat rows: each reward_info value is what TRL's function returns for it."""
    trl = trl_rewards()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout = rollout_with(tiny_model, tokenizer, trl_reward_set(), num_generations=4)
    groups = rollout.run(CHAT_ROWS, policy_version=0)
    overlong = trl.get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
    for row, group in zip(CHAT_ROWS, groups):
        completions = [[{"role": "assistant", "content": "<think>" + c.text}] for c in group.completions]
        ids = [c.generated_token_ids for c in group.completions]
        expected = zip(
            trl.think_format_reward(completions),
            trl.accuracy_reward(completions, [row.columns["solution"]] * len(completions)),
            overlong(completion_ids=ids),
        )
        for c, (think, accuracy, length) in zip(group.completions, expected):
            assert c.reward_info == {
                "think_format_reward": think,
                "accuracy_reward": accuracy,
                "get_soft_overlong_punishment": length,
            }
            assert c.reward == think + (accuracy or 0.0) + length
    assert {c.reward_info["accuracy_reward"] for c in groups[2].completions} == {None}  # empty gold


def chat_file(path: Path) -> Path:
    """The chat rows as a data file: {prompt: [messages], solution, source}."""
    path.write_text("".join(json.dumps({"prompt": r.prompt, **r.columns}) + "\n" for r in CHAT_ROWS))
    return path


@pytest.mark.parametrize("how", ["grpo-colocated", "grpo-decoupled", "ppo"])
def test_runs_with_trl_rewards_on_a_chat_file(tiny_model_dir, tmp_path, how) -> None:
    """`tandem grpo` / `tandem ppo` (2 steps) on a chat-format file with a solution column, scored by
    TRL's think_format_reward, accuracy_reward and get_soft_overlong_punishment (a factory, via
    kwargs), beside an old-form function (whose digit counts give a random model's groups some
    variance). Decoupled: `tandem grpo` starts a trainer and a sampler process."""
    trl_rewards()
    method, _, mode = how.partition("-")
    argv = [
        method,
        "experiment_name=trl",
        f"output_dir={tmp_path}",
        "seed=3",
        f"model.policy={tiny_model_dir}",
        f"data.dataset={chat_file(tmp_path / 'chat.jsonl')}",
        "data.num_examples=0",
        "sampling.dtype=float32",
        "sampling.max_new_tokens=8",
        f"sampling.num_generations={4 if method == 'grpo' else 1}",
        "sampling.batch_size=8",
        f"rewards={TRL_SPECS[:-1]}, {{type: function, function: 'tiny_rewards:digit_count', weight: 0.1}}]",
        f"grpo.prompts_per_step={2 if method == 'grpo' else 8}",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=2",
        "training.device=cpu",
        "training.max_steps=2",
        "training.save_steps=0",
        "training.sample_log_steps=1",
        f"pipeline.mode={mode or 'colocated'}",
        # ports of its own: another run on this machine (a benchmark) may hold the defaults
        f"pipeline.data_port={free_tcp_port()}",
        f"pipeline.sync_port={free_tcp_port()}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", *argv],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "trl"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    for row in metrics:
        for name in ("think_format_reward", "get_soft_overlong_punishment"):
            assert math.isfinite(row[f"reward_{name}"])
        accuracy = row["reward_accuracy_reward"]  # over the rows with a gold; null if the batch had none
        assert accuracy is None or 0.0 <= accuracy <= 1.0
        assert row["completions_unscored"] == 0 and math.isfinite(row["reward_mean"])
    if method == "grpo":
        assert all(row["grad_norm"] > 0 for row in metrics)  # the rewards vary within groups
        samples = [
            json.loads(line) for path in sorted((run / "samples").glob("*.jsonl")) for line in path.open()
        ]
        names = {"think_format_reward", "accuracy_reward", "get_soft_overlong_punishment", "digit_count"}
        assert samples and all(set(s["reward_info"]) == names for s in samples)
        assert all(s["columns"]["source"] == "handmade" for s in samples)  # the file's other column
        empty_gold = [s for s in samples if s["columns"]["solution"] == ""]
        assert all(s["reward_info"]["accuracy_reward"] is None for s in empty_gold)  # JSON null in the log
    assert (run / "final" / "config.json").is_file()
