"""The colocated GRPO loop on a tiny random model: it trains, records, checkpoints and resumes exactly."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tandem.config import load_config
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.grpo import train_grpo
from tandem.trainer.metrics import REQUIRED_FIELDS


def tiny_overrides(model_dir, out_dir, name, *overrides) -> list[str]:
    """key=value settings of a short colocated run of the tiny model (the CLI's arguments too)."""
    return [
        f"experiment_name={name}",
        f"output_dir={out_dir}",
        "seed=3",
        f"model.policy={model_dir}",
        "sampling.dtype=float32",
        "sampling.max_new_tokens=8",
        "sampling.num_generations=4",
        "sampling.batch_size=8",
        "data.num_examples=20",
        "data.num_shots=0",
        "rewards=[{type: answer}, {type: format}, {type: function, function: 'tiny_rewards:digit_count'}]",
        "grpo.prompts_per_step=2",
        "grpo.kl_coef=0.04",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=4",
        "training.learning_rate=1e-3",
        "training.device=cpu",
        "training.sample_log_steps=1",
        "pipeline.mode=colocated",
        *overrides,
    ]


def tiny_config(model_dir, out_dir, name, *overrides):
    return load_config(None, tiny_overrides(model_dir, out_dir, name, *overrides))


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_three_steps_train_and_write_a_well_formed_record(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path, "loop", "training.max_steps=3", "training.save_steps=2")
    final = train_grpo(cfg)
    run = tmp_path / "loop"

    before, after = weights(tiny_model_dir), weights(final)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, "GRPO steps should move most parameter tensors"

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert set(REQUIRED_FIELDS) <= row.keys()
        for key in ("loss", "kl", "grad_norm", "lr", "reward_mean", "step_seconds"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), key
        assert 0.0 <= row["format_accuracy"] <= 1.0 and 0.0 <= row["answer_accuracy"] <= 1.0
        assert row["tokens_generated"] > 0 and row["policy_version"] == row["step"] - 1
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6), "the first step samples from the reference itself"
    assert (run / "config.yaml").is_file() and list((run / "samples").glob("step-*.jsonl"))
    # the on-policy ratio check: one update per batch means the first optimizer step sees ratio 1
    assert rows[0]["ratio_abs_dev"] < 1e-4

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(final)
    assert reloaded.config.vocab_size == after["model.embed_tokens.weight"].shape[0]
    assert [s for s, _ in ckpt.list_checkpoints(run / "checkpoints")] == [2, 3]


AGENT = (
    "agent.tools=['tiny_agent:add']",
    "agent.environment=tiny_agent:Notebook",
    "agent.max_turns=2",
    "sampling.max_new_tokens=64",  # room for the scripted call (62 tokens of the tiny tokenizer)
)


def force_tool_calls(monkeypatch, tokenizer_dir) -> None:
    """A random tiny model never writes a tool call: in each group's first turn, its first episode
    is replaced by a call of `add` (scripted tokens, log-prob -1 each); the rest is sampled."""
    from transformers import AutoTokenizer

    from tandem.sampler import rollout as rollout_module

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    call = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    real = rollout_module.generate_groups

    def generate(model, prompts, *, num_generations, max_new_tokens, **kw):
        gen = real(model, prompts, num_generations=num_generations, max_new_tokens=max_new_tokens, **kw)
        if num_generations > 1:
            assert len(call) <= max_new_tokens
            for i in range(0, len(gen.token_ids), num_generations):
                gen.token_ids[i], gen.logprobs[i], gen.finished[i] = list(call), [-1.0] * len(call), True
        return gen

    monkeypatch.setattr(rollout_module, "generate_groups", generate)


@pytest.mark.parametrize("variant", ["plain", "agent"])
def test_resume_equals_uninterrupted_bit_for_bit(tiny_model_dir, tmp_path, variant, monkeypatch):
    """Also for agent episodes (tool calls and an environment per episode, tool tokens masked):
    episodes hold nothing across batches, so a resumed agent run is the uninterrupted one."""
    extra = AGENT if variant == "agent" else ()
    if variant == "agent":
        force_tool_calls(monkeypatch, tiny_model_dir)
    straight = train_grpo(tiny_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4", *extra))

    common = ("training.save_steps=2", *extra)
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    # what a trainer killed inside its next save leaves: the restart removes it and resumes from step-2
    leftover = tmp_path / "resumed" / "checkpoints" / ".tmp-step-4-k1ll3d"
    (leftover / "model").mkdir(parents=True)
    (leftover / "model" / "model.safetensors").write_bytes(b"half")
    resumed = train_grpo(
        tiny_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=4",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )

    assert not leftover.exists()
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    rows_a = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    if variant == "agent":
        assert all(r["tool_calls_mean"] > 0 and r["turns_mean"] > 1 for r in rows_a)
    for ra, rb in zip(rows_a, rows_b):
        assert (ra["loss"], ra["reward_mean"], ra["grad_norm"]) == (
            rb["loss"],
            rb["reward_mean"],
            rb["grad_norm"],
        )


def test_several_updates_per_batch_and_mixed_precision(tiny_model_dir, tmp_path):
    """num_iterations=2 and two optimizer batches per rollout: 4 steps from one batch of samples;
    the later updates are off-policy (ratio != 1, staleness counted); bf16 autocast and the
    TensorBoard writer run along."""
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "iters",
        "training.max_steps=4",
        "grpo.num_iterations=2",
        "training.gradient_accumulation_steps=2",
        "training.mixed_precision=bf16",
        "training.report_to=[tensorboard]",
        "training.lr_scheduler=cosine",
    )
    train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "iters" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [0, 0, 0, 0]
    assert [r["staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[0]["ratio_abs_dev"] < 2e-2  # bf16 forward against fp32 sampling: close, not exact
    assert rows[3]["ratio_abs_dev"] > rows[0]["ratio_abs_dev"]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[3]["lr"] < rows[1]["lr"]
    assert list((tmp_path / "iters" / "tensorboard").glob("events.out.tfevents.*"))


def test_existing_run_folder_is_not_overwritten(tiny_model_dir, tmp_path):
    """A run with checkpoints is refused unless asked to resume; one without any is moved aside
    (nothing to continue, nothing deleted) and the new run starts fresh. Both write train.log."""
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "once", "training.max_steps=1", "training.save_steps=1"))
    assert "step 1:" in (tmp_path / "once" / "train.log").read_text()
    with pytest.raises(FileExistsError, match="resume_from_checkpoint=latest"):
        train_grpo(tiny_config(tiny_model_dir, tmp_path, "once", "training.max_steps=1"))

    train_grpo(tiny_config(tiny_model_dir, tmp_path, "nockpt", "training.max_steps=1"))
    shutil.rmtree(tmp_path / "nockpt" / "checkpoints")  # as if it had died before its first save
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "nockpt", "training.max_steps=1"))
    (aside,) = tmp_path.glob("nockpt.previous-*")
    for run in (aside, tmp_path / "nockpt"):
        assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
        assert (run / "final" / "model.safetensors").is_file()


def test_offloaded_reference_gives_the_same_run(tiny_model_dir, tmp_path):
    """model.reference_offload reloads the reference for each batch: same numbers, less memory held."""
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "held", "training.max_steps=2"))
    train_grpo(
        tiny_config(
            tiny_model_dir, tmp_path, "offloaded", "training.max_steps=2", "model.reference_offload=true"
        )
    )
    held, offloaded = (
        [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("held", "offloaded")
    )
    assert [r["kl"] for r in held] == [r["kl"] for r in offloaded] and held[1]["kl"] > 0
    assert [r["loss"] for r in held] == [r["loss"] for r in offloaded]


def test_a_step_with_nothing_to_learn_from_is_skipped_not_stepped(tiny_model_dir, tmp_path):
    """Every group scores the same (zero variance, skipped): no optimizer step, no scheduler step
    (and so no PyTorch "lr_scheduler.step() before optimizer.step()" warning), the weights are
    untouched, and the row says skipped."""
    import warnings

    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "flat",
        "training.max_steps=2",
        "training.warmup_steps=4",
        "rewards=[{type: function, function: 'tiny_rewards:constant'}]",
        "grpo.skip_zero_variance_groups=true",
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step.*")
        final = train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "flat" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["num_train_sequences"]) for r in rows] == [(1, True, 0), (2, True, 0)]
    assert rows[0]["lr"] == rows[1]["lr"] == 1e-3 / 4  # the warmup did not move: no update was made
    before, after = weights(tiny_model_dir), weights(final)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_dynamic_sampling_trains_only_on_groups_with_reward_variance(tiny_model_dir, tmp_path):
    """grpo.dynamic_sampling, colocated: flat groups are replaced by groups of fresh prompts, each
    batch still holds prompts_per_step groups, and the rows count what was dropped; resumed, the
    run continues exactly as an uninterrupted one (the filter's state is checkpointed)."""
    overrides = [
        "rewards=[{type: function, function: 'tiny_rewards:half_informative'}]",
        "grpo.dynamic_sampling=true",
        "grpo.dynamic_sampling_max_extra_prompts=40",
        "training.max_steps=4",
        "training.save_steps=2",
    ]
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "dynamic", *overrides))
    rows = [json.loads(line) for line in (tmp_path / "dynamic" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["zero_variance_groups"] == 0 for r in rows)
    assert sum(r["groups_filtered"] for r in rows) > 0  # about half the prompts give flat groups
    for r in rows:
        assert r["groups_generated"] == 2 + r["groups_filtered"]  # prompts_per_step kept
        assert (r["generation_overhead"] > 0) == (r["groups_filtered"] > 0)

    shutil.copytree(tmp_path / "dynamic", tmp_path / "dynamic_resumed")
    resumed = tmp_path / "dynamic_resumed"
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    (resumed / "metrics.jsonl").write_text(
        "".join(line + "\n" for line in (tmp_path / "dynamic" / "metrics.jsonl").read_text().splitlines()[:2])
    )
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "dynamic_resumed",
        *overrides,
        "training.resume_from_checkpoint=latest",
    )
    train_grpo(cfg)
    again = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    for field in ("groups_filtered", "groups_generated", "reward_mean", "loss"):
        assert [r[field] for r in again[2:]] == [r[field] for r in rows[2:]], field


def test_gspo_overlong_reward_and_learning_signal_fields_through_the_cli(tiny_model_dir, tmp_path):
    """`tandem grpo` with GSPO, the overlong reward and TensorBoard: every row holds entropy, the
    split clip fractions and frac_reward_zero_std, and TensorBoard has TRL's names beside tandem's."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tandem.cli import main

    rewards = "rewards=[{type: answer}, {type: function, function: 'tiny_rewards:digit_count'}, "
    rewards += "{type: overlong, kwargs: {cache: 4}}]"
    overrides = tiny_overrides(
        tiny_model_dir,
        tmp_path,
        "gspo",
        rewards,
        "grpo.importance_sampling_level=sequence",
        "grpo.clip_eps_low=3e-4",
        "grpo.clip_eps_high=4e-4",
        "grpo.num_iterations=2",  # the second pass moves the ratio off 1: GSPO's clip range acts
        "training.max_steps=4",
        "training.report_to=[tensorboard]",
    )
    assert main(["grpo", *overrides]) == 0
    rows = [json.loads(x) for x in (tmp_path / "gspo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert 0 < row["entropy"] < math.log(1000)  # a random model's next-token entropy, in nats
        assert row["clip_fraction"] == pytest.approx(row["clip_ratio_low"] + row["clip_ratio_high"])
        assert 0 <= row["frac_reward_zero_std"] <= 1
        # 8 new tokens of L_max 8 with a soft buffer of 4: -1 at 8 tokens, 0 at 4 or fewer
        assert -1 <= row["reward_overlong"] <= 0
    assert rows[0]["clip_fraction"] == 0  # the first update is on-policy: every sequence ratio is 1
    assert any(r["clip_fraction"] > 0 for r in rows), "GSPO's clip range should bind in a second pass"
    acc = EventAccumulator(str(tmp_path / "gspo" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"entropy", "clip_ratio/low_mean", "clip_ratio/region_mean", "completions/clipped_ratio"} <= tags
    assert {"rewards/overlong/mean", "rewards/answer/mean", "learning_rate", "reward"} <= tags
    assert {"reward_mean", "clip_ratio_high", "frac_reward_zero_std"} <= tags


def test_masked_truncated_completions_leave_nothing_to_learn_when_all_are_cut(tiny_model_dir, tmp_path):
    """grpo.mask_truncated_completions with 3 new tokens: the tiny random model never samples EOS that
    soon, so every completion is cut and masked: no update, the weights stay as they were."""
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "masked",
        "sampling.max_new_tokens=3",
        "grpo.mask_truncated_completions=true",
        "training.max_steps=2",
    )
    final = train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "masked" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["finished_fraction"] == 0 for r in rows), "the premise: every completion was cut"
    assert [(r["skipped"], r["entropy"]) for r in rows] == [(True, None), (True, None)]
    before, after = weights(tiny_model_dir), weights(final)
    assert all(torch.equal(before[k], after[k]) for k in before)
