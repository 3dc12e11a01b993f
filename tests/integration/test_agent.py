"""Agent runs through `tandem grpo` on a tiny random model: a TRL tool function and a TRL
environment class load unchanged, episodes reach the rewards as messages (and environments), and
the rows carry the episode fields, colocated and decoupled. (A random model does not call tools:
the multi-turn loop itself is tested with a scripted engine in tests/unit/test_episodes.py.)"""

from __future__ import annotations

import json

import pytest

from tandem.config import ConfigError, load_config

AGENT = [
    "agent.tools=['tiny_agent:add']",
    "agent.environment=tiny_agent:Notebook",
    "agent.max_turns=3",
    "rewards=[{type: function, function: 'tiny_agent:turns'}, {type: function, function: 'tiny_agent:notes_written'}]",
]


@pytest.mark.parametrize("mode", ["colocated", "decoupled"])
def test_an_agent_run_trains_and_records_its_episodes(make_run, mode):
    evals = ["eval.steps=2", "eval.num_examples=2", "eval.split=train"]
    run = make_run(f"agent_{mode}", f"pipeline.mode={mode}", "training.max_steps=2", *AGENT, *evals)
    proc = run.start("grpo", log="grpo")
    assert run.wait(proc, "grpo") == 0, run.log("grpo")[-3000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["turns_mean"] >= 1 and r["tool_calls_mean"] >= 0 and r["episode_tokens_mean"] > 0
        assert r["episodes_truncated"] >= 0 and r["tool_errors"] >= 0
        assert r["reward_turns"] <= -1  # the messages reached the reward: at least one assistant turn
        assert r["reward_notes_written"] == 0 and r["reward_Notebook"] == 0  # nothing written: no calls
    # the held-out evaluation runs episodes too (before training; decoupled: made by the sampler)
    evaluated = [r for r in rows if "eval_tool_calls_mean_initial" in r or "eval_tool_calls_mean" in r]
    assert evaluated, [sorted(k for k in r if k.startswith("eval")) for r in rows]
    config = (run.dir / "config.yaml").read_text()
    assert "tiny_agent:add" in config and "Notebook" in config
    if mode == "colocated":  # `tandem eval` of the run's model runs episodes with the run's tools too
        from tandem.evaluate import evaluate

        result = evaluate(model=str(run.dir / "final"), num_examples=2, progress=False)
        assert result["turns_mean"] >= 1 and result["tool_calls_mean"] >= 0 and result["num_examples"] == 2
    samples = sorted((run.dir / "samples").glob("*.jsonl"))
    if samples:
        first = json.loads(samples[0].read_text().splitlines()[0])
        assert "[assistant]" in json.dumps(first)  # sample logs show the conversation


def test_bad_agent_settings_are_refused_with_the_key(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="multi-turn episodes train with GRPO only"):
        load_config(None, ["method=ppo", "agent.tools=['tiny_agent:add']"])
    from tandem.models.loading import load_tokenizer
    from tandem.sampler.rollout import build_agent

    cfg = load_config(None, [f"model.policy={tiny_model_dir}", "agent.tools=['tiny_agent:nope']"])
    with pytest.raises(ConfigError, match="`agent`: agent.tools\\[0\\] 'tiny_agent:nope'"):
        build_agent(cfg, load_tokenizer(str(tiny_model_dir)), None)
