"""`tandem eval`: a progress bar, the generation settings it used and where each came from, and
named failures (a misspelt model, gsm8k without `datasets`) before any model loads."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from tandem.cli import main
from tandem.config import ConfigError, RewardSpec, dump_config, load_config
from tandem.data.gsm8k import load_examples
from tandem.data.prompts import PromptStyle
from tandem.evaluate import _generate, evaluate
from tandem.models.loading import load_causal_lm, load_tokenizer
from tandem.rewards.registry import RewardSet
from tandem.sampler.rollout import Rollout

GSM8K_TRAIN = Path("/work/shared/data/gsm8k/train.jsonl")


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    """A hub that refuses at once: nothing here may wait on the network."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture
def questions(tmp_path) -> Path:
    path = tmp_path / "questions.jsonl"
    rows = [
        {"question": f"Tom has {n} apples and buys 2 more. How many?", "answer": f"#### {n + 2}"}
        for n in range(5)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_flags_then_defaults_are_reported_with_a_progress_bar(tiny_model_dir, questions, caplog, capsys):
    caplog.set_level(logging.INFO, logger="tandem.evaluate")
    result = evaluate(
        model=str(tiny_model_dir),
        dataset=str(questions),
        num_examples=3,
        max_new_tokens=4,
        batch_size=2,
        device="cpu",
    )
    assert result["settings"]["max_new_tokens"] == {"value": 4, "from": "flag"}
    assert result["settings"]["num_shots"] == {"value": 1, "from": "default"}
    assert result["settings"]["prefill"] == {"value": "<think>", "from": "default"}
    assert len(result["rows"]) == 3 and all(r["num_tokens"] <= 4 for r in result["rows"])
    assert "max_new_tokens=4 (flag)" in caplog.text and "num_shots=1 (default)" in caplog.text
    err = capsys.readouterr().err
    assert "eval" in err and "3/3" in err  # tqdm's bar, on stderr: stdout stays the JSON summary


def test_settings_of_a_run_come_from_its_config_yaml(tiny_model_dir, questions, tmp_path, caplog):
    run = tmp_path / "runs" / "sft_tiny"
    shutil.copytree(tiny_model_dir, run / "final")
    cfg = load_config(None, ["sampling.max_new_tokens=3", "data.num_shots=0"])
    dump_config(cfg, run / "config.yaml")
    (run / "metrics.jsonl").write_text("")
    caplog.set_level(logging.INFO, logger="tandem.evaluate")
    result = evaluate(model=str(run / "final"), dataset=str(questions), num_examples=2, prefill="<think> ")
    where = str(run / "config.yaml")
    assert result["settings"]["max_new_tokens"] == {"value": 3, "from": where}
    assert result["settings"]["num_shots"] == {"value": 0, "from": where}
    assert result["settings"]["prefill"] == {"value": "<think> ", "from": "flag"}
    assert all(r["num_tokens"] <= 3 for r in result["rows"])
    assert f"max_new_tokens=3 ({where})" in caplog.text
    json.dumps(result)  # the summary and --output stay plain JSON


def test_batches_under_the_progress_bar_generate_what_one_call_does(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    policy = load_causal_lm(str(tiny_model_dir), trainable=False)
    examples = load_examples("synthetic", "test", 5, seed=0)

    def rollout() -> Rollout:
        return Rollout(
            policy=policy,
            reference=None,
            tokenizer=tokenizer,
            rewards=RewardSet.from_specs([RewardSpec("answer")]),
            question_style=PromptStyle("Solve it.", (), "<think>"),
            row_style=PromptStyle(),
            num_generations=2,
            max_new_tokens=6,
            temperature=1.0,  # sampled: the random stream must be consumed in the same order
            batch_size=4,
            scale_rewards="none",
            generator=torch.Generator().manual_seed(7),
        )

    batched = _generate(rollout(), examples, batch_size=4, num_samples=2, progress=False)
    whole = rollout().run(examples, policy_version=0)
    assert [c.generated_token_ids for g in batched for c in g.completions] == [
        c.generated_token_ids for g in whole for c in g.completions
    ]


def test_a_misspelt_model_fails_at_once_with_the_real_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    final = tmp_path / "runs" / "sft_tiny" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    with pytest.raises(
        ConfigError, match=r"sft_tny/final does not exist \(did you mean runs/sft_tiny/final\?\)"
    ):
        evaluate(model="sft_tny/final")
    assert main(["eval", "--model", "sft_tny/final"]) == 2
    assert "did you mean runs/sft_tiny/final?" in capsys.readouterr().err


def test_gsm8k_without_datasets_names_the_hub_extra(tiny_model_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a)
    )
    with pytest.raises(ConfigError) as err:
        evaluate(model=str(tiny_model_dir), dataset="gsm8k")
    assert "pip install 'tandem[hub]'" in str(err.value) and "--dataset path/to/data.jsonl" in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_names_the_device_flag(tiny_model_dir):
    with pytest.raises(ConfigError, match="`--device` is cuda but torch.cuda.is_available"):
        evaluate(model=str(tiny_model_dir), device="cuda")


@pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason=f"{GSM8K_TRAIN} not present")
def test_a_local_gsm8k_copy_is_evaluated(tiny_model_dir):
    result = evaluate(
        model=str(tiny_model_dir), dataset=str(GSM8K_TRAIN), num_examples=2, max_new_tokens=2, device="cpu"
    )
    assert result["num_examples"] == 2
    assert result["rows"][0]["answer"] == "72"  # Natalia's clips, the split's first row
