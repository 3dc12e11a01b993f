"""Any prompt data set for GRPO/PPO (data/prompt_sets.py, data/prompts.py): rows with their own prompt
(text or chat) in every file form, their columns carried along, GSM8K and the synthetic set through
the same path, the prompt format settings per kind of row, and bad rows named by place and column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import DEFAULT_SYSTEM_PROMPT, DataConfig
from tandem.data.prompt_sets import load_examples
from tandem.data.prompts import (
    PromptStyle,
    example_messages,
    prompt_style,
    render_example,
    set_chat_template,
    worked_shots,
)
from tandem.sampler.rollout import loggable_columns
from tandem.types import Example

CHAT = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 2 + 3?"},
]
ROWS = [
    {"prompt": CHAT, "solution": "5", "level": 1, "tags": ["add"]},
    {"prompt": [{"role": "user", "content": "What is 4 * 4?"}], "solution": "16", "level": 2, "tags": []},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_chat_rows_keep_their_prompt_and_every_other_column(tmp_path):
    examples = load_examples(str(write_jsonl(tmp_path / "tasks.jsonl", ROWS)), "train", 0, seed=0)
    first, second = examples
    assert first.prompt == CHAT and first.question == "What is 2 + 3?"
    assert first.columns == {"solution": "5", "level": 1, "tags": ["add"]}
    assert first.answer == "5" and second.answer == "16"
    assert first.prompt_id == "tasks-train-0" and second.prompt_id == "tasks-train-1"
    assert load_examples(str(tmp_path / "tasks.jsonl"), "train", 1, seed=0) == [first]  # a cap


def test_text_prompts_and_a_renamed_column(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"query": "Complete: 1, 2, 3,", "target": "4"}])
    (example,) = load_examples(str(path), "train", 0, seed=0, prompt_column="query")
    assert example.prompt == "Complete: 1, 2, 3," and example.columns == {"target": "4"}
    assert example.answer == ""  # no solution column: no gold answer


@pytest.mark.parametrize("suffix", [".json", ".csv", ".parquet"])
def test_other_file_forms_give_the_same_examples(tmp_path, suffix):
    rows = [{"prompt": "What is 2 + 3?", "solution": "5"}, {"prompt": "What is 4 * 4?", "solution": "16"}]
    path = tmp_path / f"tasks{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        path.write_text('prompt,solution\nWhat is 2 + 3?,5\n"What is 4 * 4?",16\n')
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        pq.write_table(pa.Table.from_pylist(rows), path)
    examples = load_examples(str(path), "train", 0, seed=0)
    assert [(e.prompt, e.columns) for e in examples] == [
        (r["prompt"], {"solution": r["solution"]}) for r in rows
    ]


def test_a_folder_saved_by_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "saved"))
    examples = load_examples(str(tmp_path / "saved"), "train", 0, seed=0)
    assert [e.prompt for e in examples] == [r["prompt"] for r in ROWS]
    with pytest.raises(ValueError, match="splits \\['train'\\], not 'test'"):
        load_examples(str(tmp_path / "saved"), "test", 0, seed=0)


def test_gsm8k_and_synthetic_rows_are_built_from_the_question_with_a_solution_column(tmp_path):
    gsm = write_jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"}],
    )
    (example,) = load_examples(str(gsm), "train", 0, seed=0)
    assert example.prompt is None and example.answer == "7"
    assert example.columns == {"answer": "3+4=7\n#### 7", "solution": "7"}
    synthetic = load_examples("synthetic", "train", 3, seed=0)
    assert all(e.prompt is None and e.columns == {"solution": e.answer} for e in synthetic)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (
            [{"prompt": [{"role": "user", "text": "hi"}]}],
            r"t\.jsonl:1: column `prompt`, message 0: needs a string `content`",
        ),
        (
            [{"prompt": [{"role": "robot", "content": "hi"}]}],
            r"t\.jsonl:1: column `prompt`, message 0: role 'robot'",
        ),
        ([{"prompt": "  "}], r"t\.jsonl:1: column `prompt` is empty"),
        (
            [{"prompt": [{"role": "system", "content": "x"}]}],
            r"t\.jsonl:1: column `prompt` has no user message",
        ),
        (
            [{"prompt": 7}],
            r"t\.jsonl:1: column `prompt` must be a non-empty string or a list of chat messages",
        ),
        ([{"prompt": "a"}, {"question": "b"}], r"t\.jsonl:2: no `prompt` column \(data\.prompt_column\)"),
        ([{"text": "a", "label": 1}], r"t\.jsonl:1: no `prompt` column .* columns are \['label', 'text'\]"),
        (
            [{"question": "q", "answer": "no gold"}],
            r"t\.jsonl:1: column `answer`: GSM8K answer has no '#### N'",
        ),
    ],
)
def test_a_bad_row_is_named_by_place_and_column(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        load_examples(str(path), "train", 0, seed=0)


# --------------------------------------------------------------------------- the prompt format


def test_unset_settings_are_the_math_tasks_for_question_rows_and_nothing_for_own_prompts():
    data = DataConfig()
    math = prompt_style(data, from_question=True)
    assert math == PromptStyle(DEFAULT_SYSTEM_PROMPT, tuple(worked_shots(1)), "<think>")
    assert prompt_style(data, from_question=False) == PromptStyle("", (), "")
    explicit = DataConfig(system_prompt="Be brief.", num_shots=0, prefill="")
    assert prompt_style(explicit, from_question=True) == PromptStyle("Be brief.", (), "")
    assert prompt_style(explicit, from_question=False) == PromptStyle("Be brief.", (), "")


def test_shots_come_from_a_file(tmp_path):
    shots = tmp_path / "shots.jsonl"
    write_jsonl(shots, [{"prompt": "1+1?", "completion": "2"}, {"prompt": "2+2?", "completion": "4"}])
    every = prompt_style(DataConfig(shots=str(shots)), from_question=False)
    assert every.shots == (("1+1?", "2"), ("2+2?", "4"))
    assert prompt_style(DataConfig(shots=str(shots), num_shots=1), from_question=True).shots == (
        ("1+1?", "2"),
    )
    with pytest.raises(ValueError, match="num_shots is 3 but data.shots .* hold 2"):
        prompt_style(DataConfig(shots=str(shots), num_shots=3), from_question=False)
    write_jsonl(shots, [{"prompt": "1+1?"}])
    with pytest.raises(ValueError, match=r"shots\.jsonl:1: a shot is"):
        prompt_style(DataConfig(shots=str(shots)), from_question=False)


def test_a_shot_can_be_a_whole_exchange_with_a_tool_call(tmp_path):
    """A worked example of a tool call for agent runs: {"messages": [user, assistant, tool,
    assistant]} becomes those chat turns before the question; the built-in sets go by name."""
    exchange = [
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    shots = tmp_path / "shots.jsonl"
    write_jsonl(shots, [{"messages": exchange}, {"prompt": "1+1?", "completion": "2"}])
    style = prompt_style(DataConfig(shots=str(shots), system_prompt="S"), from_question=True)
    messages = example_messages(Example("p", "4 + 4?", "8"), style)
    assert messages == [
        {"role": "system", "content": "S"},
        *exchange,
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "4 + 4?"},
    ]
    chat = example_messages(Example("p", "", "8", prompt=list(CHAT)), style)
    assert chat == [
        CHAT[0],
        *exchange,
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        CHAT[1],
    ]
    builtin = prompt_style(DataConfig(shots="calculator", num_shots=3), from_question=True)
    assert all(shot[0]["role"] == "user" and shot[2]["role"] == "tool" for shot in builtin.shots)
    assert "calculator" in builtin.shots[0][1]["content"]
    for bad in (
        exchange[:1],
        [{"role": "tool", "content": "5"}, *exchange[1:]],
        [{"role": "user"}, exchange[1]],
    ):
        write_jsonl(shots, [{"messages": bad}])
        with pytest.raises(ValueError, match=r"shots\.jsonl:1: a shot's messages are"):
            prompt_style(DataConfig(shots=str(shots)), from_question=False)
    with pytest.raises(ValueError, match="no such file, nor a built-in set .*arithmetic, calculator"):
        prompt_style(DataConfig(shots="calculater"), from_question=False)


@pytest.fixture
def tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "<|im_end|>": 1}, unk_token="[UNK]"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def row(prompt) -> Example:
    return Example("p", "q", "", prompt=prompt)


def test_a_chat_row_gets_the_configured_system_prompt_and_shots_around_its_own_turns():
    style = PromptStyle("Be brief.", (("1+1?", "2"),), "")
    user_only = [{"role": "user", "content": "What is 4 * 4?"}]
    assert example_messages(row(user_only), style) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        *user_only,
    ]
    # the row's own system turn stays, the shots follow it
    assert example_messages(row(CHAT), style) == [
        CHAT[0],
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        CHAT[1],
    ]
    assert example_messages(row(CHAT), PromptStyle()) == CHAT  # nothing configured: the row as it is


def test_rendering_text_and_chat_rows(tiny_tokenizer):
    style = PromptStyle("", (), "Answer:")
    assert render_example(tiny_tokenizer, row("Complete: 1, 2,"), style) == "Complete: 1, 2,Answer:"
    text = render_example(tiny_tokenizer, row(CHAT), style)
    assert (
        text
        == tiny_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) + "Answer:"
    )


def test_a_chat_template_from_a_file_or_text(tiny_tokenizer, tmp_path):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    set_chat_template(tiny_tokenizer, template)
    assert render_example(tiny_tokenizer, row(CHAT), PromptStyle()) == (
        "[system] Answer with a number.\n[user] What is 2 + 3?\n"
    )
    (tmp_path / "t.jinja").write_text("{{ messages[-1]['content'] }}")
    set_chat_template(tiny_tokenizer, str(tmp_path / "t.jinja"))
    assert render_example(tiny_tokenizer, row(CHAT), PromptStyle()) == "What is 2 + 3?"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        set_chat_template(tiny_tokenizer, "no-such-template.jinja")


def test_columns_in_sample_logs_are_json_and_bounded():
    shown = loggable_columns({"solution": "5", "tests": "x" * 5000, "blob": b"\x00", "n": 3})
    assert shown["solution"] == "5" and shown["n"] == 3
    assert len(shown["tests"]) == 2003 and shown["tests"].endswith("...")
    assert shown["_omitted"] == ["blob"]
    many = loggable_columns({f"c{i}": "y" * 1900 for i in range(20)})
    assert len(json.dumps(many)) < 17 * 2**10 and many["_omitted"]


def test_the_shipped_configs_give_both_kinds_of_row_a_style():
    """num_shots: 1 in configs/grpo_tiny.yaml counts the built-in math shots: own prompts get none."""
    from tandem.config import load_config

    for path in ("configs/grpo_tiny.yaml", "configs/ppo_tiny.yaml", "configs/grpo_gsm8k_qwen2.5_1.5b.yaml"):
        data = load_config(path).data
        assert len(prompt_style(data, from_question=True).shots) == (
            data.num_shots if data.num_shots is not None else 1
        )
        assert prompt_style(data, from_question=False).shots == ()
    assert prompt_style(DataConfig(num_shots=3), from_question=False) == PromptStyle("", (), "")
