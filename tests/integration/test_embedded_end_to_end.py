"""One short real run on the embedded SmolLM2-135M-Instruct: the CLI trains, exports, plots and evaluates."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main

pytestmark = pytest.mark.slow


def test_grpo_then_plot_then_eval_on_the_embedded_model(tmp_path, capsys):
    rc = main(
        [
            "grpo",
            "configs/grpo_tiny.yaml",
            f"output_dir={tmp_path}",
            "experiment_name=e2e",
            "training.max_steps=1",
            "grpo.prompts_per_step=2",
            "sampling.num_generations=4",
            "sampling.max_new_tokens=12",
            # 12 tokens cannot close the tags, so the seed's rewards are -2 everywhere; a reward with
            # variance gives the update a non-zero advantage to learn from
            'rewards=[{type: answer}, {type: format}, {type: function, function: "tiny_rewards:digit_count"}]',
            "training.micro_batch_size=8",
            "training.gradient_accumulation_steps=1",
            "training.gradient_checkpointing=false",
            "training.save_steps=0",
            "grpo.skip_zero_variance_groups=false",
            "pipeline.mode=colocated",
        ]
    )
    assert rc == 0
    run = tmp_path / "e2e"
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["tokens_generated"] > 0 and row["grad_norm"] > 0
    assert (run / "final" / "config.json").is_file()

    assert main(["plot", str(run)]) == 0
    assert (run / "plots" / "accuracy.png").stat().st_size > 1000

    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(run / "final"),
                "--num-examples",
                "3",
                "--max-new-tokens",
                "12",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["num_examples"] == 3 and len(result["rows"]) == 3
    assert 0.0 <= result["answer_accuracy"] <= 1.0
