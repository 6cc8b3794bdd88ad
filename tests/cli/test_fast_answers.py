"""`memplan --help`, a bad flag and a bad value answer from the parser alone: no torch,
transformers or numpy is imported for them (each took seconds); the libraries' warnings
are held back while a subcommand runs and counted once, `--verbose` shows them."""

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from memplan.cli.quiet import LibraryWarnings

SRC = Path(__file__).resolve().parents[2] / "src"
PROBE = """
import json, sys
from memplan.cli import main
code = main({argv!r})
print(json.dumps({{"code": code, "heavy": [m for m in ("torch", "transformers", "numpy") if m in sys.modules]}}))
"""


def _answer(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC)}, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("argv", "code"), [
    (["--help"], 0),
    (["estimate", "--help"], 0),
    (["estimate", "gpt2", "--bacth", "2"], 2),
    (["estimate", "gpt2", "--precision", "fp8"], 2),
    (["trace", "gpt2", "--seq", "many", "-o", "x.memtrace"], 2),
    (["fit", "gpt2", "--gpu", "t4", "--gpus", "1", "--bogus"], 2),
])
def test_help_a_bad_flag_and_a_bad_value_import_no_torch(argv, code):
    answer = _answer(argv)
    assert answer == {"code": code, "heavy": []}


def test_library_warnings_are_held_back_and_counted_once(capsys):
    with LibraryWarnings():
        warnings.warn("rank_pattern matched no module", UserWarning, stacklevel=1)
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
        logging.getLogger("bitsandbytes.backends.cpu").warning("pip install kernels")
    err = capsys.readouterr().err
    assert err == "memplan: 3 library warnings hidden; --verbose shows them\n"


def test_verbose_lets_the_library_warnings_through(capsys, caplog):
    with LibraryWarnings(verbose=True):
        logging.getLogger("torchao").warning("Failed to load _C_mxfp8.so")
    assert [r.getMessage() for r in caplog.records] == ["Failed to load _C_mxfp8.so"]
    assert "hidden" not in capsys.readouterr().err


def test_memplan_s_own_messages_and_library_errors_are_never_held(caplog):
    with LibraryWarnings():
        logging.getLogger("memplan.watch").warning("the watch's own")
        logging.getLogger("torch").error("a library error")
    assert [r.getMessage() for r in caplog.records] == ["the watch's own", "a library error"]
