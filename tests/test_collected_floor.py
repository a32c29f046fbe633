"""The whole suite's floor under its collected count (tests/conftest.py, tests/collected_floor.txt)."""

import pathlib
import types

import pytest

from tests.conftest import (
    COLLECTED_FLOOR_FILE,
    TESTS_DIR,
    collected_floor_problem,
    read_collected_floor,
    whole_default_suite,
)


def test_fewer_tests_than_the_floor_fail_with_both_numbers():
    problem = collected_floor_problem(950, 959)
    assert problem == ("collected 950 tests, fewer than the recorded 959: a test was removed or not collected; "
                       "update tests/collected_floor.txt deliberately if so")
    assert collected_floor_problem(959, 959) is None and collected_floor_problem(970, 959) is None


def test_the_floor_file_holds_one_number(tmp_path):
    assert read_collected_floor() > 0
    assert read_collected_floor(COLLECTED_FLOOR_FILE) == read_collected_floor()
    path = tmp_path / "floor.txt"
    path.write_text("# a comment\n\n959\n")
    assert read_collected_floor(path) == 959
    for text in ("# only a comment\n", "959\n960\n", "about 959\n"):
        path.write_text(text)
        with pytest.raises(ValueError, match="expected one line"):
            read_collected_floor(path)


def _config(*args, invocation_dir=TESTS_DIR.parent, worker=False, **options):
    option = dict(keyword="", markexpr="not real_sglang", deselect=None, ignore=None, ignore_glob=None, lf=False,
                  stepwise=False, stepwise_skip=False)
    option.update(options)
    config = types.SimpleNamespace(option=types.SimpleNamespace(**option), args=list(args),
                                   invocation_params=types.SimpleNamespace(dir=pathlib.Path(invocation_dir)),
                                   getini=lambda name: ["-ra", "-m", "not real_sglang"])
    if worker:
        config.workerinput = {"workerid": "gw0"}
    return config


def test_only_a_run_of_the_whole_default_suite_is_checked():
    assert whole_default_suite(_config("tests"))
    assert whole_default_suite(_config(str(TESTS_DIR) + "/"))
    assert whole_default_suite(_config(".", invocation_dir=TESTS_DIR))
    assert not whole_default_suite(_config("tests", worker=True))  # the xdist controller checks
    assert not whole_default_suite(_config("tests/train"))
    assert not whole_default_suite(_config("tests/test_readme.py"))
    assert not whole_default_suite(_config("tests", "tests/test_readme.py::test_ci"))
    assert not whole_default_suite(_config("."))
    for narrowed in ({"keyword": "sft"}, {"markexpr": "not slow"}, {"deselect": ["tests/test_readme.py"]},
                     {"ignore": ["tests/app"]}, {"lf": True}, {"stepwise": True}):
        assert not whole_default_suite(_config("tests", **narrowed)), narrowed
