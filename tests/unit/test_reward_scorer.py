"""models/reward.py and the `type: model` reward on a tiny random model: the last-token score does not
depend on padding, matches Hugging Face's own sequence-classification forward, and the frozen scorer
(alone and as a GRPO reward component) gives the same numbers in any batch size."""

from __future__ import annotations

import pytest
import torch

from tandem.config import LoraSpec, RewardSpec
from tandem.data.preferences import encode_answer, encode_prompt
from tandem.models.reward import RewardScorer, ScoreModule, load_reward_model, pad_right
from tandem.rewards.registry import RewardSet
from tandem.types import Example


@pytest.fixture(scope="module")
def reward_dir(tiny_model_dir, tmp_path_factory):
    """A tiny reward model folder: the tiny causal LM with a seeded random scalar head."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = load_reward_model(str(tiny_model_dir))
    with torch.no_grad():  # a head of unit scale, so scores differ visibly between answers
        model.score.weight.normal_(0.0, 1.0)
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def test_pad_right():
    input_ids, lengths = pad_right([[5, 6, 7], [8]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [8, 0, 0]] and lengths.tolist() == [3, 1]


def test_score_ignores_padding_and_equals_hf_forward(reward_dir):
    model = load_reward_model(str(reward_dir), trainable=False)
    forward = ScoreModule(model)
    sequences = [[3, 40, 41, 42, 2], [3, 50, 2], [3, 60, 61, 62, 63, 64, 65, 2]]
    alone = torch.cat([forward(*pad_right([s], 0)) for s in sequences])
    for pad_id in (0, 1, 17):  # whatever id pads, the last real token's state is the same
        together = forward(*pad_right(sequences, pad_id))
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
    # HF's forward pools the last token of an unpadded row: the oracle of what we compute
    for s, score in zip(sequences, alone):
        hf = model(input_ids=torch.tensor([s])).logits[0, 0]
        torch.testing.assert_close(hf, score, rtol=0, atol=1e-5)
    assert len(set(alone.tolist())) == 3


def test_reward_scorer_is_frozen_and_batch_size_free(reward_dir):
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(5)]
    answers = ["<answer> 2 </answer>", "no", "<think> 2 + 2 = 4 </think>", "", "6 6 6"]
    one = RewardScorer(str(reward_dir), batch_size=1)
    many = RewardScorer(str(reward_dir), batch_size=16)
    assert not any(p.requires_grad for p in one.model.parameters()) and not one.model.training
    scores = many.score(prompts, answers)
    torch.testing.assert_close(one.score(prompts, answers), scores, rtol=0, atol=1e-5)
    # by hand: the chat template's prompt, the answer closed by eos, the last token's score
    tok = many.tokenizer
    ids = encode_prompt(tok, prompts[2]) + encode_answer(tok, answers[2])
    assert ids[-1] == tok.eos_token_id
    torch.testing.assert_close(many.score_ids([ids]), scores[2:3], rtol=0, atol=1e-5)


def test_model_reward_component_scores_question_and_response_in_batches(reward_dir):
    examples = [Example(prompt_id=f"p{i}", question=f"What is {i} + 1?", answer=str(i + 1)) for i in range(3)]
    responses = ["<think>x</think><answer> 1 </answer>", "<answer> 2 </answer>", "3"]
    rewards = RewardSet.from_specs(
        [RewardSpec("answer"), RewardSpec("model", weight=0.5, path=str(reward_dir), name="helpful")]
    )
    assert rewards.names == ["answer", "helpful"]
    scored = rewards.score_batch(responses, examples, [[] for _ in responses])
    expected = RewardScorer(str(reward_dir)).score(
        [[{"role": "user", "content": ex.question}] for ex in examples], responses
    )
    for (total, info), rm_score, response, ex in zip(scored, expected.tolist(), responses, examples):
        assert info["helpful"] == pytest.approx(rm_score, abs=1e-5)
        assert total == pytest.approx(info["answer"] + 0.5 * info["helpful"])
        assert rewards.score(response, ex)[0] == pytest.approx(total, abs=1e-5)  # alone == in a batch
    assert [info["answer"] for _, info in scored] == [1.0, 1.0, -1.0]  # no <answer> tag: the rule says -1


def test_model_reward_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="not a model folder"):
        RewardSet.from_specs([RewardSpec("model", path=str(tmp_path))])
    with pytest.raises(ValueError, match=r"`rewards\[0\].path` is set .* set type: model"):
        RewardSet.from_specs([RewardSpec("answer", path=str(tmp_path))])


def test_lora_reward_model_trains_adapters_and_head(reward_dir):
    pytest.importorskip("peft")
    from tandem.models.lora import apply_lora

    base = ScoreModule(load_reward_model(str(reward_dir)))
    sequences = [[3, 40, 41, 2], [3, 50, 51, 52, 53, 2]]
    before = base(*pad_right(sequences, 0)).detach()
    model = apply_lora(load_reward_model(str(reward_dir)), LoraSpec(enabled=True, r=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any(".lora_" in n for n in trainable) and any("score" in n for n in trainable)
    assert all(".lora_" in n or "score" in n for n in trainable)
    forward = ScoreModule(model)
    # fresh adapters (B = 0) and a copy of the head: the wrapped model scores exactly as the base
    torch.testing.assert_close(forward(*pad_right(sequences, 0)), before, rtol=0, atol=1e-6)
    forward(*pad_right(sequences, 0)).sum().backward()
    head = [p for n, p in model.named_parameters() if "score" in n and p.requires_grad]
    assert head and all(p.grad is not None and p.grad.abs().sum() > 0 for p in head)
