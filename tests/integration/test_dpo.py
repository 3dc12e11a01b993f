"""`tandem dpo` on a tiny random model: the first step against an independent DPO from raw logits, learning,
precompute == online, Safe-MM-DPO (lagrangian: the first step and lambda against an independent
computation, lambda's recurrence over steps; margin: margins from independently scored reward models),
2 ranks == 1 (lambda included), resume == uninterrupted (lambda and its EMA bit for bit), and LoRA whose
reference is the base under the adapters."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_distributed import ROOT, torchrun

from tandem.algorithms.dpo import lagrange_update, safe_mm_margin
from tandem.config import ConfigError, load_config
from tandem.data.preferences import encode_answer, encode_pair, encode_prompt, load_preferences
from tandem.distributed.env import DistEnv
from tandem.models.loading import load_causal_lm, load_tokenizer
from tandem.models.lora import BaseOfAdapter, apply_lora
from tandem.trainer.dpo import build_reference, margins_of, reward_scores, train_dpo
from tandem.trainer.metrics import SUPERVISED_FIELDS

LOG2 = math.log(2.0)
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]"]


def dpo_config(model_dir, out_dir, name, *overrides):
    """8 synthetic helpful pairs, one optimizer batch of all 8 (micro 2 x accumulation 4)."""
    return load_config(
        None,
        [
            f"experiment_name={name}",
            f"output_dir={out_dir}",
            "seed=3",
            f"model.policy={model_dir}",
            "data.num_examples=8",
            "data.num_eval_examples=4",
            "dpo.beta=0.1",
            "training.micro_batch_size=2",
            "training.gradient_accumulation_steps=4",
            "training.learning_rate=1e-3",
            "training.max_steps=1",
            "training.num_epochs=100",
            "training.save_steps=0",
            "training.device=cpu",
            *overrides,
        ],
        method="dpo",
    )


def rows_of(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(folder):
    return load_file(str(folder / "model.safetensors"))


# --------------------------------------------------------------------------- independent oracles


def sequence_logp(model, prompt_ids: list[int], answer_ids: list[int]) -> float:
    """log pi(answer | prompt) from a plain forward of the unpacked sequence."""
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer_ids)[:, None]).sum())


def rm_score(model, tokenizer, prompt: list[dict], answer: str) -> float:
    """A reward model's score by HF's own sequence-classification forward (last token of one row)."""
    ids = encode_prompt(tokenizer, prompt) + encode_answer(tokenizer, answer)
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])


def independent_margins(pairs, helpful_dir, harmless_dir, **weights_and_offset) -> torch.Tensor:
    helpful, harmless = (reward_scores_by_hf(pairs, folder) for folder in (helpful_dir, harmless_dir))
    safer = torch.tensor(
        [
            p.chosen_is_safer if p.chosen_is_safer is not None else bool(s[0] > s[1])
            for p, s in zip(pairs, harmless)
        ]
    )
    return safe_mm_margin(
        helpful[:, 0],
        helpful[:, 1],
        harmless[:, 0],
        harmless[:, 1],
        chosen_is_safer=safer,
        **weights_and_offset,
    )


def safe_mm_overrides(reward_model_dirs) -> list[str]:
    helpful, harmless = reward_model_dirs
    return [
        "dpo.task=mixed",
        f"dpo.safe_mm.helpful_model={helpful}",
        f"dpo.safe_mm.harmless_model={harmless}",
        "dpo.safe_mm.variant=margin",
        "dpo.safe_mm.helpful_weight=1.0",
        "dpo.safe_mm.harmless_weight=0.5",
        "dpo.safe_mm.safety_margin=0.3",
    ]


SAFE_MM_WEIGHTS = {"helpful_weight": 1.0, "harmless_weight": 0.5, "safety_margin": 0.3}
# lagrangian: a steep beta (k) and a fast multiplier so that a few steps move both visibly
LAGRANGE = {
    "w": 0.5,
    "k": 2.0,
    "lambda_init": 0.5,
    "lambda_lr": 0.05,
    "cost_threshold": 0.1,
    "cost_ema_decay": 0.9,
}


def lagrangian_overrides(reward_model_dirs) -> list[str]:
    helpful, harmless = reward_model_dirs
    return [
        "dpo.task=mixed",
        f"dpo.safe_mm.helpful_model={helpful}",
        f"dpo.safe_mm.harmless_model={harmless}",
        *(f"dpo.safe_mm.{k}={v}" for k, v in LAGRANGE.items()),
    ]


def reward_scores_by_hf(pairs, folder) -> torch.Tensor:
    """[N, 2] scores (chosen, rejected) by HF's own sequence-classification forward, one answer at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return torch.tensor(
        [[rm_score(model, tokenizer, p.prompt, a) for a in (p.chosen, p.rejected)] for p in pairs]
    )


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("mode", ["online", "precompute"])
def test_first_step_loss_is_log_2_when_the_policy_is_the_reference(tiny_model_dir, tmp_path, mode):
    train_dpo(dpo_config(tiny_model_dir, tmp_path, "log2", f"dpo.reference_logps={mode}"))
    (row,) = rows_of(tmp_path / "log2")
    assert set(SUPERVISED_FIELDS) <= row.keys() and row["num_pairs"] == 8
    # policy == reference: every implicit reward is 0, so the loss is -log sigma(0) = log 2
    # precompute batched the pairs differently (other padding): float32 rounding of ~-1e3 log-probs
    tol = 1e-7 if mode == "online" else 1e-5
    assert row["loss"] == pytest.approx(LOG2, abs=tol)
    assert abs(row["reward_chosen"]) <= tol and abs(row["reward_margin"]) <= tol
    assert math.isfinite(row["eval_loss"]) and 0 <= row["eval_reward_accuracy"] <= 1


def test_first_step_matches_dpo_computed_from_raw_logits(tiny_model_dir, tmp_path):
    """Policy and reference differ (another random model): the logged first-step loss and rewards
    equal DPO computed by hand from each model's full logits on each unpacked pair."""
    from transformers import AutoModelForCausalLM

    from tiny_models import make_tiny_model_dir

    reference_dir = make_tiny_model_dir(tmp_path / "reference", seed=1)
    train_dpo(dpo_config(tiny_model_dir, tmp_path, "oracle", f"model.reference={reference_dir}"))
    (row,) = rows_of(tmp_path / "oracle")

    tokenizer = load_tokenizer(str(tiny_model_dir))
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    pairs = load_preferences("synthetic", "train", task="helpful", num_examples=8, seed=3)
    beta, chosen_rewards, rejected_rewards, losses = 0.1, [], [], []
    for pair in pairs:
        e = encode_pair(tokenizer, pair, 512)
        chosen = beta * (
            sequence_logp(policy, e.prompt_ids, e.chosen_ids)
            - sequence_logp(reference, e.prompt_ids, e.chosen_ids)
        )
        rejected = beta * (
            sequence_logp(policy, e.prompt_ids, e.rejected_ids)
            - sequence_logp(reference, e.prompt_ids, e.rejected_ids)
        )
        chosen_rewards.append(chosen)
        rejected_rewards.append(rejected)
        losses.append(math.log1p(math.exp(-(chosen - rejected))))  # -log sigma(chosen - rejected)
    assert row["loss"] == pytest.approx(sum(losses) / 8, rel=1e-5)
    assert row["loss"] != pytest.approx(LOG2, abs=1e-3)  # the models differ: not the trivial value
    assert row["reward_chosen"] == pytest.approx(sum(chosen_rewards) / 8, abs=1e-6)
    assert row["reward_margin"] == pytest.approx((sum(chosen_rewards) - sum(rejected_rewards)) / 8, abs=1e-6)
    accuracy = sum(c > r for c, r in zip(chosen_rewards, rejected_rewards)) / 8
    assert row["reward_accuracy"] == pytest.approx(accuracy)


def test_dpo_raises_the_margin_and_lowers_the_loss_on_a_fixed_set(tiny_model_dir, tmp_path):
    """8 pairs from a file, trained and evaluated on the same file for 10 epochs."""
    pairs = load_preferences("synthetic", "train", task="helpful", num_examples=8, seed=5)
    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}) + "\n" for p in pairs
        )
    )
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path,
        "learn",
        f"data.dataset={data}",
        f"data.eval_dataset={data}",
        "data.num_examples=0",
        "data.num_eval_examples=8",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=1",
        "training.num_epochs=10",
        "training.max_steps=1000",
        "training.eval_steps=10",
        "training.learning_rate=3e-3",
    )
    train_dpo(cfg)
    rows = rows_of(tmp_path / "learn")
    assert [r["step"] for r in rows] == list(range(1, 21)) and rows[-1]["epoch"] == 10.0
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert rows[0]["loss"] == pytest.approx(LOG2, abs=1e-5)  # precomputed reference: rounding only
    last = evals[-1]
    print({k: last[k] for k in ("eval_loss", "eval_reward_margin", "eval_reward_accuracy")})
    assert last["eval_loss"] < 0.5 * LOG2 and last["eval_loss"] < evals[0]["eval_loss"]
    assert last["eval_reward_margin"] > evals[0]["eval_reward_margin"] > 0
    assert last["eval_reward_accuracy"] == 1.0


def test_precomputed_reference_equals_online(tiny_model_dir, tmp_path):
    common = ("training.max_steps=3", "training.micro_batch_size=4", "training.gradient_accumulation_steps=1")
    runs = {}
    for mode in ("precompute", "online"):
        final = train_dpo(dpo_config(tiny_model_dir, tmp_path, mode, f"dpo.reference_logps={mode}", *common))
        runs[mode] = weights(final)
    for name, value in runs["online"].items():
        torch.testing.assert_close(runs["precompute"][name], value, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(runs["online"]["model.norm.weight"], weights(tiny_model_dir)["model.norm.weight"])


def test_safe_mm_margins_equal_the_reward_models_scored_independently(
    tiny_model_dir, tmp_path, reward_model_dirs
):
    cfg = dpo_config(tiny_model_dir, tmp_path, "margins", *safe_mm_overrides(reward_model_dirs))
    pairs = load_preferences("synthetic", "train", task="mixed", num_examples=12, seed=3)
    assert {p.chosen_is_safer for p in pairs} == {True, False, None}  # refusals, needless refusals, maths
    margins = margins_of(cfg, pairs, *reward_scores(cfg, [pairs], DistEnv(), torch.device("cpu"))[0])
    expected = independent_margins(pairs, *reward_model_dirs, **SAFE_MM_WEIGHTS)
    torch.testing.assert_close(margins, expected, rtol=0, atol=1e-5)
    assert expected.abs().max() > 0.1  # the score heads are not trivially zero


def test_safe_mm_dpo_run_uses_the_margins_and_trains(tiny_model_dir, tmp_path, reward_model_dirs):
    cfg = dpo_config(
        tiny_model_dir, tmp_path, "safe_mm", "training.max_steps=3", *safe_mm_overrides(reward_model_dirs)
    )
    train_dpo(cfg)
    rows = rows_of(tmp_path / "safe_mm")
    pairs = load_preferences("synthetic", "train", task="mixed", num_examples=8, seed=3)
    margins = independent_margins(pairs, *reward_model_dirs, **SAFE_MM_WEIGHTS)
    # the batch is all 8 pairs; at step 1 the implicit rewards are 0, so loss = mean -log sigma(-m)
    assert rows[0]["margin_mean"] == pytest.approx(float(margins.mean()), abs=1e-5)
    assert rows[0]["loss"] == pytest.approx(float(F.softplus(margins).mean()), abs=1e-5)
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["reward_margin"] > 0
    assert "eval_margin_mean" in rows[-1] and math.isfinite(rows[-1]["eval_loss"])


def test_safe_mm_lagrangian_first_step_equals_an_independent_computation(
    tiny_model_dir, tmp_path, reward_model_dirs
):
    """Policy != reference: the logged loss, L_H, L_S, mean betas, expected cost, J_C and lambda after
    the first step equal the authors' formulas computed here from plain forwards and HF-scored reward
    models (README: Safe-MM-DPO, variant lagrangian)."""
    from transformers import AutoModelForCausalLM

    from tiny_models import make_tiny_model_dir

    reference_dir = make_tiny_model_dir(tmp_path / "reference", seed=1)
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path,
        "lag1",
        f"model.reference={reference_dir}",
        *lagrangian_overrides(reward_model_dirs),
    )
    train_dpo(cfg)
    (row,) = rows_of(tmp_path / "lag1")

    tokenizer = load_tokenizer(str(tiny_model_dir))
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    reference = AutoModelForCausalLM.from_pretrained(reference_dir).eval()
    pairs = load_preferences("synthetic", "train", task="mixed", num_examples=8, seed=3)
    helpful, harmless = (reward_scores_by_hf(pairs, folder) for folder in reward_model_dirs)
    beta, w, k, lam = 0.1, LAGRANGE["w"], LAGRANGE["k"], LAGRANGE["lambda_init"]
    loss_h, loss_s, beta_h, beta_s, costs = [], [], [], [], []
    for i, pair in enumerate(pairs):
        e = encode_pair(tokenizer, pair, 512)
        pc, pr = (sequence_logp(policy, e.prompt_ids, a) for a in (e.chosen_ids, e.rejected_ids))
        rc, rr = (sequence_logp(reference, e.prompt_ids, a) for a in (e.chosen_ids, e.rejected_ids))
        d = (pc - rc) - (pr - rr)
        bh = beta * (1 + w * (1 - math.exp(-k * abs(float(helpful[i, 0] - helpful[i, 1])))))
        bs = beta * (1 + w * (1 - math.exp(-k * abs(float(harmless[i, 0] - harmless[i, 1])))))
        beta_h.append(bh)
        beta_s.append(bs)
        loss_h.append(math.log1p(math.exp(-bh * d)))
        loss_s.append(math.log1p(math.exp(-bs * d)))
        # the policy's preference between its answers: softmax of the length-normalised log-probs
        mc, mr = pc / len(e.chosen_ids), pr / len(e.rejected_ids)
        p_chosen = 1 / (1 + math.exp(mr - mc))
        costs.append(p_chosen * -float(harmless[i, 0]) + (1 - p_chosen) * -float(harmless[i, 1]))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert row["loss_helpful"] == pytest.approx(mean(loss_h), rel=1e-5)
    assert row["loss_harmless"] == pytest.approx(mean(loss_s), rel=1e-5)
    assert row["loss"] == pytest.approx((mean(loss_h) + lam * mean(loss_s)) / (1 + lam), rel=1e-5)
    assert row["beta_helpful_mean"] == pytest.approx(mean(beta_h), rel=1e-6)
    assert row["beta_harmless_mean"] == pytest.approx(mean(beta_s), rel=1e-6)
    assert beta < min(beta_h + beta_s) and max(beta_h + beta_s) < (1 + w) * beta  # betas really vary
    assert row["expected_cost"] == pytest.approx(mean(costs), abs=1e-5)
    j_c = mean(costs) + LAGRANGE["cost_threshold"]  # the EMA starts at the first batch's value
    assert row["cost_ema"] == pytest.approx(j_c, abs=1e-5)
    expected_lambda = math.exp(math.log(lam) + LAGRANGE["lambda_lr"] * lam * j_c)
    assert row["lambda"] == pytest.approx(expected_lambda, rel=1e-5)
    assert abs(row["lambda"] - lam) > 1e-3  # it moved
    assert "margin_mean" not in row and math.isfinite(row["eval_loss_harmless"])


def test_safe_mm_lambda_follows_its_recurrence_and_its_cost(tiny_model_dir, tmp_path, reward_model_dirs):
    """Over 5 steps: cost_ema is the EMA of (expected_cost + threshold), lambda the log-space update
    from it, and each step's loss mixes that step's L_H and L_S with the lambda before its update."""
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path,
        "lagrec",
        "data.num_examples=16",
        "training.max_steps=5",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=1",
        *lagrangian_overrides(reward_model_dirs),
    )
    train_dpo(cfg)
    rows = rows_of(tmp_path / "lagrec")
    lam, ema, decay = LAGRANGE["lambda_init"], None, LAGRANGE["cost_ema_decay"]
    for row in rows:
        mixed = (row["loss_helpful"] + lam * row["loss_harmless"]) / (1 + lam)
        assert row["loss"] == pytest.approx(mixed, rel=1e-6)
        batch = row["expected_cost"] + LAGRANGE["cost_threshold"]
        ema = batch if ema is None else decay * ema + (1 - decay) * batch
        lam = lagrange_update(lam, ema, lr=LAGRANGE["lambda_lr"])
        assert row["cost_ema"] == pytest.approx(ema, rel=1e-12)
        assert row["lambda"] == pytest.approx(lam, rel=1e-12)
    # lambda moves with the sign of the smoothed cost (and stays inside its clamp)
    assert all((b["lambda"] > a["lambda"]) == (b["cost_ema"] > 0) for a, b in zip(rows, rows[1:]))
    assert all(1e-6 < r["lambda"] < 10 for r in rows)
    assert len({r["expected_cost"] for r in rows}) > 1  # batches (and the policy) differ


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["training.distributed_strategy=ddp"],
        ["training.distributed_strategy=deepspeed", "training.zero_stage=3"],
    ],
    ids=["ddp", "zero3"],
)
def test_two_ranks_equal_one_rank(tiny_model_dir, tmp_path, reward_model_dirs, strategy):
    """`torchrun --nproc-per-node 2 -m tandem.cli dpo`: 13 pairs in global batches of 8 (the second
    one short and uneven over the ranks), 3 eval pairs, Safe-MM-DPO (lagrangian) with the reward
    models scoring on both ranks. Equal weights also show that both ranks used the same lambda: each
    rank scales its own gradients with it before they are averaged."""
    common = [
        "data.num_examples=13",
        "data.num_eval_examples=3",
        "training.max_steps=3",
        "training.micro_batch_size=2",
        *lagrangian_overrides(reward_model_dirs),
    ]
    one = train_dpo(
        dpo_config(tiny_model_dir, tmp_path, "one", *common, "training.gradient_accumulation_steps=4")
    )
    overrides = [
        "experiment_name=two",
        f"output_dir={tmp_path}",
        "seed=3",
        f"model.policy={tiny_model_dir}",
        "dpo.beta=0.1",
        "training.learning_rate=1e-3",
        "training.num_epochs=100",
        "training.save_steps=0",
        "training.device=cpu",
        *strategy,
        "training.gradient_accumulation_steps=2",
        *common,
    ]
    if "deepspeed" in strategy[0]:
        pytest.importorskip("deepspeed")
    torchrun(2, "-m", "tandem.cli", "dpo", *overrides)
    a, b = weights(one), weights(tmp_path / "two" / "final")
    for name, value in a.items():
        torch.testing.assert_close(b[name], value, rtol=0, atol=2e-6, msg=name)
    assert all(r["world_size"] == 2 and r["num_pairs"] in (8, 5) for r in rows_of(tmp_path / "two"))
    for ra, rb in zip(rows_of(tmp_path / "one"), rows_of(tmp_path / "two"), strict=True):
        for key in ("loss", "loss_helpful", "loss_harmless", "reward_margin", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), key
        # reward-model scores of the same answers in differently padded batches: fp32 rounding
        for key in ("expected_cost", "cost_ema", "lambda", "beta_harmless_mean"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-6), key
    assert rows_of(tmp_path / "two")[-1]["eval_loss"] == pytest.approx(
        rows_of(tmp_path / "one")[-1]["eval_loss"], rel=1e-5
    )


@pytest.mark.parametrize("variant", ["dpo", "safe-mm-lagrangian"])
def test_resume_equals_uninterrupted_bit_for_bit(tiny_model_dir, tmp_path, variant, request):
    """Weights and rows (Safe-MM-DPO: lambda and its EMA too) of a run resumed at step 2 equal those of
    the uninterrupted one, bit for bit."""
    common = (
        "training.micro_batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.eval_steps=2",
    )
    if variant != "dpo":
        common += (
            "data.num_examples=16",
            *lagrangian_overrides(request.getfixturevalue("reward_model_dirs")),
        )
    straight = train_dpo(dpo_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4", *common))
    train_dpo(
        dpo_config(
            tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", "training.save_steps=2", *common
        )
    )
    resumed = train_dpo(
        dpo_config(
            tiny_model_dir,
            tmp_path,
            "resumed",
            "training.max_steps=4",
            "training.save_steps=2",
            "training.resume_from_checkpoint=latest",
            *common,
        )
    )
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ from the uninterrupted run"
    rows_a, rows_b = rows_of(tmp_path / "straight"), rows_of(tmp_path / "resumed")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    keys = ("loss", "grad_norm", "eval_loss", "lambda", "cost_ema")
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert [ra.get(k) for k in keys] == [rb.get(k) for k in keys]
    if variant != "dpo":
        assert rows_a[-1]["lambda"] != LAGRANGE["lambda_init"]


@pytest.mark.parametrize("mode", ["online", "precompute"])
def test_lora_reference_is_the_base_under_the_adapters(tiny_model_dir, tmp_path, mode):
    pytest.importorskip("peft")
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path,
        "lora",
        f"dpo.reference_logps={mode}",
        "training.max_steps=3",
        "training.learning_rate=1e-2",
        *LORA,
    )
    policy = apply_lora(load_causal_lm(str(tiny_model_dir)), cfg.model.lora)
    reference = build_reference(
        cfg, types.SimpleNamespace(module=policy), None, DistEnv(), torch.device("cpu")
    )
    assert isinstance(reference, BaseOfAdapter) and reference.model is policy  # no second copy

    final = train_dpo(cfg)
    rows = rows_of(tmp_path / "lora")
    # adapters start at B = 0: the policy is exactly its base, the reference
    tol = 1e-7 if mode == "online" else 1e-5  # precompute: other padding, float32 rounding
    assert rows[0]["loss"] == pytest.approx(LOG2, abs=tol) and abs(rows[0]["reward_margin"]) <= tol
    assert rows[-1]["loss"] < rows[0]["loss"]
    base, merged = weights(tiny_model_dir), weights(final)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(any(m in k for m in ("q_proj", "v_proj", "up_proj")) for k in changed), changed
    assert (final / "adapter" / "adapter_config.json").is_file()


def test_a_missing_reward_model_is_a_config_error(tiny_model_dir, tmp_path):
    cfg = dpo_config(
        tiny_model_dir,
        tmp_path,
        "missing",
        f"dpo.safe_mm.helpful_model={tiny_model_dir}",
        f"dpo.safe_mm.harmless_model={tmp_path / 'nope'}",
    )
    with pytest.raises(ConfigError, match=r"dpo\.safe_mm\.harmless_model.*tandem rm"):
        train_dpo(cfg)


def test_shipped_configs_are_dpo_and_safe_mm_dpo():
    plain = load_config(ROOT / "configs" / "dpo_tiny.yaml", method="dpo")
    safe = load_config(ROOT / "configs" / "safe_mm_dpo_tiny.yaml", method="dpo")
    assert not plain.dpo.safe_mm.enabled and plain.data.dataset == "synthetic"
    assert safe.dpo.task == "mixed" and safe.dpo.safe_mm.helpful_model == "runs/rm_helpful/final"
    assert safe.dpo.safe_mm.harmless_model == "runs/rm_harmless/final"
    assert safe.dpo.safe_mm.variant == "lagrangian"
    margin = load_config(ROOT / "configs" / "safe_mm_dpo_margin_tiny.yaml", method="dpo")
    assert margin.dpo.safe_mm.variant == "margin" and margin.dpo.safe_mm.safety_margin == 0.5
