"""`--cpus` (serve, profile): parsing, errors, and that the pin holds for the process and its threads; `--engine`'s names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve.cli import main
from jaxserve.commands.common import parse_cpus


def test_parse_cpus_lists_and_ranges() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0-1") == {0, 1}
    assert parse_cpus(" 1 , 0 ") == {0, 1}


@pytest.mark.parametrize(
    ("text", "match"),
    [("", "empty"), ("a", "bad CPU list item"), ("1-0", "bad CPU range"), ("-1", "bad CPU"), ("4096", "do not exist")],
)
def test_parse_cpus_errors_name_the_problem(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cpus(text)


def test_pin_applies_to_threads_started_afterwards() -> None:
    code = (
        "import os, threading\n"
        "from jaxserve.commands.common import pin_to_cpus\n"
        "pin_to_cpus({0})\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "t.start(); t.join()\n"
        "print(sorted(os.sched_getaffinity(0)), seen[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[0] [0]"


def test_serve_and_profile_refuse_a_cpu_that_does_not_exist(capsys) -> None:
    assert main(["serve", "--deployment", "colocated:tp1", "--model", "opt-tiny", "--cpus", "4096"]) == 2
    assert "--cpus" in capsys.readouterr().err
    assert main(["profile", "--model", "opt-tiny", "--quick", "--cpus", "0-", "-o", "/dev/null"]) == 2
    assert "bad CPU" in capsys.readouterr().err


def test_serve_engine_model_and_its_deprecated_spelling(capsys) -> None:
    """The family-blind engine is `--engine model` (the default); `--engine opt`, its old name, still parses to it
    with a warning."""
    from jaxserve.cli import build_parser

    assert build_parser().parse_args(["serve"]).engine == "model"
    assert build_parser().parse_args(["serve", "--engine", "opt"]).engine == "model"
    assert "--engine opt is deprecated" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine", "nope"])
