"""GRPO on a user's own prompt file (issue: any task): chat prompts with a `solution` column and other
columns, through a real colocated run on a tiny random model; the model is prompted with exactly the
row's chat (through the chat template), the columns reach the sample logs, and a bad row stops the
run before any model loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_pipeline import REPO, env

from tandem.config import ConfigError, load_config
from tandem.models.loading import load_tokenizer
from tandem.preflight import check_run
from tandem.trainer.grpo import train_grpo
from tandem.transport.channel import free_tcp_port

QUESTIONS = [
    ("What is 2 + 3?", "5"),
    ("What is 4 * 4?", "16"),
    ("What is 9 - 7?", "2"),
    ("What is 8 / 2?", "4"),
]


def chat_file(path, system: str | None = "Reply with a number."):
    rows = []
    for i, (question, solution) in enumerate(QUESTIONS):
        prompt = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}
        ]
        rows.append({"prompt": prompt, "solution": solution, "level": i % 2, "source": "hand"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def overrides(model_dir, out_dir, data, name) -> list[str]:
    """A tiny GRPO run on `data` (2 steps of 2 prompts x 4 completions), colocated."""
    return [
        f"experiment_name={name}",
        f"output_dir={out_dir}",
        "seed=3",
        f"model.policy={model_dir}",
        f"data.dataset={data}",
        "data.num_examples=0",
        "sampling.max_new_tokens=6",
        "sampling.num_generations=4",
        "sampling.batch_size=8",
        "rewards=[{type: answer}, {type: format}]",
        "grpo.prompts_per_step=2",
        "grpo.skip_zero_variance_groups=false",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=2",
        "training.max_steps=2",
        "training.save_steps=0",
        "training.sample_log_steps=1",
        "training.device=cpu",
        "pipeline.mode=colocated",
    ]


def config(model_dir, out_dir, data, name, *more):
    return load_config(None, [*overrides(model_dir, out_dir, data, name), *more])


def test_grpo_trains_on_a_chat_file_and_logs_its_columns(tiny_model_dir, tmp_path):
    data = chat_file(tmp_path / "tasks.jsonl")
    cfg = config(tiny_model_dir, tmp_path, data, "chat")
    check_run(cfg, "grpo")
    train_grpo(cfg)
    run = tmp_path / "chat"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["grad_norm"] > 0
    samples = [
        json.loads(x) for f in sorted((run / "samples").glob("*.jsonl")) for x in f.read_text().splitlines()
    ]
    assert samples and all(s["columns"]["source"] == "hand" and "solution" in s["columns"] for s in samples)
    by_solution = {q: s for q, s in QUESTIONS}
    assert all(s["answer"] == s["columns"]["solution"] for s in samples)
    assert {s["answer"] for s in samples} <= set(by_solution.values())


def test_the_row_prompt_is_rendered_as_is_through_the_chat_template(tiny_model_dir, tmp_path):
    from tandem.data.prompt_sets import load_examples
    from tandem.sampler.rollout import build_rollout

    data = chat_file(tmp_path / "tasks.jsonl")
    cfg = config(tiny_model_dir, tmp_path, data, "render", "grpo.kl_coef=0")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rollout = build_rollout(cfg, None, tokenizer, None, "cpu")
    example = load_examples(str(data), "train", 0, seed=0)[0]
    text, ids = rollout.prompt(example)
    assert text == tokenizer.apply_chat_template(example.prompt, tokenize=False, add_generation_prompt=True)
    assert rollout.reward_prompt(example) == example.prompt
    # settings named in the config do apply: a system prompt where the row has none, and a prefill
    data = chat_file(tmp_path / "plain.jsonl", system=None)
    cfg = config(
        tiny_model_dir,
        tmp_path,
        data,
        "render2",
        "grpo.kl_coef=0",
        "data.system_prompt='Be brief.'",
        "data.prefill='A:'",
    )
    rollout = build_rollout(cfg, None, tokenizer, None, "cpu")
    example = load_examples(str(data), "train", 0, seed=0)[0]
    text, _ = rollout.prompt(example)
    messages = [{"role": "system", "content": "Be brief."}, *example.prompt]
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "A:"


def test_a_bad_row_stops_the_run_before_any_model_loads(tiny_model_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "solution": "1"}\n{"prompt": ["not a message"], "solution": "2"}\n')
    cfg = config(tiny_model_dir, tmp_path, data, "bad")
    with pytest.raises(
        ConfigError, match=r"bad\.jsonl:2: column `prompt`, message 0: needs a string `content`"
    ):
        check_run(cfg, "grpo", probe=False)


# --------------------------------------------------------------------------- evaluation during training


def eval_config(model_dir, out_dir, data, name, *overrides):
    return config(
        model_dir,
        out_dir,
        data,
        name,
        "training.max_steps=3",
        "eval.steps=2",
        f"eval.dataset={data}",
        "eval.split=train",
        "eval.num_examples=3",
        *overrides,
    )


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_colocated_eval_rows_on_schedule_and_training_unchanged(tiny_model_dir, tmp_path):
    """eval.steps=2 over 3 steps: version 0 before training (row 1, eval_*_initial), version 2 in row
    2; the greedy figures equal a direct evaluation of the saved weights (answer reward on the solution
    column); and evaluating does not change what the run trains on (its own random stream)."""
    from safetensors.torch import load_file

    data = chat_file(tmp_path / "tasks.jsonl")
    train_grpo(eval_config(tiny_model_dir, tmp_path, data, "with_eval"))
    train_grpo(eval_config(tiny_model_dir, tmp_path, data, "no_eval", "eval.steps=0"))
    with_eval, without = rows(tmp_path / "with_eval"), rows(tmp_path / "no_eval")
    assert [r.get("eval_policy_version") for r in with_eval] == [None, 2, None]
    assert with_eval[0]["eval_policy_version_initial"] == 0 and with_eval[0]["eval_num_examples_initial"] == 3
    for row in (with_eval[0], with_eval[1]):
        suffix = "_initial" if row is with_eval[0] else ""
        accuracy = row[f"eval_accuracy{suffix}"]
        assert accuracy is None or 0 <= accuracy <= 1  # the answer reward: null where no gold parses
        assert row[f"eval_pass_at_k{suffix}"] == accuracy  # one greedy sample per prompt
        assert row[f"eval_completion_length{suffix}"] > 0 and row[f"eval_seconds{suffix}"] > 0
    assert not any(k.startswith("eval_") for k in without[0])
    for a, b in zip(with_eval, without, strict=True):
        assert (a["loss"], a["reward_mean"], a["grad_norm"]) == (b["loss"], b["reward_mean"], b["grad_norm"])
    a, b = (
        load_file(str(tmp_path / "with_eval/final/model.safetensors")),
        load_file(str(tmp_path / "no_eval/final/model.safetensors")),
    )
    assert all(a[k].equal(b[k]) for k in a)


def test_decoupled_eval_is_made_by_the_sampler_and_logged_by_the_trainer(tiny_model_dir, tmp_path):
    """`tandem grpo` decoupled: sampler s0 evaluates the versions it loads (0, 2, ...) and the trainer
    logs them in its rows, naming the version."""
    data = chat_file(tmp_path / "tasks.jsonl")
    argv = [
        *overrides(tiny_model_dir, tmp_path, data, "dec"),
        "training.max_steps=4",
        "pipeline.mode=decoupled",
        "pipeline.max_staleness=0",
        f"pipeline.data_port={free_tcp_port()}",  # not the defaults: another run may hold them
        f"pipeline.sync_port={free_tcp_port()}",
        "eval.steps=2",
        f"eval.dataset={data}",
        "eval.split=train",
        "eval.num_examples=2",
        "eval.num_samples=2",
        "eval.temperature=1.0",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "grpo", *argv],
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logged = rows(tmp_path / "dec")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    initial = [r for r in logged if "eval_policy_version_initial" in r]
    assert len(initial) == 1 and initial[0]["eval_num_samples_initial"] == 2
    versions = [r["eval_policy_version"] for r in logged if "eval_policy_version" in r]
    assert versions and all(v % 2 == 0 and v > 0 for v in versions)  # version 4 may come after the end
    row = next(r for r in logged if "eval_policy_version" in r)
    assert row["eval_num_examples"] == 2 and row["eval_num_samples"] == 2
