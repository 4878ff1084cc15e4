"""recdepth/core: the value checks every config runs, and the registry of extension points."""

import copy
import math

import pytest

from recdepth import exits
from recdepth.core import checks
from recdepth.core.registry import Registry
from recdepth.exits import rule as rule_module


@pytest.mark.parametrize("v, is_int, is_number", [
    (3, True, True), (0, True, True), (-2, True, True), (True, False, False), (False, False, False),
    (2.0, False, True), (math.inf, False, False), (math.nan, False, False), ("3", False, False), (None, False, False),
])
def test_is_int_and_is_number_refuse_bools_strings_and_non_finite_values(v, is_int, is_number):
    assert checks.is_int(v) is is_int
    assert checks.is_number(v) is is_number


def test_a_failed_check_is_one_line_naming_the_field_and_what_was_expected():
    cases = [
        (lambda: checks.check_int("eval.batch_size", 0, 1), "eval.batch_size: expected an integer >= 1, got 0"),
        (lambda: checks.check_int("eval.bos", -1, 0, null=True), "eval.bos: expected an integer >= 0 or null, got -1"),
        (lambda: checks.check_int("exit.max_steps", True, 1), "exit.max_steps: expected an integer >= 1, got True"),
        (lambda: checks.check_number("halt.beta", -0.5), "halt.beta: expected a finite number >= 0, got -0.5"),
        (lambda: checks.check_number("x.lr", 0, strict=True), "x.lr: expected a finite number > 0, got 0"),
        (lambda: checks.check_number("x.clip", math.nan, null=True), "x.clip: expected a finite number >= 0 or null, got nan"),
        (lambda: checks.check_one_of("eval.cache", "all", ("latest", "per_step")),
         "eval.cache: expected one of latest, per_step, got 'all'"),
        (lambda: checks.check_bool("eval.compact", 1), "eval.compact: expected true or false, got 1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


def test_a_passed_check_returns_the_value():
    assert checks.check_int("a", 5, 1) == 5 and checks.check_int("a", None, 1, null=True) is None
    assert checks.check_number("a", 0.0) == 0.0 and checks.check_number("a", -1e308, lo=-math.inf) == -1e308
    assert checks.check_one_of("a", "x", ["x", "y"]) == "x" and checks.check_bool("a", None, null=True) is None


def test_a_name_taken_by_another_class_is_a_one_line_error_and_the_same_class_again_replaces():
    reg: Registry[object] = Registry("exit.name", "exit rule")

    class First:
        """The class that names the entry first."""

    class Second:
        """Another class claiming the same name."""

    reg.register("mine", 1, First)
    reg.register("mine", 2, First)  # the same definition run again (a module re-imported): replaced
    assert reg["mine"] == 2
    with pytest.raises(ValueError) as e:
        reg.register("mine", 3, Second)
    message = str(e.value)
    assert "\n" not in message and "'mine'" in message and "exit.name" in message
    assert "Second" in message and "First" in message and reg["mine"] == 2


def test_a_rule_named_like_a_built_in_rule_is_refused_where_it_is_defined(monkeypatch):
    monkeypatch.setattr(rule_module, "_REGISTRY", copy.copy(rule_module._REGISTRY))
    before = exits.lookup("kl")
    with pytest.raises(ValueError, match=r"the exit rule name 'kl' \(exit.name\) is taken by recdepth\.exits\.rules\."):
        class MyKL(exits.ExitRule):
            name = "kl"
    assert exits.lookup("kl") is before
