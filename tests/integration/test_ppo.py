"""The PPO loop on a tiny random model: its loss against a plain re-implementation, a value head
that learns, 2-rank DDP == 1 rank, bit-exact resume, and a decoupled run with a sampler process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_driver import fixed_groups
from ppo_dist_driver import seeded_value_head
from tandem.config import load_config
from tandem.distributed.engine import build_engine
from tandem.distributed.env import DistEnv
from tandem.models.loading import load_causal_lm
from tandem.models.value_head import VALUE_HEAD_FILE, ValueHeadModel
from tandem.trainer import checkpoint as ckpt
from tandem.trainer.batching import flatten_groups, split_across_ranks
from tandem.trainer.metrics import REQUIRED_FIELDS
from tandem.trainer.ppo import optimizer_step, prepare_batch, train_ppo
from tandem.trainer.rl_steps import scatter_batch

ROOT = Path(__file__).resolve().parents[2]
PPO_FIELDS = ("value_loss", "explained_variance", "returns_mean", "vf_clip_fraction")


def tiny_config(model_dir, out_dir, name, *overrides):
    return load_config(
        None,
        [
            "method=ppo",
            f"experiment_name={name}",
            f"output_dir={out_dir}",
            "seed=3",
            f"model.policy={model_dir}",
            "sampling.dtype=float32",
            "sampling.max_new_tokens=8",
            "sampling.num_generations=2",
            "sampling.batch_size=8",
            "data.num_examples=4",  # a fixed set: the same 4 prompts every batch
            "data.num_shots=0",
            "rewards=[{type: answer}, {type: format}]",
            "grpo.prompts_per_step=4",
            "training.micro_batch_size=4",
            "training.gradient_accumulation_steps=2",
            "training.learning_rate=5e-3",
            "training.device=cpu",
            "training.save_steps=0",
            "pipeline.mode=colocated",
            *overrides,
        ],
    )


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ the loss, re-implemented


def naive_ppo_loss(model, head: torch.nn.Linear, samples, cfg) -> dict[str, float]:
    """The first step's loss from unpacked forwards, raw logits and Python loops over tokens."""
    pc, temperature = cfg.ppo, cfg.sampling.temperature
    kl_in_reward = pc.kl_coef if pc.kl_mode == "reward" else 0.0
    seqs = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            n, m = len(s.prompt_ids), len(s.completion_ids)
            logits = model(input_ids=ids).logits[0].double()  # [L, V]
            hidden = model.model(input_ids=ids).last_hidden_state[0].double()  # [L, H]
            logprobs = [
                torch.log_softmax(logits[n - 1 + t] / temperature, -1)[s.completion_ids[t]].item()
                for t in range(m)
            ]
            values = [
                (hidden[n - 1 + t] @ head.weight[0].double() + head.bias.double()).item() for t in range(m)
            ]
            sampler, ref = s.sampler_logprobs.tolist(), s.ref_logprobs.tolist()
            rewards = [-kl_in_reward * (sampler[t] - ref[t]) for t in range(m)]
            rewards[-1] += s.reward
            advantages, running = [0.0] * m, 0.0
            for t in reversed(range(m)):
                next_value = values[t + 1] if t + 1 < m else 0.0
                running = rewards[t] + pc.gamma * next_value - values[t] + pc.gamma * pc.lam * running
                advantages[t] = running
            returns = [a + v for a, v in zip(advantages, values)]
            seqs.append((logprobs, values, sampler, ref, advantages, returns))
    flat = [a for seq in seqs for a in seq[4]]
    num_tokens = len(flat)
    mean = sum(flat) / num_tokens
    var = sum((a - mean) ** 2 for a in flat) / num_tokens
    policy = value = kl = 0.0
    for logprobs, values, sampler, ref, advantages, returns in seqs:
        for t in range(len(logprobs)):
            a = (advantages[t] - mean) / math.sqrt(var + 1e-8) if pc.whiten_advantages else advantages[t]
            ratio = math.exp(logprobs[t] - sampler[t])
            clipped = min(max(ratio, 1 - pc.clip_eps), 1 + pc.clip_eps)
            policy += max(-a * ratio, -a * clipped)
            value += 0.5 * (values[t] - returns[t]) ** 2  # old values are these values: no clipping
            kl += math.exp(ref[t] - logprobs[t]) - (ref[t] - logprobs[t]) - 1
    loss = policy + pc.vf_coef * value + (pc.kl_coef * kl if pc.kl_mode == "loss" else 0.0)
    return {
        "loss": loss / num_tokens,
        "policy_loss": policy / num_tokens,
        "value_loss": value / num_tokens,
        "kl": kl / num_tokens,
    }


@pytest.mark.parametrize(
    "overrides",
    [
        ["ppo.kl_mode=reward", "ppo.whiten_advantages=true"],
        ["ppo.kl_mode=loss", "ppo.whiten_advantages=false", "sampling.temperature=0.8"],
    ],
    ids=["kl_in_reward", "kl_as_loss"],
)
def test_first_step_loss_matches_a_plain_reimplementation(tiny_model_dir, tmp_path, overrides):
    # 2 groups x 4 completions of uneven lengths in micro-batches of 2 (4 accumulated): the packed
    # forward, the padding, the global token normalisation and the whitening all have work to do
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "naive",
        "sampling.num_generations=4",
        "grpo.prompts_per_step=2",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=4",
        "ppo.gamma=0.9",
        "ppo.lam=0.8",
        "ppo.kl_coef=0.3",
        "ppo.vf_coef=0.5",
        *overrides,
    )
    device = torch.device("cpu")
    model = load_causal_lm(str(tiny_model_dir), dtype="float32")
    forward = ValueHeadModel(model)
    seeded_value_head(forward)
    engine = build_engine(model, cfg.training, DistEnv(), device, forward=forward)
    groups = fixed_groups(0, 2, 4, model.config.vocab_size)
    samples = flatten_groups(groups, scale_rewards="none", adv_eps=0.0, skip_zero_variance=False)
    shares = scatter_batch(DistEnv(), samples, cfg)
    want = naive_ppo_loss(model, forward.value_head, shares[0].samples, cfg)

    batches, _ = prepare_batch(engine, shares, cfg, device)
    assert len(batches) == 1 and len(batches[0].micros) == 4
    got = optimizer_step(engine, batches[0], cfg, device)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert got["clip_fraction"] > 0  # the fixed sampler log-probs are far from the policy's: clipping acts
    assert got["vf_clip_fraction"] == 0  # first pass: the values are the old values


# ------------------------------------------------------------------ colocated runs


def test_colocated_run_lowers_the_value_loss_and_records_the_head(tiny_model_dir, tmp_path):
    """Answer and format rewards on a random model are a constant -2: the critic must learn it."""
    cfg = tiny_config(
        tiny_model_dir,
        tmp_path,
        "learn",
        "training.max_steps=12",
        "training.save_steps=6",
        "ppo.num_iterations=1",
    )
    final = train_ppo(cfg)
    rows = rows_of(tmp_path / "learn")
    assert [r["step"] for r in rows] == list(range(1, 13))
    for row in rows:
        assert set(REQUIRED_FIELDS) <= row.keys() and set(PPO_FIELDS) <= row.keys()
        for key in ("loss", "value_loss", "kl", "grad_norm", "returns_mean", "reward_mean"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), key
        assert row["policy_version"] == row["step"] - 1
    assert rows[0]["ratio_abs_dev"] < 1e-5 and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    first, last = rows[0]["value_loss"], rows[-1]["value_loss"]
    assert last < 0.3 * first, [round(r["value_loss"], 4) for r in rows]
    assert rows[0]["values_mean"] == 0.0 and rows[-1]["values_mean"] < -1.0  # zero head -> towards -2

    head = load_file(str(final / VALUE_HEAD_FILE))
    assert head["weight"].shape == (1, 32) and head["bias"].abs().item() > 0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final)  # final/ stays a plain HF causal LM
    saved = [p for _, p in ckpt.list_checkpoints(tmp_path / "learn" / "checkpoints")]
    assert [p.name for p in saved] == ["step-6", "step-12"]
    assert all((p / VALUE_HEAD_FILE).is_file() for p in saved)
    assert torch.equal(load_file(str(saved[-1] / VALUE_HEAD_FILE))["weight"], head["weight"])


def test_resume_equals_uninterrupted_bit_for_bit(tiny_model_dir, tmp_path):
    # two passes per batch (ppo.num_iterations=2): each checkpoint falls between batches
    straight = train_ppo(tiny_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4"))
    common = ("training.save_steps=2",)
    train_ppo(tiny_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    resumed = train_ppo(
        tiny_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=4",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )
    for file in ("model.safetensors", VALUE_HEAD_FILE):
        a, b = load_file(str(straight / file)), load_file(str(resumed / file))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"{file} differs from the uninterrupted run"
    rows_a, rows_b = rows_of(tmp_path / "straight"), rows_of(tmp_path / "resumed")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    for ra, rb in zip(rows_a, rows_b):
        keys = ("loss", "value_loss", "reward_mean", "grad_norm", "explained_variance", "vf_clip_fraction")
        assert [ra[k] for k in keys] == [rb[k] for k in keys]
    assert (
        rows_a[1]["vf_clip_fraction"] >= 0 and rows_a[1]["ratio_abs_dev"] > 0
    )  # the second pass is off-policy


# ------------------------------------------------------------------ 2 ranks == 1 rank


def run_driver(tmp_path: Path, model_dir: Path, name: str, nproc: int, *overrides: str) -> tuple[dict, dict]:
    from integration.test_distributed import child_env, free_port

    out = tmp_path / f"{name}.pt"
    common = [
        "grpo.prompts_per_step=6",
        "sampling.num_generations=4",
        "training.learning_rate=1e-3",
        "ppo.num_iterations=2",
        "ppo.kl_coef=0.1",
    ]
    args = [str(ROOT / "tests" / "ppo_dist_driver.py"), str(model_dir), str(out), *common, *overrides]
    if nproc > 1:
        launcher = [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
        ]
        args = [*launcher, *args]
    proc = subprocess.run(
        [sys.executable, *args],
        env={**child_env(), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out), json.loads(Path(f"{out}.json").read_text())


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory):
    """One process, no process group: micro-batch 2 x accumulation 6 = one optimizer batch of 12."""
    return run_driver(
        tmp_path_factory.mktemp("ppo-one"),
        tiny_model_dir,
        "one",
        1,
        "training.distributed_strategy=none",
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=6",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["training.distributed_strategy=ddp"],
        ["training.distributed_strategy=deepspeed", "training.zero_stage=2"],
        ["training.distributed_strategy=deepspeed", "training.zero_stage=3"],
    ],
    ids=["ddp", "zero2", "zero3"],
)
def test_two_ranks_equal_one_rank(one_rank, tiny_model_dir, tmp_path, strategy):
    """24 sequences per batch in 2 optimizer batches of 12, two passes, 2 batches: 8 AdamW steps.
    Each optimizer batch of 3 groups is split by tokens, 2 groups to one rank and 1 to the other
    (the short rank pads with zero-weighted micro-batches); old values, GAE and whitening are per
    rank with global sums; policy and value head must end where one process ends."""
    for index in range(2):
        samples = flatten_groups(
            fixed_groups(index, 6, 4, 320), scale_rewards="none", adv_eps=0.0, skip_zero_variance=False
        )
        for first in (0, 12):
            assert sorted(len(p) for p in split_across_ranks(samples[first : first + 12], 2)) == [4, 8]
    params_one, record_one = one_rank
    params_two, record_two = run_driver(
        tmp_path,
        tiny_model_dir,
        "two",
        2,
        *strategy,
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=3",
    )
    assert record_two["world_size"] == 2 and len(record_one["rows"]) == 8
    assert all(r["num_batches"] == 2 for r in record_one["rows"] + record_two["rows"])
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    assert sum(not torch.equal(before[k], params_one[k]) for k in before) > len(before) // 2
    assert {"value_head.weight", "value_head.bias"} <= params_one.keys()
    for name, value in params_one.items():
        # 8 AdamW steps at lr 1e-3: the runs differ in fp32 summation order only (measured: DDP
        # 6e-8, ZeRO-2 1.5e-7, ZeRO-3 2.1e-6)
        torch.testing.assert_close(params_two[name], value, rtol=0, atol=5e-6, msg=name)
    for a, b in zip(record_one["rows"], record_two["rows"]):
        for key in ("loss", "value_loss", "kl", "explained_variance", "returns_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["num_train_sequences"] == b["num_train_sequences"] == 12
    assert any(r["vf_clip_fraction"] > 0 for r in record_one["rows"])  # value clipping was exercised


# ------------------------------------------------------------------ decoupled: a real sampler process


@pytest.mark.slow
def test_tandem_ppo_runs_a_trainer_and_a_sampler_process(make_run):
    """`tandem ppo` with pipeline.mode=decoupled: the launcher starts `tandem train` and `tandem
    sample` (no `method` in the overrides: the launcher must hand it on, else both run GRPO)."""
    run = make_run("ppo2", "ppo.num_iterations=1", "training.max_steps=4")
    proc = run.start("ppo", log="ppo")
    assert run.wait(proc, "ppo") == 0, run.log("ppo")[-3000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(set(REQUIRED_FIELDS) | set(PPO_FIELDS) <= r.keys() for r in rows)
    assert all(math.isfinite(r["value_loss"]) and r["grad_norm"] > 0 for r in rows)
    assert all(r["staleness_mean"] <= 1 for r in rows) and rows[-1]["groups_from_s0"] >= 8
    assert rows[-1]["policy_version"] >= 2  # groups made by weights the trainer published
    versions = [r["policy_version"] for r in run.sampler_rows()]
    assert versions == sorted(versions) and versions[-1] >= 2  # the sampler loaded new weights
    assert (run.dir / "final" / VALUE_HEAD_FILE).is_file()
    assert "final policy:" in run.log("ppo")
