"""LoRA (PEFT) on the tiny model: only adapters train, the reference is the base under them (no
second copy), samplers get adapters or merged weights and reproduce the policy exactly, resume is
exact, and 2 DDP ranks equal 1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import assert_same, run_driver
from test_grpo_loop import tiny_config

from tandem.models.loading import load_causal_lm, load_tokenizer
from tandem.models.lora import BaseOfAdapter, adapter_parameters, apply_lora, merged_tensors
from tandem.sampler.rollout import build_rollout
from tandem.trainer.grpo import train_grpo

pytest.importorskip("peft")
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj, up_proj]"]


def test_lora_trains_adapters_against_the_base_and_exports_merged(tiny_model_dir, tmp_path):
    cfg = tiny_config(
        tiny_model_dir, tmp_path, "lora", "training.max_steps=3", "training.learning_rate=1e-2", *LORA
    )
    final = train_grpo(cfg)
    rows = [json.loads(x) for x in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    # step 1: adapters start at B = 0, the policy IS the base, so the KL to the reference is 0
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0

    base, merged = (
        load_file(str(tiny_model_dir / "model.safetensors")),
        load_file(str(final / "model.safetensors")),
    )
    assert merged.keys() == base.keys()
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(any(m in k for m in ("q_proj", "v_proj", "up_proj")) for k in changed), changed

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    again = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final / "adapter")
    for name, tensor in merged_tensors(again):
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)


def test_reference_is_the_base_under_the_adapters(tiny_model_dir):
    from test_grpo_loop import tiny_config as make

    cfg = make(tiny_model_dir, "/tmp", "x", *LORA)
    policy = apply_lora(load_causal_lm(str(tiny_model_dir)), cfg.model.lora)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rollout = build_rollout(cfg, policy, tokenizer, torch.Generator(), torch.device("cpu"))
    assert isinstance(rollout.reference, BaseOfAdapter) and rollout.reference.model is policy
    with torch.no_grad():
        for p in adapter_parameters(policy).values():
            p.add_(0.1)  # adapters now change the output
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        with rollout.reference as ref:
            base_logits = ref(ids).logits
        policy_logits = policy(ids).logits
        plain = load_causal_lm(str(tiny_model_dir))(ids).logits
    torch.testing.assert_close(base_logits, plain)
    assert not torch.allclose(policy_logits, plain)


def test_lora_resume_equals_uninterrupted(tiny_model_dir, tmp_path):
    straight = train_grpo(tiny_config(tiny_model_dir, tmp_path, "straight", "training.max_steps=4", *LORA))
    common = ("training.save_steps=2", *LORA)
    train_grpo(tiny_config(tiny_model_dir, tmp_path, "resumed", "training.max_steps=2", *common))
    assert (tmp_path / "resumed" / "checkpoints" / "step-2" / "model" / "adapter_model.safetensors").is_file()
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
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_sampler_reproduces_the_lora_policy(make_run, sync):
    """Strictly on-policy through the real pipeline: the sampler's base + received adapters (or
    received merged weights) give the trainer's log-probs exactly; with `adapter`, only adapters travel."""
    run = make_run(
        f"lora_{sync}",
        *LORA,
        f"model.lora.sync={sync}",
        "training.learning_rate=1e-2",
        "pipeline.max_staleness=0",
        "pipeline.sync_every=1",
        "pipeline.sync_method=fs",
        "training.micro_batch_size=8",
        "training.gradient_accumulation_steps=1",
    )
    trainer, sampler = run.trainer(), run.sampler()
    assert run.wait(trainer, "trainer") == 0, run.log("trainer")[-3000:]
    assert run.wait(sampler, "s0", timeout=60) == 0, run.log("s0")[-3000:]
    rows = run.rows()
    assert [r["policy_version"] for r in rows] == [0, 1, 2, 3]
    assert all(r["ratio_abs_dev"] < 1e-5 for r in rows), [r["ratio_abs_dev"] for r in rows]
    assert rows[-1]["kl"] > 0  # the policy has moved away from the base the sampler's reference is
    # what the last published version held (the fs versions themselves go when the run finishes)
    names = json.loads((run.dir / "sync_state.json").read_text())["tensors"]
    if sync == "adapter":
        assert names and all(".lora_" in n for n in names)
    else:
        assert set(names) == set(load_file(str(run.dir / "final" / "model.safetensors")))


def test_two_ddp_ranks_equal_one_with_lora(tiny_model_dir, tmp_path):
    one, _ = run_driver(
        tmp_path,
        tiny_model_dir,
        "one",
        1,
        "training.distributed_strategy=none",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=4",
        *LORA,
    )
    two, _ = run_driver(
        tmp_path,
        tiny_model_dir,
        "two",
        2,
        "training.distributed_strategy=ddp",
        "training.micro_batch_size=4",
        "training.gradient_accumulation_steps=2",
        *LORA,
    )
    assert any(".lora_" in k for k in one)
    assert_same(two, one, "ddp lora")
