"""The program's writes go under the run's output folder, and its looks at them find them there."""

import os
from pathlib import Path

from memplan.program.patches import Patches
from memplan.program.side_effects import WriteLog, redirect_writes


def _redirected(out: Path):
    patches = Patches()
    log = WriteLog(out)
    redirect_writes(patches, log)
    return patches, log


def test_a_folder_made_again_with_parents_and_exist_ok_is_found_under_the_output(tmp_path):
    folder = tmp_path / "program" / "outputs" / "logs"
    patches, _log = _redirected(tmp_path / "run")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        folder.mkdir(parents=True, exist_ok=True)  # pathlib asks is_dir() of the folder it may not make again
        made_there = folder.is_dir() and os.path.exists(folder)
        (folder / "log.txt").write_text("step 1\n")
        listed = os.listdir(folder)
    finally:
        patches.restore()
    assert made_there and listed == ["log.txt"]
    assert not folder.exists()
    assert (tmp_path / "run" / "files" / folder.relative_to("/") / "log.txt").read_text() == "step 1\n"


def test_a_folder_that_exists_is_looked_at_where_it_is(tmp_path):
    (tmp_path / "real.txt").write_text("data")
    patches, _log = _redirected(tmp_path / "run")
    try:
        (tmp_path / "made").mkdir(parents=True, exist_ok=True)  # also "makes" tmp_path and every folder above
        listed = sorted(os.listdir(tmp_path))
    finally:
        patches.restore()
    assert listed == ["real.txt", "run"]


def test_a_temporary_folder_and_its_files_are_made_where_they_are(tmp_path):
    import tempfile

    patches, _log = _redirected(tmp_path / "run")
    try:
        with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
            with open(os.path.join(scratch, "kernel.cpp"), "w") as f:  # a compiler's input, built with cwd=scratch
                f.write("int main() {}")
            written = sorted(os.listdir(scratch))
            made_there = Path(scratch).parent == tmp_path and (Path(scratch) / "kernel.cpp").is_file()
    finally:
        patches.restore()
    assert written == ["kernel.cpp"] and made_there
    assert not (tmp_path / "run" / "files").exists()


def test_a_file_named_in_bytes_is_written_and_read_under_the_output(tmp_path):
    folder = tmp_path / "program" / "tb"
    patches, _log = _redirected(tmp_path / "run")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.fsencode(folder / "events"), "wb") as f:  # tensorboard's writer names its file in bytes
            f.write(b"event")
        with open(os.fsencode(folder / "events"), "rb") as f:
            read = f.read()
    finally:
        patches.restore()
    assert read == b"event" and not folder.exists()
    assert (tmp_path / "run" / "files" / folder.relative_to("/") / "events").read_bytes() == b"event"
