"""Reward functions: exact match for arithmetic/reverse, last-number numeric check for GSM8K-style JSONL."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcommon.rewards import (
    REWARD_KINDS,
    char_accuracy_reward,
    exact_match_reward,
    numeric_reward,
    parse_last_number,
    reward,
)


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("7", "7", 1.0),
        (" 7 \n", "7", 1.0),
        ("7", " 7", 1.0),
        ("07", "7", 0.0),
        ("7 ", "17", 0.0),
        ("", "7", 0.0),
        ("cba", "cba", 1.0),
        ("cb a", "cba", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert exact_match_reward(response, answer) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("the answer is 42.", 42.0),
        ("first 12 then 13", 13.0),
        ("1,234", 1234.0),
        ("$1,234.50 total", 1234.5),
        ("-3", -3.0),
        ("it is .5", 0.5),
        ("1,2,3", 3.0),
        ("no digits", None),
        ("", None),
    ],
)
def test_parse_last_number(text, value):
    assert parse_last_number(text) == value


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is 72.", "72", 1.0),
        ("#### 72", "72", 1.0),
        ("1,234", "1234", 1.0),
        ("1234", "1,234", 1.0),
        ("3.50", "3.5", 1.0),
        ("0.30000000000000004", "0.3", 1.0),
        ("72.01", "72", 0.0),
        ("-5", "5", 0.0),
        ("72 apples, no 73", "72", 0.0),
        ("I don't know", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_numeric_reward(response, answer, expected):
    assert numeric_reward(response, answer) == expected


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("dcba", "dcba", 1.0),
        (" dcba\n", "dcba", 1.0),
        ("dcbx", "dcba", 0.75),
        ("dcb", "dcba", 0.75),  # one letter missing
        ("dcbaaaaa", "dcba", 0.5),  # running on past the answer costs the extra letters
        ("abcd", "dcba", 0.0),
        ("", "dcba", 0.0),
    ],
)
def test_char_accuracy_reward(response, answer, expected):
    assert char_accuracy_reward(response, answer) == expected


def test_char_accuracy_reward_needs_an_answer():
    with pytest.raises(ValueError, match="answer is empty"):
        char_accuracy_reward("abc", " ")


def test_numeric_reward_needs_a_numeric_answer():
    with pytest.raises(ValueError, match="holds no number"):
        numeric_reward("42", "forty-two")


def test_reward_dispatch_by_kind():
    assert reward("arithmetic", " 12", "12") == 1.0
    assert reward("reverse", "cba", "abc") == 0.0
    assert reward("jsonl", "so 3,000 in all", "3000") == 1.0
    assert reward("reverse_long", "cbx", "cba") == pytest.approx(2 / 3)
    assert set(REWARD_KINDS) == {"arithmetic", "reverse", "reverse_long", "jsonl"}


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="unknown reward kind 'gsm9k'.*arithmetic, reverse, reverse_long, jsonl"):
        reward("gsm9k", "1", "1")


BINARY_KINDS = tuple(k for k in REWARD_KINDS if k != "reverse_long")


@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(BINARY_KINDS), response=st.text(max_size=40), answer=st.integers(-(10**6), 10**6))
def test_reward_is_zero_or_one_for_any_text(kind, response, answer):
    value = reward(kind, response, str(answer))
    assert value in (0.0, 1.0)
    assert reward(kind, str(answer), str(answer)) == 1.0


@settings(max_examples=200, deadline=None)
@given(response=st.text(max_size=40), answer=st.text(alphabet="abcxyz", min_size=1, max_size=40))
def test_reverse_long_reward_is_a_share_that_is_whole_only_for_the_answer(response, answer):
    value = reward("reverse_long", response, answer)
    assert 0.0 <= value <= 1.0
    assert (value == 1.0) == (response.strip() == answer)
    assert reward("reverse_long", answer, answer) == 1.0
