"""Prompt data: the arithmetic generator, GSM8K loading, prompt rendering."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from tandem.data.arithmetic import make_examples, make_problems
from tandem.data.gsm8k import extract_gold, load_examples, load_gsm8k
from tandem.data.prompts import build_messages, render_prompt, worked_shots
from tandem.rewards.gsm8k import answer_reward, format_reward

GSM8K_DIR = Path("/work/shared/data/gsm8k")
GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"
needs_gsm8k = pytest.mark.skipif(not GSM8K_TRAIN.exists(), reason=f"{GSM8K_TRAIN} not present")

_NOTE = re.compile(r"<<(\d+)([-+*/])(\d+)=(\d+)>>")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}

# --- arithmetic generator ---------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", [1, 2])
def test_generator_is_deterministic_per_seed(difficulty: int) -> None:
    assert make_problems(300, seed=3, difficulty=difficulty) == make_problems(
        300, seed=3, difficulty=difficulty
    )
    assert make_problems(300, seed=3, difficulty=difficulty) != make_problems(
        300, seed=4, difficulty=difficulty
    )
    assert make_examples(50, seed=3, split="eval", difficulty=difficulty) == make_examples(
        50, seed=3, split="eval", difficulty=difficulty
    )


def test_default_difficulty_is_one_and_levels_differ() -> None:
    assert make_problems(50, seed=3) == make_problems(50, seed=3, difficulty=1)
    assert make_examples(20, seed=3) == make_examples(20, seed=3, difficulty=1)
    assert make_problems(50, seed=3, difficulty=1) != make_problems(50, seed=3, difficulty=2)


def test_difficulty_two_is_unchanged() -> None:
    # sha256 of the level-2 output, pinned from the generator before levels existed: runs and
    # evals made with the old data stay reproducible at difficulty=2.
    def digest(rows: object) -> str:
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()

    assert digest(make_problems(300, seed=0, difficulty=2)) == (
        "8d308f702f027c97e465828c0b020e7c3ce7af967b3818f3052e6bdf18cac62e"
    )
    held_out = make_examples(200, seed=5, split="eval", difficulty=2)
    assert digest([e.question + e.answer for e in held_out]) == (
        "d701e4357bea9e11b50b24129e028d1609cdf8520b759a905d775abdf1bb4563"
    )


@pytest.mark.parametrize("bad", [0, 3, -1, True])
def test_unknown_difficulty_is_an_error(bad: int) -> None:
    with pytest.raises(ValueError, match=r"`data.difficulty` is .*choose one of: 1 .*2 "):
        make_problems(5, seed=0, difficulty=bad)
    with pytest.raises(ValueError, match=r"`data.difficulty`"):
        make_examples(5, seed=0, difficulty=bad)


def _check_worked_solution(problem: dict) -> list[tuple[str, str, str, str]]:
    """The calculator notes of `problem`, after checking each step and the final answer."""
    notes = _NOTE.findall(problem["answer"])
    assert notes, problem
    question_numbers = {int(n) for n in re.findall(r"\d+", problem["question"])}
    results: set[int] = set()
    for a, op, b, result in notes:
        # each operand comes from the question or from an earlier step, and each step is right
        assert {int(a), int(b)} <= question_numbers | results, problem
        assert _OPS[op](int(a), int(b)) == int(result), problem
        results.add(int(result))
    gold = extract_gold(problem["answer"])
    assert gold == notes[-1][3]
    assert 0 <= int(gold) < 1000
    return notes


def test_generated_answers_follow_from_the_worked_solution() -> None:
    problems = make_problems(1000, seed=0, difficulty=2)
    assert len({p["question"] for p in problems}) == 1000  # distinct
    ops_seen, two_step = set(), 0
    for problem in problems:
        notes = _check_worked_solution(problem)
        ops_seen |= {op for _, op, _, _ in notes}
        two_step += len(notes) == 2
    assert ops_seen == {"+", "-", "*", "/"}
    assert 200 < two_step < 800


def test_level_one_is_one_step_with_small_numbers() -> None:
    problems = make_problems(1000, seed=0, difficulty=1)
    assert len({p["question"] for p in problems}) == 1000  # distinct
    ops_seen = set()
    for problem in problems:
        notes = _check_worked_solution(problem)
        assert len(notes) == 1, problem  # one step
        ((a, op, b, result),) = notes
        ops_seen.add(op)
        # first-grade sizes: operands <= 50 except a divide's total (<= 9 * 10), results <= 9 * 12
        assert all(int(n) <= 90 for n in re.findall(r"\d+", problem["question"])), problem
        assert int(result) <= 108, problem
        if op == "+":
            assert int(a) <= 40 and int(b) <= 30, problem
        elif op == "-":
            assert 10 <= int(a) <= 50 and int(result) > 0, problem
        elif op == "*":
            assert 2 <= int(a) <= 9 and 2 <= int(b) <= 12, problem
        else:
            assert 2 <= int(b) <= 10 and 2 <= int(result) <= 9, problem
    assert ops_seen == {"+", "-", "*", "/"}


def test_examples_carry_ids_and_gold() -> None:
    examples = make_examples(20, seed=1)
    assert [e.prompt_id for e in examples[:2]] == ["arith-train-0", "arith-train-1"]
    for example in examples:
        assert example.answer == extract_gold(example.metadata["solution"])
        assert example.metadata["source"] == "synthetic"


def test_level_one_train_and_held_out_are_disjoint_at_run_sizes() -> None:
    for seed in (0, 42):
        train = make_examples(2000, seed=seed, split="train", difficulty=1)
        held_out = make_examples(500, seed=seed, split="eval", difficulty=1)
        assert len({e.question for e in train}) == 2000
        assert len({e.question for e in held_out}) == 500
        assert not {e.question for e in train} & {e.question for e in held_out}


@pytest.mark.parametrize("difficulty", [1, 2])
def test_train_and_eval_never_share_a_question(difficulty: int) -> None:
    train = {e.question for e in make_examples(3000, seed=0, split="train", difficulty=difficulty)}
    for seed in (0, 1):
        held_out = make_examples(300, seed=seed, split="eval", difficulty=difficulty)
        assert held_out[0].prompt_id == "arith-eval-0"
        assert not train & {e.question for e in held_out}
    test_split = make_examples(300, seed=0, split="test", difficulty=difficulty)
    assert not train & {e.question for e in test_split}


# --- GSM8K loading ----------------------------------------------------------------------------


def test_extract_gold() -> None:
    assert extract_gold("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_gold("...\n#### 1,200") == "1200"
    assert extract_gold("#### -5") == "-5"
    with pytest.raises(ValueError, match="no '#### N'"):
        extract_gold("The answer is 72.")
    with pytest.raises(ValueError, match="not a number"):
        extract_gold("#### seventy")


@needs_gsm8k
def test_load_shared_gsm8k_train() -> None:
    examples = load_gsm8k(str(GSM8K_TRAIN))
    assert len(examples) == 7473
    first = examples[0]
    assert (first.prompt_id, first.answer) == ("gsm8k-train-0", "72")
    assert first.question.startswith("Natalia sold clips")
    assert first.metadata["solution"].endswith("#### 72")
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", e.answer) for e in examples)
    from_folder = load_gsm8k(str(GSM8K_DIR), split="train", limit=5)
    assert [e.answer for e in from_folder] == [e.answer for e in examples[:5]]


def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))


def test_load_small_jsonl(tmp_path: Path) -> None:
    rows = [
        {"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        "",  # blank lines are skipped
        {"question": "How much?", "answer": "#### 1,200"},
        {"question": "Third?", "answer": "#### 0"},
    ]
    _write_jsonl(tmp_path / "test.jsonl", rows)
    examples = load_gsm8k(str(tmp_path), split="test")
    assert [(e.prompt_id, e.answer) for e in examples] == [
        ("gsm8k-test-0", "7"),
        ("gsm8k-test-1", "1200"),
        ("gsm8k-test-2", "0"),
    ]
    assert len(load_gsm8k(str(tmp_path / "test.jsonl"), limit=2)) == 2


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"question": "Q"}, "'question' and 'answer'"),
        ({"prompt": "Q", "answer": "#### 1"}, "'question' and 'answer'"),
        ({"question": "Q", "answer": 5}, "'question' and 'answer'"),
        ({"question": "Q", "answer": "five"}, "no '#### N'"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path: Path, bad_row: object, message: str) -> None:
    path = tmp_path / "train.jsonl"
    _write_jsonl(path, [{"question": "Q", "answer": "#### 1"}, bad_row])
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: .*{re.escape(message)}"):
        load_gsm8k(str(path))


def test_missing_sources_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no train.jsonl"):
        load_gsm8k(str(tmp_path))
    with pytest.raises(ValueError, match="neither a file, a folder"):
        load_gsm8k(str(tmp_path / "nowhere.jsonl"))


def test_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")  # in the dev extra
    import pyarrow as pa

    rows = [{"question": "How many?", "answer": "#### 4"}, {"question": "And now?", "answer": "#### 1,200"}]
    for shard, row in enumerate(rows):  # the hub's layout: train-0000i-of-00002.parquet
        pq.write_table(pa.Table.from_pylist([row]), tmp_path / f"train-{shard:05d}-of-00002.parquet")
    assert [e.answer for e in load_gsm8k(str(tmp_path))] == ["4", "1200"]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([rows[0], {"question": "q", "answer": "no result"}]), bad)
    with pytest.raises(ValueError, match=rf"{re.escape(str(bad))}:row 1: .*no '#### N' line"):
        load_gsm8k(str(bad))


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch) -> None:
    for module in ("pyarrow", "pyarrow.parquet", "pandas"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed: import raises ImportError
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))} needs pyarrow: pip install pyarrow"):
        load_gsm8k(str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="would reach the hub")
def test_hub_id_without_datasets_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="pip install datasets.*local path"):
        load_gsm8k("openai/gsm8k")


def test_load_examples_dispatch(tmp_path: Path) -> None:
    synthetic = load_examples("synthetic", "train", num_examples=5, seed=0)
    assert [e.prompt_id for e in synthetic] == [f"arith-train-{i}" for i in range(5)]
    assert synthetic == make_examples(5, seed=0, difficulty=1)
    harder = load_examples("synthetic", "train", num_examples=5, seed=0, difficulty=2)
    assert harder == make_examples(5, seed=0, difficulty=2)
    _write_jsonl(tmp_path / "train.jsonl", [{"question": "Q", "answer": "#### 1"}] * 4)
    assert len(load_examples(str(tmp_path), "train", num_examples=3, seed=0)) == 3
    assert len(load_examples(str(tmp_path), "train", num_examples=0, seed=0)) == 4
    assert len(load_examples(str(tmp_path), "train", num_examples=0, seed=0, difficulty=2)) == 4  # ignored
    with pytest.raises(ValueError, match="num_examples > 0"):
        load_examples("synthetic", "train", num_examples=0, seed=0)


# --- prompts ----------------------------------------------------------------------------------

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2, "what": 3, "is": 4}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="<|im_end|>")
    tokenizer.chat_template = CHATML
    return tokenizer


def test_worked_shots_are_in_the_rewarded_format() -> None:
    shots = worked_shots(4)
    golds = ["23", "47", "8", "8"]
    assert all(answer_reward(response, gold) == 1.0 for (_, response), gold in zip(shots, golds))
    assert all(format_reward(response) == 1.25 for _, response in shots)
    assert worked_shots(0) == []
    with pytest.raises(ValueError, match="num_shots"):
        worked_shots(99)


def test_build_messages_order() -> None:
    messages = build_messages("Q?", "Be brief.", [("q1", "r1"), ("q2", "r2")])
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "Be brief."), ("user", "q1"), ("assistant", "r1"),
        ("user", "q2"), ("assistant", "r2"), ("user", "Q?"),
    ]  # fmt: skip
    assert build_messages("Q?", "", [])[0] == {"role": "user", "content": "Q?"}


def test_render_prompt_with_chat_template(tiny_tokenizer) -> None:
    text = render_prompt(
        tiny_tokenizer, "What is 2 + 2?", "Think, then answer.", num_shots=2, prefill="<think>"
    )
    assert text.startswith("<|im_start|>system\nThink, then answer.<|im_end|>\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    for question, response in worked_shots(2):
        assert f"<|im_start|>user\n{question}<|im_end|>" in text
        assert f"<|im_start|>assistant\n{response}<|im_end|>" in text
    assert text.index(worked_shots(2)[1][1]) < text.index("What is 2 + 2?")
    assert worked_shots(3)[2][0] not in text


def test_render_prompt_without_chat_template(tiny_tokenizer) -> None:
    tiny_tokenizer.chat_template = None
    text = render_prompt(tiny_tokenizer, "What is 2 + 2?", "Be brief.", num_shots=1, prefill="<think>")
    question, response = worked_shots(1)[0]
    expected = (
        f"System: Be brief.\nUser: {question}\nAssistant: {response}\nUser: What is 2 + 2?\nAssistant: "
    )
    assert text == expected + "<think>"
