"""rlcommon/task/rewards.py: the built-ins (exact match, numeric, per-letter accuracy, math-verify on the last
\\boxed{}, format, DAPO's overlong penalty), user `module:function` rewards combined with weights, the failures a
user function can return, and the start-up check of `[reward]` (tests/reward_fns.py holds the user functions)."""

import math
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcommon.config import ConfigError, RewardComponent, RewardConfig, RunConfig, load_config
from rlcommon.task.rewards import (
    REWARD_KINDS,
    ResponseInfo,
    RewardFailure,
    char_accuracy_reward,
    check_components,
    default_components,
    exact_match_reward,
    format_reward,
    last_boxed,
    math_verify_reward,
    numeric_reward,
    overlong_reward,
    parse_last_number,
    reward,
    score,
)

NO_INFO = ResponseInfo()


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
    assert reward("dataset", "so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert set(REWARD_KINDS) == {"arithmetic", "reverse", "reverse_long", "jsonl", "dataset"}
    assert [c.name for k in REWARD_KINDS for c in default_components(k)] == \
        ["exact", "exact", "char_accuracy", "numeric", "math_verify"]


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="unknown reward kind 'gsm9k'.*arithmetic, reverse, reverse_long, jsonl, dataset"):
        reward("gsm9k", "1", "1")


OLD_REWARDS = {"arithmetic": exact_match_reward, "reverse": exact_match_reward, "jsonl": numeric_reward,
               "reverse_long": char_accuracy_reward}
"""The functions each toy kind's reward was before the registry: the registry's default must be them, bit for bit."""


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(sorted(OLD_REWARDS)), response=st.text(max_size=30),
       answer=st.integers(-(10**6), 10**6).map(str) | st.text(alphabet="abcxyz", min_size=1, max_size=20))
def test_the_default_reward_of_the_toy_kinds_is_bit_identical_to_the_old_functions(kind, response, answer):
    try:
        expected = OLD_REWARDS[kind](response, answer)
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err)[:20]):
            reward(kind, response, answer)
        return
    got = reward(kind, response, answer)
    assert math.copysign(1, got) == math.copysign(1, expected) and got.hex() == expected.hex()


BINARY_KINDS = tuple(k for k in REWARD_KINDS if k not in ("reverse_long", "dataset"))


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


# ------------------------------------------------------------------------------------- math-verify, format


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        (r"so \boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\dfrac12}", "1/2", 1.0),
        (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"$\sqrt{2}/2$", 1.0),  # the answer in $...$
        (r"\boxed{-\frac{1}{3}}", r"\boxed{-1/3}", 1.0),  # the answer in \boxed{}
        (r"\boxed{1,000}", "1000", 1.0),
        (r"first \boxed{3} then \boxed{4}", "4", 1.0),  # the last \boxed{} counts
        (r"first \boxed{4} then \boxed{3}", "4", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
        (r"\boxed{\pi}", "3.14159", 0.0),
        ("the answer is 4", "4", 0.0),  # no \boxed{}: no answer
        (r"\boxed{}", "4", 0.0),
        (r"\boxed{4", "4", 0.0),  # not closed
        (r"\boxed{\text{garbage}\frac{", "4", 0.0),
    ],
)
def test_math_verify_compares_the_last_boxed_answer_mathematically(response, answer, expected):
    assert math_verify_reward(response, answer) == expected


def test_math_verify_runs_in_a_thread_too():
    """Its SIGALRM timeouts need the main thread: elsewhere (an eval scored in a thread) it runs without them."""
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(math_verify_reward(r"\boxed{\frac{1}{2}}", "0.5")))
    thread.start()
    thread.join()
    assert out == [1.0]


def test_math_verify_needs_a_reference_answer():
    with pytest.raises(ValueError, match="reference answer is empty"):
        math_verify_reward(r"\boxed{1}", " $ $ ")


@pytest.mark.parametrize(
    ("text", "content"),
    [(r"\boxed{1}", "1"), (r"a \boxed{\frac{1}{2}} b", r"\frac{1}{2}"), (r"\boxed{1} \boxed{{2}}", "{2}"),
     (r"\boxed{1} \boxed{2", "1"), ("none", None), (r"\boxed{", None)],
)
def test_last_boxed(text, content):
    assert last_boxed(text) == content


def test_format_reward_wants_a_closed_boxed_answer():
    assert format_reward(r"so \boxed{7}") == 1.0
    assert format_reward(r"so \boxed{7") == 0.0
    assert format_reward("so 7") == 0.0


# ------------------------------------------------------------------------------------------------ overlong


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0)])
def test_overlong_is_dapos_soft_penalty(num_tokens, expected):
    """max_tokens 16, buffer 4: 0 up to 12 tokens, then linear down to -1 at 16."""
    assert overlong_reward(ResponseInfo(num_tokens=num_tokens, max_tokens=16), buffer=4) == expected


def test_overlong_buffer_defaults_to_a_quarter_and_needs_max_tokens():
    assert overlong_reward(ResponseInfo(num_tokens=14, max_tokens=16)) == -0.5
    assert overlong_reward(ResponseInfo(num_tokens=1, max_tokens=16), buffer=100) == pytest.approx(-1 / 16)
    with pytest.raises(ValueError, match="max_tokens is unknown"):
        overlong_reward(ResponseInfo(num_tokens=3))


# ------------------------------------------------------------------------------- components and weights

USER = "tests.reward_fns"


def components(*specs: dict) -> list[RewardComponent]:
    return [RewardComponent(**spec) for spec in specs]


def test_score_is_the_weighted_sum_and_names_each_component():
    comps = components({"name": "math_verify"}, {"name": "format", "weight": 0.1},
                       {"name": "overlong", "weight": 0.5, "params": {"buffer": 4}})
    total, values = score(comps, "dataset", r"\boxed{2}", "3", {}, ResponseInfo(num_tokens=14, max_tokens=16))
    assert values == {"math_verify": 0.0, "format": 1.0, "overlong": -0.5}
    assert total == pytest.approx(0.1 - 0.25)


def test_a_user_function_dict_is_one_component_per_key_summed():
    comps = components({"name": f"{USER}:parts", "weight": 2.0}, {"name": "exact"})
    total, values = score(comps, "arithmetic", "12", "12", {}, NO_INFO)
    assert values == {f"{USER}:parts/exact": 1.0, f"{USER}:parts/short": 1.0, "exact": 1.0}
    assert total == 2.0 * (1.0 + 1.0) + 1.0


def test_answer_field_scores_against_an_extras_column():
    comps = components({"name": "exact", "params": {"answer_field": "solution"}}, {"name": f"{USER}:with_solution"})
    assert score(comps, "dataset", "42", "the row's answer", {"solution": "42"}, NO_INFO) == \
        (2.0, {"exact": 1.0, f"{USER}:with_solution": 1.0})
    with pytest.raises(KeyError, match="no extras column 'solution'"):
        score(comps, "dataset", "42", "x", {}, NO_INFO)


@pytest.mark.parametrize(
    ("function", "failure"),
    [("returns_string", "wrong_type"), ("returns_nan", "non_finite"), ("too_many_keys", "wrong_type"),
     ("slash_key", "wrong_type")],
)
def test_a_user_function_that_returns_no_number_fails_by_kind(function, failure):
    with pytest.raises(RewardFailure, match=function) as err:
        score(components({"name": f"{USER}:{function}"}), "arithmetic", "1", "1", {}, NO_INFO)
    assert err.value.kind == failure


def test_a_rewards_values_fit_a_rollout_and_their_statistics_the_coordinator():
    """At most 8 components of at most 8 values each: the 64 a Rollout's reward_components holds; the longest
    name (a 96-character component, '/', a 24-character key) is a wire key and, with `reward/`, a statistic."""
    from rlcommon.config.reward import MAX_COMPONENT_NAME_CHARS, MAX_COMPONENTS
    from rlcommon.task.rewards import MAX_KEY_CHARS, MAX_KEYS
    from rlcommon.wire import MAX_COMPONENT_KEY_CHARS, MAX_REWARD_COMPONENTS

    assert MAX_COMPONENTS * MAX_KEYS <= MAX_REWARD_COMPONENTS
    assert MAX_COMPONENT_NAME_CHARS + 1 + MAX_KEY_CHARS <= MAX_COMPONENT_KEY_CHARS
    with pytest.raises(ConfigError, match="at most 8 items"):
        load_config(RunConfig, [], {"reward": {"components": [{"name": f"m:f{i}"} for i in range(9)]}})


def test_what_a_user_function_raises_is_passed_on():
    with pytest.raises(RuntimeError, match="this reward raises"):
        score(components({"name": f"{USER}:raises"}), "arithmetic", "1", "1", {}, NO_INFO)


# ------------------------------------------------------------------------------------ start-up checks


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("tests.no_such_module:fn", "cannot import module 'tests.no_such_module'"),
        (f"{USER}:no_such_function", f"module '{USER}' has no attribute 'no_such_function'"),
        (f"{USER}:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
    ],
)
def test_a_user_function_that_cannot_be_imported_fails_naming_it(name, message):
    with pytest.raises(ConfigError, match=f"reward component '{name}'.*") as err:
        check_components(components({"name": name}), [])
    assert message in str(err.value)


def test_the_runs_reward_is_checked_against_the_training_data_and_each_eval_set():
    from rlcommon.task.rewards import check_reward_config

    def run_config(train_extras, eval_extras):
        return load_config(RunConfig, [], {
            "task": {"kind": "dataset", "data": {"path": "train.jsonl", "extra_fields": train_extras},
                     "eval_sets": [{"name": "heldout", "path": "eval.jsonl", "extra_fields": eval_extras}]},
            "reward": {"components": [{"name": f"{USER}:with_solution"}]}})

    cfg = run_config(["solution"], ["solution"])
    check_reward_config(cfg.reward, cfg.task)
    cfg = run_config(["level"], ["solution"])
    with pytest.raises(ConfigError, match=r"needs the column\(s\) solution.*\(task.data.extra_fields: level\)"):
        check_reward_config(cfg.reward, cfg.task)
    cfg = run_config(["solution"], [])
    with pytest.raises(ConfigError, match=r"task.eval_sets\[0\].extra_fields \(heldout\)"):
        check_reward_config(cfg.reward, cfg.task)


def test_eval_pass_component_must_be_a_component_of_the_reward():
    from rlcommon.task.rewards import check_reward_config

    cfg = load_config(RunConfig, [], {"reward": {"components": [{"name": "math_verify"}, {"name": "format"}]}})
    check_reward_config(cfg.reward, cfg.task, pass_component="math_verify")
    with pytest.raises(ConfigError, match=r"eval.pass_component = 'math_verfy' is not a reward component"):
        check_reward_config(cfg.reward, cfg.task, pass_component="math_verfy")
    default = load_config(RunConfig, [], {"task": {"kind": "reverse_long"}})  # the kind's default: char_accuracy
    check_reward_config(default.reward, default.task, pass_component="char_accuracy")
    user = load_config(RunConfig, [], {
        "task": {"kind": "dataset", "data": {"path": "train.jsonl", "extra_fields": ["solution"]}},
        "reward": {"components": [{"name": f"{USER}:with_solution"}]}})
    check_reward_config(user.reward, user.task, pass_component=f"{USER}:with_solution/right")


def test_the_launcher_refuses_a_reward_that_cannot_be_imported_before_anything_starts(capsys, tmp_path):
    from launcher.cli import early_exit

    code = early_exit([f"--run_dir={tmp_path}", '--reward.components=[{name = "tests.reward_fns:nope"}]'])
    assert code == 2
    assert "reward component 'tests.reward_fns:nope': module 'tests.reward_fns' has no attribute 'nope'" in \
        capsys.readouterr().err


def test_a_column_a_component_needs_must_be_in_the_data():
    with pytest.raises(ConfigError, match=r"'tests.reward_fns:with_solution' needs the column\(s\) solution.*"
                                          r"task.data.extra_fields"):
        check_components(components({"name": f"{USER}:with_solution"}), ["level"])
    with pytest.raises(ConfigError, match=r"'exact' needs the column\(s\) reference"):
        check_components(components({"name": "exact", "params": {"answer_field": "reference"}}), [])
    check_components(components({"name": f"{USER}:with_solution"}, {"name": "math_verify"}), ["solution"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "mathverify"}, "neither a built-in (exact, numeric, char_accuracy, math_verify, format, overlong)"),
        ({"name": "module.only"}, "nor a user function 'package.module:function'"),
        ({"name": "exact", "weight": float("inf")}, "weight must be finite"),
        ({"name": "exact", "params": {"buffer": 3}}, "unknown params ['buffer']; it takes ['answer_field']"),
        ({"name": "overlong", "params": {"buffer": 0}}, "params.buffer must be an int >= 1"),
        ({"name": "numeric", "params": {"rel_tol": -1}}, "params.rel_tol must be a number >= 0"),
        ({"name": f"{USER}:exact", "params": {"answer_field": ""}}, "params.answer_field must be a column name"),
        ({"name": "a" * 90 + ".b:" + "c" * 10}, "more than 96"),
    ],
)
def test_bad_reward_components_fail_at_config_load(spec, message):
    with pytest.raises(ConfigError, match="reward.components") as err:
        load_config(RunConfig, [], {"reward": {"components": [spec]}})
    assert message in str(err.value)


def test_a_component_listed_twice_fails():
    with pytest.raises(ConfigError, match="lists format twice"):
        load_config(RunConfig, [], {"reward": {"components": [{"name": "format"}, {"name": "format"}]}})


def test_reward_section_from_toml_and_from_a_flag(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent("""
        [reward]
        timeout_s = 2.5
        [[reward.components]]
        name = "math_verify"
        [[reward.components]]
        name = "format"
        weight = 0.1
        [[reward.components]]
        name = "overlong"
        params = { buffer = 8 }
    """))
    cfg = load_config(RunConfig, [path])
    assert [(c.name, c.weight, c.params) for c in cfg.reward.components] == \
        [("math_verify", 1.0, {}), ("format", 0.1, {}), ("overlong", 1.0, {"buffer": 8})]
    assert (cfg.reward.timeout_s, cfg.reward.workers) == (2.5, 1)
    flagged = load_config(RunConfig, [], ['--reward.components=[{name = "tests.reward_fns:parts", weight = 2}]'])
    assert flagged.reward.components[0].name == "tests.reward_fns:parts"
    assert RewardConfig().components == [] and RunConfig().trainer.truncation == "keep"
