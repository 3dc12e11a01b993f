"""Preference data: the synthetic sets (held-out splits share nothing with train), file layouts, safety
labels, errors."""

from __future__ import annotations

import json

import pytest

from tandem.data.preferences import encode_pair, fit, load_preferences, make_preferences, pair_from_row


def test_synthetic_sets_are_seeded_and_held_out_splits_share_nothing_with_train():
    assert make_preferences("mixed", 30, seed=1) == make_preferences("mixed", 30, seed=1)
    train, held_out = (
        make_preferences("mixed", 300, seed=0),
        make_preferences("mixed", 120, seed=0, split="eval"),
    )
    questions = lambda pairs: {p.prompt[-1]["content"] for p in pairs}  # noqa: E731
    answers = lambda pairs: {a for p in pairs if "arithmetic" not in p.source for a in (p.chosen, p.rejected)}  # noqa: E731
    assert not questions(train) & questions(held_out)
    assert not answers(train) & answers(held_out), "held-out answers use phrasings never trained on"
    kinds = {p.source for p in train}
    assert kinds == {"synthetic-arithmetic", "synthetic-harmful", "synthetic-everyday"}


def test_arithmetic_pairs_differ_only_in_a_wrong_result():
    for pair in make_preferences("helpful", 40, seed=3):
        if pair.source != "synthetic-arithmetic":
            assert pair.chosen_is_safer is False  # a useful answer over a needless refusal
            continue
        good = pair.chosen.split("<answer>")[1].split("</answer>")[0].strip()
        bad = pair.rejected.split("<answer>")[1].split("</answer>")[0].strip()
        assert good != bad and int(bad) >= 0
        # the same reasoning up to the last equation's result, which is the wrong answer
        assert pair.chosen.rpartition(f"= {good}")[0] == pair.rejected.rpartition(f"= {bad}")[0] != ""


def test_harmless_pairs_prefer_the_refusal():
    pairs = make_preferences("harmless", 20, seed=0)
    assert all(p.chosen_is_safer is True and "[step" in p.rejected for p in pairs)


def test_synthetic_answers_are_labelled_safe_unless_they_comply_with_harm():
    for split in ("train", "test"):
        for pair in make_preferences("mixed", 60, seed=2, split=split):
            harmful = pair.source == "synthetic-harmful"
            # harmful: refusal safe, compliance unsafe; everyday (both answers) and arithmetic: safe
            assert (pair.chosen_is_safe, pair.rejected_is_safe) == (True, not harmful), pair.source
    assert all(p.rejected_is_safe is False for p in make_preferences("harmless", 10, seed=0))


def test_safety_labels_in_files(tiny_model_dir):
    trl = pair_from_row(
        {"prompt": "q", "chosen": "a", "rejected": "b", "chosen_is_safe": True, "rejected_is_safe": False},
        "f",
    )
    assert (trl.chosen_is_safe, trl.rejected_is_safe, trl.chosen_is_safer) == (True, False, None)
    one = pair_from_row({"prompt": "q", "chosen": "a", "rejected": "b", "rejected_is_safe": None}, "f")
    assert (one.chosen_is_safe, one.rejected_is_safe) == (None, None)  # null = unknown
    pku = {
        "prompt": "q",
        "response_0": "a",
        "response_1": "b",
        "better_response_id": 1,
        "safer_response_id": 0,
        "is_response_0_safe": True,
        "is_response_1_safe": False,
    }
    # the labels follow their responses: helpful chose response_1, harmless response_0
    helpful, harmless = pair_from_row(pku, "p", task="helpful"), pair_from_row(pku, "p", task="harmless")
    assert (helpful.chosen, helpful.chosen_is_safe, helpful.rejected_is_safe) == ("b", False, True)
    assert (harmless.chosen, harmless.chosen_is_safe, harmless.rejected_is_safe) == ("a", True, False)
    del pku["is_response_1_safe"]
    assert pair_from_row(pku, "p", task="harmless").rejected_is_safe is None
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"}
    assert (pair_from_row(hh, "h").chosen_is_safe, pair_from_row(hh, "h").rejected_is_safe) == (None, None)

    from tandem.models.loading import load_tokenizer

    encoded = encode_pair(load_tokenizer(str(tiny_model_dir)), harmless, max_length=64)
    assert (encoded.chosen_is_safer, encoded.chosen_is_safe, encoded.rejected_is_safe) == (True, True, False)


def test_row_layouts():
    trl = pair_from_row(
        {"prompt": "hi?", "chosen": "hello", "rejected": "go", "chosen_is_safer": True}, "f:1"
    )
    assert (
        trl.prompt == [{"role": "user", "content": "hi?"}] and trl.chosen == "hello" and trl.chosen_is_safer
    )
    chat = pair_from_row(
        {
            "prompt": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi?"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go"}],
        },
        "f:2",
    )
    assert len(chat.prompt) == 2 and (chat.chosen, chat.rejected) == ("hello", "go")
    pku = {
        "prompt": "q",
        "response_0": "a",
        "response_1": "b",
        "better_response_id": 1,
        "safer_response_id": 0,
    }
    helpful, harmless = pair_from_row(pku, "p", task="helpful"), pair_from_row(pku, "p", task="harmless")
    assert (helpful.chosen, helpful.rejected, helpful.chosen_is_safer) == ("b", "a", False)
    assert (harmless.chosen, harmless.rejected, harmless.chosen_is_safer) == ("a", "b", True)
    hh = pair_from_row(
        {
            "chosen": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: well",
            "rejected": "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: how are you?\n\nAssistant: go away",
        },
        "h",
    )
    assert [m["role"] for m in hh.prompt] == ["user", "assistant", "user"]
    assert (hh.chosen, hh.rejected) == ("well", "go away")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "q", "chosen": "a"}, "needs `chosen` and `rejected`"),
        ({"chosen": "a", "rejected": "b"}, "no `prompt`"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "`prompt` must be a string"),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "chosen_is_safer": "yes"}, "chosen_is_safer"),
        (
            {"prompt": "q", "chosen": "a", "rejected": "b", "chosen_is_safe": 1},
            "`chosen_is_safe` must be true",
        ),
        (
            {"prompt": "q", "chosen": "a", "rejected": "b", "rejected_is_safe": "no"},
            "`rejected_is_safe` must be",
        ),
        (
            {
                "prompt": "q",
                "response_0": "a",
                "response_1": "b",
                "better_response_id": 0,
                "safer_response_id": 0,
                "is_response_1_safe": "unsafe",
            },
            "`is_response_1_safe` must be true, false or absent",
        ),
        (
            {"chosen": "\n\nHuman: a\n\nAssistant: x", "rejected": "\n\nHuman: b\n\nAssistant: y"},
            "differ only in the last answer",
        ),
    ],
)
def test_bad_rows_name_the_place_and_the_fix(row, message):
    with pytest.raises(ValueError, match="f.jsonl:7") as err:
        pair_from_row(row, "f.jsonl:7")
    assert message in str(err.value)


def test_files_load_with_line_numbers_in_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "q1", "chosen": "a", "rejected": "b"},
        {"prompt": "q2", "chosen": "c", "rejected": "d"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"p.jsonl:3: not valid JSON"):
        load_preferences(str(path))
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert [p.chosen for p in load_preferences(str(path), num_examples=1)] == ["a"]
    with pytest.raises(ValueError, match="neither synthetic"):
        load_preferences(str(tmp_path / "missing.jsonl"))


def test_parquet_files_load_with_row_numbers_in_errors(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")  # in the dev extra
    import pyarrow as pa

    path = tmp_path / "p.parquet"
    rows = [
        {"prompt": "q1", "chosen": "a", "rejected": "b"},
        {"prompt": "q2", "chosen": "c", "rejected": "d"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert [(p.chosen, p.rejected) for p in load_preferences(str(path))] == [("a", "b"), ("c", "d")]
    pq.write_table(pa.Table.from_pylist([*rows, {"prompt": "q3", "chosen": "e", "rejected": None}]), path)
    with pytest.raises(ValueError, match=f"{path}:row 2"):
        load_preferences(str(path))


def test_fit_cuts_the_prompt_start_then_the_answers_end():
    prompt, (a, b) = fit(list(range(10)), [[1] * 8, [2] * 3], max_length=12)
    # the longest answer (8) leaves 4 for the prompt, but a prompt keeps at least half the budget (6)
    assert prompt == list(range(4, 10)) and a == [1] * 6 and b == [2] * 3
    assert fit([1, 2], [[3]], 10) == ([1, 2], [[3]])


def test_encode_pair_closes_answers_with_eos(tiny_model_dir):
    from tandem.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    pair = make_preferences("helpful", 1, seed=0)[0]
    encoded = encode_pair(tokenizer, pair, max_length=512)
    assert encoded.chosen_ids[-1] == tokenizer.eos_token_id == encoded.rejected_ids[-1]
    assert tokenizer.decode(encoded.chosen_ids[:-1]) == pair.chosen
    assert "<|im_start|>assistant" in tokenizer.decode(encoded.prompt_ids)
