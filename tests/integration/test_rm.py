"""`tandem rm` on a tiny random model: the pairwise loss falls on a fixed set, the harmless cost model's
classification term trains and is reported (skipped, with a log line, on unlabelled data), 2-rank DDP
equals 1 rank, a resumed run equals an uninterrupted one bit for bit, and the result scores GRPO
completions as a `type: model` reward; on the embedded model a short run learns a checkable preference."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from integration.test_distributed import ROOT, torchrun
from tandem.config import load_config
from tandem.data.gsm8k import load_examples
from tandem.data.preferences import encode_pair, make_preferences, pair_from_row
from tandem.models.reward import RewardScorer
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.grpo import train_grpo
from tandem.trainer.metrics import SUPERVISED_FIELDS, read_metrics
from tandem.trainer.rm import train_rm


def rm_args(model_dir, out_dir, name, *overrides) -> list[str]:
    return [
        f"experiment_name={name}",
        f"output_dir={out_dir}",
        "seed=5",
        f"model.policy={model_dir}",
        "data.num_examples=16",
        "data.num_eval_examples=5",
        "rm.max_length=96",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.learning_rate=1e-3",
        "training.device=cpu",
        "training.save_steps=0",
        *overrides,
    ]


def rm_config(model_dir, out_dir, name, *overrides):
    return load_config(None, rm_args(model_dir, out_dir, name, *overrides), method="rm")


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def bradley_terry(chosen: list[float], rejected: list[float]) -> float:
    """The loss written out: mean of log(1 + exp(-(c - r)))."""
    return sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen, rejected)) / len(chosen)


def sign_classification(scores: list[float], labels: list[bool | None]) -> tuple[float, float]:
    """The cost model's classification term written out over the labelled answers: (mean of
    log(1 + exp(-S)) for safe and log(1 + exp(S)) for unsafe answers, fraction with the label's sign)."""
    kept = [(s if safe else -s) for s, safe in zip(scores, labels) if safe is not None]
    return sum(math.log1p(math.exp(-x)) for x in kept) / len(kept), sum(x > 0 for x in kept) / len(kept)


@pytest.fixture(scope="module")
def fixed_set(tmp_path_factory):
    """16 helpful pairs in a TRL-style jsonl file, the training set and the eval set at once."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    pairs = make_preferences("helpful", 16, seed=1)
    rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, pairs


@pytest.fixture(scope="module")
def labelled_set(tmp_path_factory):
    """16 mixed pairs in a TRL-style jsonl file with safety labels, some left out: pair i keeps both
    labels, only the chosen answer's, or none (i % 3), so micro-batches hold unequal labelled shares."""
    path = tmp_path_factory.mktemp("labelled") / "labelled.jsonl"
    pairs = make_preferences("mixed", 16, seed=3)
    rows = []
    for i, p in enumerate(pairs):
        row = {"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
        if i % 3 != 2:
            row["chosen_is_safe"] = p.chosen_is_safe
        if i % 3 == 0:
            row["rejected_is_safe"] = p.rejected_is_safe
        rows.append(row)
    assert {r.get("rejected_is_safe") for r in rows} == {True, False, None}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


@pytest.fixture(scope="module")
def trained_rm(tiny_model_dir, fixed_set, tmp_path_factory):
    """12 epochs of 4 steps on the fixed set, which is also the eval set."""
    out = tmp_path_factory.mktemp("rm")
    path, _ = fixed_set
    cfg = rm_config(
        tiny_model_dir,
        out,
        "fit",
        f"data.dataset={path}",
        f"data.eval_dataset={path}",
        "data.num_eval_examples=16",
        "training.num_epochs=12",
        "training.learning_rate=3e-3",
        "training.eval_steps=16",
        "training.save_steps=24",
    )
    return train_rm(cfg), out / "fit"


def test_loop_lowers_the_pairwise_loss_on_a_fixed_set(trained_rm, fixed_set):
    final, run = trained_rm
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 49))  # 16 pairs / 4 per step x 12 epochs
    for row in rows:
        assert set(SUPERVISED_FIELDS) <= row.keys()
        assert 0.0 <= row["accuracy"] <= 1.0 and math.isfinite(row["margin_mean"])
    assert [r["step"] for r in rows if "eval_loss" in r] == [16, 32, 48]
    assert rows[-1]["epoch"] == 12.0
    first, last = rows[0]["eval_loss_initial"], rows[-1]["eval_loss"]
    assert last < 0.5 * first, (first, last)  # measured: 0.68 -> 0.12
    assert rows[-1]["eval_accuracy"] >= 0.9
    assert sum(r["loss"] for r in rows[-4:]) < sum(r["loss"] for r in rows[:4])

    # the exported folder scores the set independently to the same loss and accuracy
    _, pairs = fixed_set
    scorer = RewardScorer(str(final))
    encoded = [encode_pair(scorer.tokenizer, p, 96) for p in pairs]  # cut to rm.max_length as in training
    chosen = scorer.score_ids([e.prompt_ids + e.chosen_ids for e in encoded]).tolist()
    rejected = scorer.score_ids([e.prompt_ids + e.rejected_ids for e in encoded]).tolist()
    assert bradley_terry(chosen, rejected) == pytest.approx(last, abs=1e-4)
    assert sum(c > r for c, r in zip(chosen, rejected)) / 16 == rows[-1]["eval_accuracy"]
    info = json.loads((final / "tandem_reward.json").read_text())
    assert (
        info["task"] == "helpful"
        and info["max_length"] == 96
        and info["eval_accuracy"] == rows[-1]["eval_accuracy"]
    )
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [24, 48]

    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(final).config.num_labels == 1


def test_harmless_cost_model_trains_and_reports_the_classification_term(
    tiny_model_dir, labelled_set, tmp_path
):
    """`tandem rm --task harmless` on labelled data: rows carry the classification fields, the exported
    model's scores give them back (loss = pairwise + classification), and weight 0 (reported, not
    trained) ends elsewhere with a worse classification loss."""
    from tandem.cli import main

    path, rows = labelled_set
    common = [
        f"data.dataset={path}",
        f"data.eval_dataset={path}",
        "data.num_eval_examples=16",
        "training.max_steps=8",
        "training.num_epochs=2",
        "training.eval_steps=4",
        "training.learning_rate=3e-3",
    ]
    args = rm_args(tiny_model_dir, tmp_path, "cost", *common)
    assert main(["rm", "--task", "harmless", *args]) == 0
    off = train_rm(
        rm_config(
            tiny_model_dir, tmp_path, "plain", *common, "rm.task=harmless", "rm.classification_loss_weight=0"
        )
    )
    on_rows, off_rows = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("cost", "plain"))
    for row in on_rows + off_rows:
        assert math.isfinite(row["classification_loss"]) and 0 <= row["classification_accuracy"] <= 1
    assert {"eval_classification_loss_initial", "eval_classification_accuracy_initial"} <= on_rows[0].keys()
    assert [r["step"] for r in on_rows if "eval_classification_accuracy" in r] == [4, 8]
    # the same start (seed 5), so the first step's classification loss is the same; only "cost" trains it
    assert on_rows[0]["classification_loss"] == pytest.approx(off_rows[0]["classification_loss"], rel=1e-6)
    assert on_rows[0]["loss"] > off_rows[0]["loss"]  # pairwise + 1 x classification vs pairwise alone
    on, off_last = on_rows[-1], off_rows[-1]
    assert on["eval_classification_loss"] < off_last["eval_classification_loss"], (on, off_last)

    final = tmp_path / "cost" / "final"
    a, b = weights(final), weights(off)
    assert any(not torch.equal(a[k], b[k]) for k in a), "the classification term changes the update"
    # the exported cost model scores the set independently to the row's values
    scorer = RewardScorer(str(final))
    pairs = [pair_from_row(r, "row") for r in rows]
    encoded = [encode_pair(scorer.tokenizer, p, 96) for p in pairs]
    chosen = scorer.score_ids([e.prompt_ids + e.chosen_ids for e in encoded]).tolist()
    rejected = scorer.score_ids([e.prompt_ids + e.rejected_ids for e in encoded]).tolist()
    labels = [p.chosen_is_safe for p in pairs] + [p.rejected_is_safe for p in pairs]
    loss, accuracy = sign_classification(chosen + rejected, labels)
    assert on["eval_classification_loss"] == pytest.approx(loss, abs=1e-4)
    assert on["eval_classification_accuracy"] == accuracy
    assert on["eval_loss"] == pytest.approx(bradley_terry(chosen, rejected) + loss, abs=1e-4)
    info = json.loads((final / "tandem_reward.json").read_text())
    assert info["task"] == "harmless" and info["classification_loss_weight"] == 1.0
    assert info["eval_classification_accuracy"] == accuracy


def test_the_classification_term_is_skipped_without_labels_and_outside_task_harmless(
    tiny_model_dir, fixed_set, labelled_set, tmp_path, caplog
):
    """Task harmless on unlabelled pairs: one log line says the term is skipped, and no row has a
    classification field; task helpful on labelled pairs: no term, no fields, no line."""
    unlabelled, _ = fixed_set
    labelled, _ = labelled_set
    runs = {"unlabelled": ("rm.task=harmless", unlabelled), "helpful": ("rm.task=helpful", labelled)}
    for name, (task, path) in runs.items():
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tandem.trainer.rm"):
            final = train_rm(
                rm_config(
                    tiny_model_dir,
                    tmp_path,
                    name,
                    task,
                    f"data.dataset={path}",
                    f"data.eval_dataset={path}",
                    "training.max_steps=1",
                )
            )
        skips = [r for r in caplog.records if "classification term is skipped" in r.getMessage()]
        assert len(skips) == (1 if name == "unlabelled" else 0), name
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert rows and not [k for r in rows for k in r if "classification" in k], name
        assert json.loads((final / "tandem_reward.json").read_text())["classification_loss_weight"] is None


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_ranks_equal_one_rank(tiny_model_dir, labelled_set, tmp_path, strategy):
    """1 rank: micro 2 x accumulation 2; 2 ranks (DDP, or DeepSpeed ZeRO-3, whose forward gathers
    parameters): micro 2 x accumulation 1 each. A harmless cost model on partly labelled pairs, so the
    pairwise and the classification term both weigh each micro-batch by its share of the step's count.
    The 5 eval pairs split 3/2, so one rank pads its eval with a zero-weighted forward."""
    if strategy == "zero3":
        pytest.importorskip("deepspeed")
    dist = {
        "ddp": ["training.distributed_strategy=ddp"],
        "zero3": ["training.distributed_strategy=deepspeed", "training.zero_stage=3"],
    }[strategy]
    # adam_eps 1e-6: with the default 1e-8, Adam divides an embedding row's ~1e-9 gradient by about its
    # own size, lifting fp32 summation-order rounding to ~1e-4 in the update (measured under ZeRO-3)
    path, _ = labelled_set
    common = (
        "training.max_steps=3",
        "training.eval_steps=2",
        "training.adam_eps=1e-6",
        "rm.task=harmless",
        f"data.dataset={path}",
        f"data.eval_dataset={path}",
    )
    one = train_rm(rm_config(tiny_model_dir, tmp_path, "one", *common))
    torchrun(
        2,
        "-m",
        "tandem.cli",
        "rm",
        *rm_args(
            tiny_model_dir,
            tmp_path,
            "two",
            *common,
            "training.gradient_accumulation_steps=1",
            *dist,
        ),
    )
    a, b = weights(one), weights(tmp_path / "two" / "final")
    assert a.keys() == b.keys()
    # 3 AdamW steps at lr 1e-3 move parameters by up to 3e-3; the runs differ only in fp32 summation
    # order (measured: at most 6e-7 under DDP, 1.4e-6 under ZeRO-3)
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    assert (a["model.norm.weight"] - before["model.norm.weight"]).abs().max() > 1e-3
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=5e-6, msg=name)
    rows_a, rows_b = (
        read_metrics(tmp_path / "one" / "metrics.jsonl"),
        read_metrics(tmp_path / "two" / "metrics.jsonl"),
    )
    assert rows_b[-1]["world_size"] == 2
    for ra, rb in zip(rows_a, rows_b):
        assert "classification_loss" in ra and "eval_classification_loss_initial" in rows_a[0]
        keys = ("loss", "accuracy", "margin_mean", "eval_loss", "eval_accuracy", "eval_loss_initial")
        keys += ("classification_loss", "classification_accuracy", "eval_classification_loss")
        for key in (*keys, "eval_classification_accuracy", "eval_classification_loss_initial"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], abs=1e-5), key


def test_resume_equals_uninterrupted_bit_for_bit(tiny_model_dir, tmp_path):
    # 12 pairs / 4 per step = 3 steps an epoch: the resumed part crosses into the second epoch
    common = ("data.num_examples=12", "training.num_epochs=2", "training.save_steps=2")
    straight = train_rm(rm_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=5", *common))
    train_rm(rm_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    resumed = train_rm(
        rm_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=5",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    rows_b = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(rows_a, rows_b):
        assert (ra["loss"], ra["accuracy"], ra["grad_norm"]) == (rb["loss"], rb["accuracy"], rb["grad_norm"])
    assert rows_a[-1]["eval_loss"] == rows_b[-1]["eval_loss"]


def test_lora_reward_model_resumes_and_exports_a_merged_folder(tiny_model_dir, tmp_path):
    """LoRA: adapters and the new head train (PEFT's SEQ_CLS task); checkpoints hold both, so a resumed
    run equals an uninterrupted one; final/ is the merged seq-cls model that scores as training did."""
    pytest.importorskip("peft")
    common = (
        "model.lora.enabled=true",
        "model.lora.r=4",
        "training.learning_rate=1e-2",
        "training.save_steps=2",
    )
    straight = train_rm(rm_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4", *common))
    train_rm(rm_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    resumed = train_rm(
        rm_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=4",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (straight / "adapter" / "adapter_model.safetensors").is_file()
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(a["model.norm.weight"], base["model.norm.weight"])  # not adapted: frozen

    row = read_metrics(tmp_path / "straight" / "metrics.jsonl")[-1]
    scorer = RewardScorer(str(straight))
    pairs = make_preferences("helpful", 5, seed=5, split="test")  # the run's held-out pairs
    encoded = [encode_pair(scorer.tokenizer, p, 96) for p in pairs]
    chosen = scorer.score_ids([e.prompt_ids + e.chosen_ids for e in encoded]).tolist()
    rejected = scorer.score_ids([e.prompt_ids + e.rejected_ids for e in encoded]).tolist()
    assert bradley_terry(chosen, rejected) == pytest.approx(row["eval_loss"], abs=1e-4)


def test_trained_rm_is_a_grpo_reward(trained_rm, tiny_model_dir, tmp_path):
    """A colocated GRPO run scores each completion with the reward model (question as the user
    message, prefill + completion as the answer) and records it under its name."""
    final, _ = trained_rm
    rewards = f"[{{type: answer}}, {{type: model, path: '{final}', weight: 0.5, name: rm}}]"
    cfg = load_config(
        None,
        [
            "experiment_name=grpo_rm",
            f"output_dir={tmp_path}",
            "seed=3",
            f"model.policy={tiny_model_dir}",
            "sampling.dtype=float32",
            "sampling.max_new_tokens=8",
            "sampling.num_generations=4",
            "data.num_examples=20",
            "data.num_shots=0",
            f"rewards={rewards}",
            "grpo.prompts_per_step=2",
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "training.learning_rate=1e-3",
            "training.device=cpu",
            "training.max_steps=2",
            "training.save_steps=0",
            "training.sample_log_steps=1",
            "pipeline.mode=colocated",
        ],
    )
    train_grpo(cfg)
    rows = read_metrics(tmp_path / "grpo_rm" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["reward_rm"]) for r in rows)

    samples = [
        json.loads(x)
        for x in (tmp_path / "grpo_rm" / "samples" / "step-000001.jsonl").read_text().splitlines()
    ]
    questions = {ex.prompt_id: ex.question for ex in load_examples("synthetic", "train", 20, 3)}
    scorer = RewardScorer(str(final))
    expected = scorer.score(
        [[{"role": "user", "content": questions[s["prompt_id"]]}] for s in samples],
        [s["response"] for s in samples],
    ).tolist()
    for sample, score in zip(samples, expected):
        assert sample["reward_info"]["rm"] == pytest.approx(score, abs=1e-4)
        assert sample["reward"] == pytest.approx(sample["reward_info"]["answer"] + 0.5 * score, abs=1e-4)
    assert len(set(round(s, 4) for s in expected)) > 1, "completions should get different scores"
    assert rows[0]["reward_rm"] == pytest.approx(sum(expected) / len(expected), abs=1e-4)


@pytest.mark.slow
def test_embedded_model_learns_to_prefer_refusals_of_harmful_requests(tmp_path):
    """configs/rm_harmless.yaml cut short: 3 steps of 4 pairs on the embedded SmolLM2-135M, scored on
    12 held-out pairs (request texts and answer phrasings never seen in training). Seed 42's random
    head starts out preferring compliance, so the run has to turn the preference around; the config's
    cost-model term trains the score's sign on the labelled answers too. Measured: eval accuracy
    0.0 -> 1.0, pairwise eval loss 1.38 -> 0.10, eval margin +2.31, classification loss 1.02 -> 0.38
    and sign accuracy 0.21 -> 0.71 (39 s on 2 CPU cores shared with other jobs). The arithmetic
    preference of task helpful is not learned this fast: 24 steps of 4 arithmetic pairs left held-out
    accuracy at 0.53 (README)."""
    from tandem.cli import main

    overrides = [
        f"output_dir={tmp_path}",
        "experiment_name=harmless",
        "seed=42",
        "data.num_examples=12",
        "data.num_eval_examples=12",
        "rm.max_length=48",  # the request's end and the answer's start: enough to tell refusal from compliance
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=1",
        "training.max_steps=3",
        "training.learning_rate=3e-5",
        "training.lr_scheduler=constant",
        "training.warmup_steps=0",
        "training.save_steps=0",
        "training.device=cpu",
    ]
    assert main(["rm", str(ROOT / "configs" / "rm_harmless.yaml"), *overrides]) == 0
    rows = read_metrics(tmp_path / "harmless" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["eval_accuracy_initial"] <= 0.5
    assert rows[-1]["eval_accuracy"] >= 0.9 and rows[-1]["eval_margin_mean"] > 1.0
    first, last = rows[0], rows[-1]
    # eval_loss = pairwise + 1 x classification (the config's weight)
    pairwise_first = first["eval_loss_initial"] - first["eval_classification_loss_initial"]
    assert last["eval_loss"] - last["eval_classification_loss"] < 0.25 * pairwise_first
    assert last["eval_classification_loss"] < 0.5 * first["eval_classification_loss_initial"]
    assert last["eval_classification_accuracy"] > first["eval_classification_accuracy_initial"]
