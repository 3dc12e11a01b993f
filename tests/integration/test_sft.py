"""The SFT loop on a tiny random model: it lowers the loss, packing scores exactly like padding, the
update does not depend on the batch cut (micro x accumulation, 1 or 2 DDP ranks), resume is
bit-exact, and `tandem sft` writes the run record."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tandem.algorithms.sft import sft_loss
from tandem.config import load_config
from tandem.data.sft import PromptStyle, encode_example, example_from_row
from tandem.models.forward import PackedLogprobsModule
from tandem.trainer.metrics import SUPERVISED_FIELDS
from tandem.trainer.sft import collate, pack_examples, train_sft


def sft_config(model_dir, out_dir, name, *overrides):
    return load_config(
        None,
        [
            f"experiment_name={name}",
            f"output_dir={out_dir}",
            "seed=3",
            f"model.policy={model_dir}",
            "data.num_examples=16",  # two optimizer steps per epoch
            "data.num_eval_examples=8",
            "data.num_shots=0",
            "data.system_prompt=''",
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "training.learning_rate=1e-3",
            "training.num_epochs=10",
            "training.save_steps=0",
            "training.device=cpu",
            *overrides,
        ],
        method="sft",
    )


def rows_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_loop_lowers_train_and_eval_loss(tiny_model_dir, tmp_path):
    final = train_sft(
        sft_config(
            tiny_model_dir,
            tmp_path,
            "loop",
            "training.max_steps=12",
            "training.eval_steps=6",
            "training.learning_rate=1e-2",
        )
    )
    rows = rows_of(tmp_path / "loop")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(set(SUPERVISED_FIELDS) <= r.keys() and math.isfinite(r["loss"]) for r in rows)
    assert [r["epoch"] for r in rows[:3]] == [0.5, 1.0, 1.5]
    assert [r["step"] for r in rows if "eval_loss" in r] == [6, 12]
    # measured: train loss 5.76 -> 3.19, eval loss 5.76 -> 3.24 (ln 320 = 5.77: a uniform guess)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss_initial"] - 0.5
    assert rows[-1]["eval_perplexity"] == pytest.approx(math.exp(rows[-1]["eval_loss"]))
    before, after = weights(tiny_model_dir), weights(final)
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_packed_rows_score_each_example_as_if_alone(tiny_model, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    style = PromptStyle("", 0, "<think>")
    texts = ["Say hi.", "What is 12 + 30? Show the work.", "Name a fruit.", "Count to five, please.", "Go."]
    examples = [
        encode_example(
            tokenizer,
            example_from_row(tokenizer, {"prompt": t, "completion": t[::-1] * (i + 1)}, f"row {i}", style),
            max_length=512,
            completion_only_loss=i % 2 == 0,  # some masks cover the prompt too
        )
        for i, t in enumerate(texts)
    ]
    model = PackedLogprobsModule(tiny_model)
    with torch.no_grad():
        # an independent reference: each example alone through the HF model, no custom mask
        alone = []
        for e in examples:
            logits = tiny_model(torch.tensor([e.input_ids])).logits[0, :-1].float()
            alone.append(
                torch.log_softmax(logits, -1).gather(1, torch.tensor(e.input_ids[1:])[:, None])[:, 0]
            )
        # three examples in one row, two in another: block-diagonal attention, positions restart
        rows = [[(e.input_ids, 1) for e in examples[:3]], [(e.input_ids, 1) for e in examples[3:]]]
        packed = model(pack_examples(rows))
        for k, e in enumerate(examples):
            torch.testing.assert_close(packed[k, : len(e.input_ids) - 1], alone[k], rtol=0, atol=1e-5)
        losses = {}
        for packing in (False, True):
            inputs, loss_mask = collate(examples, 0, packing=packing, row_length=128)
            losses[packing] = sft_loss(model(inputs), loss_mask)[0].item()
        assert inputs.input_ids.shape[0] < len(examples)  # packing did share rows
    reference = sum(-(a * torch.tensor(e.loss_mask[1:])).sum() for a, e in zip(alone, examples))
    reference = (reference / sum(e.num_targets for e in examples)).item()
    assert losses[True] == pytest.approx(losses[False], abs=1e-6)
    assert losses[False] == pytest.approx(reference, abs=1e-6)


@pytest.fixture(scope="module")
def micro4(tiny_model_dir, tmp_path_factory):
    """3 steps of micro-batch 4 x accumulation 1 (padding): the reference of the invariance tests."""
    out = tmp_path_factory.mktemp("sft-ref")
    cut = ("training.micro_batch_size=4", "training.gradient_accumulation_steps=1")
    return weights(train_sft(sft_config(tiny_model_dir, out, "micro4", "training.max_steps=3", *cut)))


def assert_same(params: dict, ref: dict, what: str) -> None:
    # 3 AdamW steps at lr 1e-3: the runs differ only in fp32 summation order (measured < 1e-6)
    for name, value in ref.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=2e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize(
    "cut",
    [
        ("training.micro_batch_size=1", "training.gradient_accumulation_steps=4"),
        ("training.micro_batch_size=2", "training.gradient_accumulation_steps=2", "sft.packing=true"),
    ],
    ids=["micro1x4", "micro2x2-packed"],
)
def test_update_does_not_depend_on_the_batch_cut(micro4, tiny_model_dir, tmp_path, cut):
    final = train_sft(sft_config(tiny_model_dir, tmp_path, "cut", "training.max_steps=3", *cut))
    assert_same(weights(final), micro4, " ".join(cut))


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["training.distributed_strategy=ddp"],
        ["training.distributed_strategy=deepspeed", "training.zero_stage=3"],
    ],
    ids=["ddp", "zero3"],
)
def test_two_ranks_equal_one_rank(micro4, tiny_model_dir, tmp_path, strategy, monkeypatch):
    """`tandem sft` under torchrun, with a checkpoint on the way. 5 eval examples: one rank has fewer
    and must still run as many forwards (DDP syncs buffers, ZeRO-3 gathers parameters in forward)."""
    from integration.test_distributed import torchrun

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    overrides = [
        "experiment_name=two",
        f"output_dir={tmp_path}",
        "seed=3",
        f"model.policy={tiny_model_dir}",
        "data.num_examples=16",
        "data.num_eval_examples=5",
        "data.num_shots=0",
        "data.system_prompt=''",
        "training.micro_batch_size=2",  # 2 x 1 x 2 ranks = the reference's 4 x 1
        "training.gradient_accumulation_steps=1",
        "training.learning_rate=1e-3",
        "training.max_steps=3",
        "training.save_steps=2",
        "training.device=cpu",
        *strategy,
    ]
    torchrun(2, "-m", "tandem.cli", "sft", *overrides)
    assert_same(weights(tmp_path / "two" / "final"), micro4, " ".join(strategy))
    rows = rows_of(tmp_path / "two")
    assert rows[-1]["world_size"] == 2 and "eval_loss" in rows[-1]


def test_resume_equals_uninterrupted_bit_for_bit(tiny_model_dir, tmp_path):
    # LoRA with dropout: the resumed run must also restore the RNG that drops activations
    lora = ("model.lora.enabled=true", "model.lora.r=4", "model.lora.dropout=0.1")
    straight = train_sft(sft_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4", *lora))
    common = ("training.save_steps=2", *lora)
    train_sft(sft_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    resumed = train_sft(
        sft_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=4",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    rows_a, rows_b = rows_of(tmp_path / "straight"), rows_of(tmp_path / "resumed")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]  # steps 3-4 are the second, reshuffled epoch
    assert [(r["loss"], r["grad_norm"]) for r in rows_a] == [(r["loss"], r["grad_norm"]) for r in rows_b]


def test_loss_on_every_token_and_fewer_examples_than_a_batch(tiny_model_dir, tmp_path):
    train_sft(
        sft_config(tiny_model_dir, tmp_path, "all", "training.max_steps=1", "sft.completion_only_loss=false")
    )
    (row,) = rows_of(tmp_path / "all")
    assert row["tokens"] == row["input_tokens"] - 8  # every token but each example's first
    # 4 examples, batches of 8: the last (here the only) batch of an epoch is kept short
    train_sft(sft_config(tiny_model_dir, tmp_path, "few", "data.num_examples=4", "training.max_steps=2"))
    assert [r["epoch"] for r in rows_of(tmp_path / "few")] == [1.0, 2.0]


def test_cli_writes_final_model_metrics_and_config(tiny_model_dir, tmp_path):
    """`tandem sft` with LoRA and bf16 autocast: final/ holds the merged model and final/adapter."""
    from transformers import AutoModelForCausalLM

    from tandem.cli import main

    overrides = [
        f"output_dir={tmp_path}",
        "experiment_name=cli",
        f"model.policy={tiny_model_dir}",
        "model.lora.enabled=true",
        "model.lora.r=4",
        "data.num_examples=8",
        "data.num_eval_examples=4",
        "data.num_shots=0",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=2",
        "training.max_steps=2",
        "training.mixed_precision=bf16",
        "training.device=cpu",
    ]
    assert main(["sft", *overrides]) == 0
    run = tmp_path / "cli"
    rows = rows_of(run)
    assert [r["step"] for r in rows] == [1] and "eval_loss" in rows[0]  # 8 examples: one step per epoch
    assert load_config(run / "config.yaml").method == "sft"
    assert (run / "final" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(run / "final")
    assert not any("lora" in name for name, _ in merged.named_parameters())
