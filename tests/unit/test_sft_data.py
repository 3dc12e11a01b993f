"""SFT: the masked NLL against hand-computed values, and the data encoding (which tokens the loss
covers, GRPO's prompt and format, chat and file layouts, errors that name file:line)."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.algorithms.sft import sft_loss
from tandem.config import DEFAULT_SYSTEM_PROMPT
from tandem.data import arithmetic
from tandem.data.prompts import render_prompt
from tandem.data.sft import (
    PromptStyle,
    SFTExample,
    encode_example,
    encode_examples,
    example_from_row,
    load_sft_splits,
    worked_example,
)
from tandem.rewards.gsm8k import answer_reward, format_reward
from tiny_models import make_tiny_tokenizer

STYLE = PromptStyle(DEFAULT_SYSTEM_PROMPT, num_shots=1, prefill="<think>")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


# --------------------------------------------------------------------------- the loss


def test_sft_loss_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # masked NLL sum = 1 + 2 + 0.5 = 3.5 over 3 loss tokens -> 3.5 / 3 = 1.1666...
    loss, stats = sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx(3.5 / 3)
    assert stats == {"num_tokens": 3.0, "nll_sum": 3.5, "nll": pytest.approx(3.5 / 3)}
    # a global count of 7 tokens (this micro-batch is part of a bigger step): 3.5 / 7 = 0.5
    loss, stats = sft_loss(logprobs, mask, normalizer=7)
    assert loss.item() == pytest.approx(0.5)
    assert stats["nll"] == pytest.approx(3.5 / 3)  # the stats stay this batch's own


def test_sft_loss_gradient_and_split_batches():
    logprobs = torch.randn(4, 5, generator=torch.Generator().manual_seed(0)).clamp(max=0).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    loss, _ = sft_loss(logprobs, mask)
    loss.backward()
    # d loss / d logp = -mask / num_tokens (12 loss tokens)
    torch.testing.assert_close(logprobs.grad, -mask.float() / 12)
    # two halves normalised by the global count sum to the whole batch's token mean
    halves = [sft_loss(logprobs[i : i + 2], mask[i : i + 2], normalizer=12)[0] for i in (0, 2)]
    torch.testing.assert_close(halves[0] + halves[1], loss)


def test_sft_loss_edge_cases():
    loss, stats = sft_loss(torch.full((2, 3), -1.0), torch.zeros(2, 3))
    assert loss.item() == 0.0 and stats["nll"] == 0.0  # no loss tokens: 0, not NaN
    with pytest.raises(ValueError, match="must both be"):
        sft_loss(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        sft_loss(torch.zeros(2, 3), torch.ones(2, 3), normalizer=0)


# --------------------------------------------------------------------------- encoding


def masked_text(tokenizer, encoded) -> str:
    return tokenizer.decode([i for i, m in zip(encoded.input_ids, encoded.loss_mask) if m])


def test_worked_example_is_grpo_prompt_and_rewarded_completion(tokenizer):
    problem = arithmetic.make_examples(3, seed=0)[1]
    example = worked_example(tokenizer, problem, STYLE)
    encoded = encode_example(tokenizer, example, max_length=4096)
    prompt = render_prompt(tokenizer, problem.question, STYLE.system_prompt, 1, "<think>")
    # the prompt's tokens are exactly what the GRPO sampler feeds the model (rollout.py)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert encoded.input_ids[: len(prompt_ids)] == prompt_ids
    # the mask covers exactly the completion: every token after the prompt, eos included
    assert encoded.loss_mask == [0] * len(prompt_ids) + [1] * (len(encoded.input_ids) - len(prompt_ids))
    assert encoded.input_ids[-1] == tokenizer.eos_token_id
    completion = tokenizer.decode(encoded.input_ids[len(prompt_ids) : -1])
    # GRPO scores prefill + completion: the worked answer earns both rewards in full
    assert format_reward("<think>" + completion) == 1.25
    assert answer_reward("<think>" + completion, problem.answer) == 1.0
    assert f"</think><answer> {problem.answer} </answer>" in completion


def test_prefill_that_worked_answers_cannot_follow_is_refused(tokenizer):
    problem = arithmetic.make_examples(1, seed=0)[0]
    with pytest.raises(ValueError, match="data.prefill"):
        worked_example(tokenizer, problem, PromptStyle("", 0, "Answer:"))
    no_prefill = worked_example(tokenizer, problem, PromptStyle("", 0, ""))
    assert no_prefill.segments[1][0].startswith("<think> ")


def test_chat_messages_train_every_assistant_turn(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and 3 + 5?"},
            {"role": "assistant", "content": "8"},
        ]
    }
    example = example_from_row(tokenizer, row, "chat.jsonl:1", STYLE)
    assert example.segments == [
        (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n",
            False,
        ),
        ("4<|im_end|>", True),
        ("\n<|im_start|>user\nand 3 + 5?<|im_end|>\n<|im_start|>assistant\n", False),
        ("8<|im_end|>", True),
    ]
    encoded = encode_example(tokenizer, example, max_length=512)
    assert masked_text(tokenizer, encoded) == "4<|im_end|>8<|im_end|>"
    # the whole text is the chat template's rendering, minus the newline after the last eos
    full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert tokenizer.decode(encoded.input_ids) == full.rstrip("\n")


def test_prompt_completion_layouts_agree(tokenizer):
    strings = {"prompt": "Say hi.", "completion": "hi there"}
    messages = {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "completion": [{"role": "assistant", "content": "hi there"}],
    }
    chat = {"messages": messages["prompt"] + messages["completion"]}
    encoded = [
        encode_example(tokenizer, example_from_row(tokenizer, row, "f:1", STYLE), max_length=512)
        for row in (strings, messages, chat)
    ]
    assert encoded[0] == encoded[1] == encoded[2]
    assert masked_text(tokenizer, encoded[0]) == "hi there<|im_end|>"
    # a prompt holding an assistant turn (a few-shot example) is context, not a target
    shot = {
        "prompt": [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2 + 3?"},
        ],
        "completion": "5",
    }
    assert (
        masked_text(
            tokenizer,
            encode_example(tokenizer, example_from_row(tokenizer, shot, "f:2", STYLE), max_length=512),
        )
        == "5<|im_end|>"
    )


def test_tokenizer_without_chat_template_uses_the_plain_layout():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = None
    example = example_from_row(tokenizer, {"prompt": "Say hi.", "completion": "hi"}, "f:1", STYLE)
    assert example.segments == [("User: Say hi.\nAssistant: ", False), ("hi<|im_end|>", True)]


def test_completion_only_loss_false_and_truncation(tokenizer):
    example = SFTExample([("a b c d", False), ("e f", True)])
    ids = tokenizer("a b c d", add_special_tokens=False)["input_ids"]
    full = encode_example(tokenizer, example, max_length=100, completion_only_loss=False)
    assert full.loss_mask == [0] + [1] * (len(full.input_ids) - 1)  # every token but the first
    cut = encode_example(tokenizer, example, max_length=len(ids) + 1)
    assert cut.input_ids == full.input_ids[: len(ids) + 1]  # cut from the end
    assert cut.num_targets == 1
    # an example whose prompt fills max_length keeps no target: left out, and all left out is an error
    kept = encode_examples(
        tokenizer,
        [example, SFTExample([("x", False), ("y", True)])],
        max_length=len(ids),
        completion_only_loss=True,
        what="train",
    )
    assert len(kept) == 1
    with pytest.raises(ValueError, match="sft.max_length"):
        encode_examples(tokenizer, [example], max_length=len(ids), completion_only_loss=True, what="train")


# --------------------------------------------------------------------------- files and splits


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"prompt": "Say hi.", "completion": "hi"}


@pytest.mark.parametrize(
    "bad, match",
    [
        ("{not json", "not valid JSON"),
        ({"text": "hello"}, "needs `messages`, or `prompt` and `completion`"),
        ({"prompt": "hi", "completion": 3}, "`completion` must be a string or a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"`messages\[0\]` must be a message"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role` is 'robot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn to train on"),
        ({"question": "1 + 1?", "answer": "2"}, "no '#### N' line"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_rows_name_file_and_line(tokenizer, tmp_path, bad, match):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(ValueError, match=match) as err:
        load_sft_splits(
            tokenizer, path, split="train", num_examples=0, eval_dataset=None, num_eval_examples=0,
            seed=0, difficulty=1, style=STYLE,
        )  # fmt: skip
    assert f"{path}:3" in str(err.value)


def test_file_held_out_slice_and_gsm8k_rows(tokenizer, tmp_path):
    rows = [{"prompt": f"Say {i}.", "completion": str(i)} for i in range(20)]
    rows.append(
        {"question": "Ana has 2 cats and gets 3 more. How many now?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}
    )
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    kw = dict(split="train", eval_dataset=None, seed=0, difficulty=1, style=STYLE)
    train, held = load_sft_splits(tokenizer, path, num_examples=0, num_eval_examples=100, **kw)
    assert len(held) == 21 // 5 and len(train) == 21 - 4  # at most a fifth of the rows is held out
    sources = [e.source for e in train + held]
    assert len(set(sources)) == 21  # disjoint, and together every row
    gsm = next(e for e in train + held if e.source.endswith(":21"))
    assert gsm.segments[1] == (" 2 + 3 = 5 </think><answer> 5 </answer><|im_end|>", True)
    # the same seed holds out the same rows; num_examples caps the training rows
    train2, held2 = load_sft_splits(tokenizer, path, num_examples=5, num_eval_examples=100, **kw)
    assert [e.source for e in held2] == [e.source for e in held] and len(train2) == 5
    # an eval file replaces the held-out slice
    eval_path = write_jsonl(tmp_path / "eval.jsonl", rows[:3])
    train3, held3 = load_sft_splits(
        tokenizer, path, num_examples=0, num_eval_examples=2, **{**kw, "eval_dataset": eval_path}
    )
    assert len(train3) == 21 and [e.source for e in held3] == [f"{eval_path}:1", f"{eval_path}:2"]


def test_synthetic_splits_are_disjoint(tokenizer):
    train, held = load_sft_splits(
        tokenizer, "synthetic", split="train", num_examples=40, eval_dataset=None, num_eval_examples=10,
        seed=0, difficulty=1, style=STYLE,
    )  # fmt: skip
    assert len(train) == 40 and len(held) == 10
    assert not {e.segments[0][0] for e in train} & {e.segments[0][0] for e in held}


def test_parquet_rows(tokenizer, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, {"prompt": "x"}]), path)
    with pytest.raises(ValueError, match=f"{path}:row 1"):
        load_sft_splits(
            tokenizer, str(path), split="train", num_examples=0, eval_dataset=None, num_eval_examples=0,
            seed=0, difficulty=1, style=STYLE,
        )  # fmt: skip


def test_unknown_source_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="data.dataset"):
        load_sft_splits(
            tokenizer, "no_such_file.jsonl", split="train", num_examples=0, eval_dataset=None,
            num_eval_examples=0, seed=0, difficulty=1, style=STYLE,
        )  # fmt: skip
