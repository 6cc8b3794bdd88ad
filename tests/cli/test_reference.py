"""docs/cli.md is generated from the parser (memplan.cli.reference) and kept current."""

from pathlib import Path

from memplan.cli.reference import cli_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_what_the_parser_generates():
    assert DOC.read_text() == cli_markdown(), \
        "docs/cli.md is stale: regenerate it with python -m memplan.cli.reference > docs/cli.md"


def test_every_table_row_of_docs_cli_md_is_at_most_300_characters():
    long = [line[:60] for line in cli_markdown().splitlines() if line.startswith("|") and len(line) > 300]
    assert not long, long


def test_the_job_flags_are_listed_once_by_section_and_each_subcommand_names_its_sections():
    text = cli_markdown()
    assert text.count("| `--lora-rank R` |") == 1
    job = text.split("## The job's flags", 1)[1].split("\n## ", 1)[0]
    assert "**adapters and quantisation**" in job and "**DeepSpeed ZeRO" in job
    estimate = text.split("## memplan estimate", 1)[1].split("\n## ", 1)[0]
    assert "Takes [the job's flags](#the-jobs-flags): model and batch, precision," in estimate
    assert "parallelism" not in text.split("## memplan trace", 1)[1].split("\n## ", 1)[0]
