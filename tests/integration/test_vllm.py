"""`sampling.backend: vllm` on vLLM's CPU build: the engine's groups and log-probs, weights loaded
into the running engine (full and LoRA), and decoupled GRPO runs whose sampler generates with it.

The engine checks run once, in a process of their own (tests/vllm_driver.py): vLLM's in-process
engine pins the threads of the process that starts it. Skipped where vLLM is not installed, unless
TANDEM_REQUIRE_VLLM=1 (`make test` sets it where `make setup` installed vLLM's CPU build).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from integration.test_pipeline import REPO, Run, env, finish
from tiny_models import make_tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# measured on this CPU in fp32 (tests/vllm_driver.py): at most 1e-6 apart; bounds with room
FP32_LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """The tiny random Llama with 32-wide heads: vLLM's CPU attention has no kernel below that."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-vllm"), hidden_size=64, num_heads=2)


@pytest.fixture(scope="module")
def engine_checks(vllm_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-driver") / "checks.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "vllm_driver.py"), str(vllm_model_dir), str(out)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_engine_samples_groups_with_the_log_probs_of_their_distribution(engine_checks):
    c = engine_checks
    assert len(c["lengths"]) == 3 * 4 and all(0 < n <= 12 for n in c["lengths"])
    # finished means an eos was sampled, and then it is the last token kept
    assert c["finished"] == c["ends_in_eos"]
    assert all(n == 12 for n, f in zip(c["lengths"], c["finished"]) if not f)
    assert c["distinct_in_group"] == [4, 4, 4]
    # temperature 0.7: log_softmax(logits / T) of the drawn tokens, as the trainer computes them
    assert c["generation_logprob_max_diff"] < FP32_LOGPROB_TOL
    assert c["same_seed_same_tokens"] and c["other_seed_other_tokens"]


def test_a_new_version_goes_into_the_running_engine(engine_checks):
    c = engine_checks
    assert c["initial_logprob_max_diff"] < FP32_LOGPROB_TOL
    assert c["reload_changed_by"] > 0.05  # the engine's log-probs of fixed tokens moved ...
    assert c["reload_logprob_max_diff"] < FP32_LOGPROB_TOL  # ... to the new weights' (tied head too)
    assert c["load_seconds"] > 0


def test_a_lora_policy_goes_in_merged(engine_checks):
    c = engine_checks
    assert c["lora_changed_by"] > 0.05
    assert c["lora_logprob_max_diff"] < FP32_LOGPROB_TOL


def test_agent_episodes_continue_on_the_engine_with_the_weights_log_probs(engine_checks):
    """Each episode's first turn calls a tool; the engine writes the second turn from the episode's
    own tokens (prompt, call, tool message): those tokens' log-probs are the weights' over the whole
    episode, and the tool message's are 0 (sampler/episodes.py on sampling.backend=vllm)."""
    c = engine_checks
    assert c["episode_turns"] == [2] * 6 and c["episode_tool_calls"] == [1] * 6
    assert all(n > 0 for n in c["episode_second_turn_tokens"])
    assert c["episode_logprob_max_diff"] < FP32_LOGPROB_TOL
    assert c["episode_tool_logprobs_zero"]


def vllm_run(tmp_path, model_dir, name: str, *overrides: str) -> Run:
    return Run(tmp_path, model_dir, name, "sampling.backend=vllm", *overrides)


ON_POLICY = (
    "pipeline.max_staleness=0",
    "pipeline.sync_every=1",
    "training.micro_batch_size=8",
    "training.gradient_accumulation_steps=1",
)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-adapter"])
def test_grpo_with_the_vllm_sampler_is_on_policy_at_every_version(tmp_path, vllm_model_dir, lora):
    """Strictly on-policy (max_staleness 0): every step trains on groups the engine made with the
    weights the trainer holds, so the trainer's log-probs equal the sampler's. A stale engine
    (a version not loaded, or loaded into a copy) would show as ratio_abs_dev ~ lr-sized from step 2."""
    extra = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.sync=adapter"] if lora else []
    run = vllm_run(tmp_path, vllm_model_dir, "vllm", *ON_POLICY, "training.max_steps=4", *extra)
    try:
        trainer, sampler = run.trainer(), run.sampler()
        finish(run, trainer, {"s0": sampler})
    finally:
        run.kill_all()
    rows = run.rows()
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    assert all(r["ratio_abs_dev"] < FP32_LOGPROB_TOL for r in rows), [r["ratio_abs_dev"] for r in rows]
    assert rows[-1]["grad_norm"] > 0
    made = run.sampler_rows()
    assert [r["policy_version"] for r in made][:4] == [0, 1, 2, 3]  # (a last one may go unused)
    assert all(r["time_weights_engine"] > 0 for r in made)  # each version went into the engine
    # every batch's first group scored again by the sampler's copy of the same weights
    assert all(r["engine_logprob_tokens"] > 0 for r in made)
    assert all(0 <= r["engine_logprob_diff"] < FP32_LOGPROB_TOL for r in made), made
    assert all(abs(r["engine_logprob_kl"]) < 1e-8 for r in made)
    # on-policy: the trainer compares every step too, and finds the same tiny gap
    assert all(r["sampler_logprob_tokens"] > 0 and r["sampler_logprob_diff"] < FP32_LOGPROB_TOL for r in rows)
    assert "vLLM engine" in run.log("s0")


def test_a_restarted_vllm_sampler_rejoins_with_the_latest_weights(tmp_path, vllm_model_dir):
    run = vllm_run(tmp_path, vllm_model_dir, "vllm_restart", "training.max_steps=12")
    try:
        trainer, first = run.trainer(), run.sampler()
        run.wait_for(lambda: len(run.rows()) >= 3, "three trainer steps")
        first.kill()
        first.wait()
        killed_at = max(r["policy_version"] for r in run.sampler_rows())
        seen_before = len(run.sampler_rows())
        time.sleep(1.0)
        second = run.sampler()
        finish(run, trainer, {"s0": second})
    finally:
        run.kill_all()
    rejoined = run.sampler_rows()[seen_before:]
    assert rejoined and rejoined[0]["policy_version"] >= killed_at
    assert rejoined[0]["time_weights_engine"] > 0
    assert [r["step"] for r in run.rows()] == list(range(1, 13))


@pytest.mark.parametrize("config", ["grpo_tiny", "agent_calculator_tiny"])
def test_the_embedded_default_runs_with_the_vllm_sampler(tmp_path, config):
    """`tandem grpo configs/grpo_tiny.yaml sampling.backend=vllm`, cut short: the launcher's
    trainer and vLLM sampler on the real SmolLM2-135M-Instruct; and the calculator agent config,
    whose episodes (the real model calls the tool) run turn by turn on the engine, with a TRL
    environment class beside the tool."""
    agent = config.startswith("agent")
    cmd = [
        sys.executable,
        "-m",
        "tandem.cli",
        "grpo",
        f"configs/{config}.yaml",
        "sampling.backend=vllm",
        f"output_dir={tmp_path}",
        "experiment_name=e2e_vllm",
        "eval.steps=0",
        # a cooler policy calls the tool more often (greedy: most episodes)
        # and a TRL environment_factory class beside the tool (its get_reward is a reward)
        *(
            ["sampling.temperature=0.3", "agent.max_turns=2", "agent.environment=tiny_agent:Notebook"]
            if agent
            else []
        ),
        "training.max_steps=2",
        "grpo.prompts_per_step=2",
        "sampling.num_generations=4",
        f"sampling.max_new_tokens={64 if agent else 16}",  # a call takes some 40 tokens
        "training.micro_batch_size=8",
        "training.gradient_accumulation_steps=1",
        "training.save_steps=0",
        "grpo.skip_zero_variance_groups=false",
        'rewards=[{type: answer}, {type: format}, {type: function, function: "tiny_rewards:digit_count"}]',
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "e2e_vllm"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["tokens_generated"] > 0
    made = [json.loads(x) for x in (run / "samplers" / "s0.jsonl").read_text().splitlines()]
    assert made and all(r["time_weights_engine"] is not None for r in made)
    assert (run / "final" / "model.safetensors").is_file()
    if agent:
        assert sum(r["tool_calls_mean"] for r in rows) > 0 and max(r["turns_mean"] for r in rows) > 1
        assert all("reward_Notebook" in r for r in rows)
        # the engine's log-probs against the sampler's copy of the weights, on policy tokens only
        assert all(r["engine_logprob_diff"] < 1e-3 for r in made if r["engine_logprob_tokens"]), made
