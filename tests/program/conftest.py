"""Tiny local data and checkpoints for the program runs (no network)."""

import random
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """About 20 KB of words: character-level training data."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while memory is planned and traced".split()
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(3000)))
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama saved with `save_pretrained` (bf16 safetensors, 0.16M parameters)."""
    from transformers import AutoModelForCausalLM

    from memplan import models

    folder = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(models.tiny_config("llama-3.2-1b")).save_pretrained(folder)
    return folder
