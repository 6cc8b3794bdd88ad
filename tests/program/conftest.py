"""Tiny local data and checkpoints for the program runs (no network)."""

import json
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


WORDS = "the quick brown fox jumps over a lazy dog while memory is planned and traced".split()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> Path:
    """A tiny Llama (bf16 safetensors) with a word-level tokenizer beside it, built locally:
    what `AutoModelForCausalLM` and `AutoTokenizer.from_pretrained` load from one folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from memplan import models as memplan_models

    folder = tmp_path_factory.mktemp("tiny-chat")
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                            unk_token="[UNK]").save_pretrained(folder)
    config = memplan_models.tiny_config("llama-3.2-1b", vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory) -> Path:
    """A folder holding `train.jsonl`: 64 rows of 24 words in a "text" field (what
    `datasets.load_dataset(FOLDER)` reads as its train split)."""
    rng = random.Random(1)
    folder = tmp_path_factory.mktemp("text-dataset")
    rows = [{"text": " ".join(rng.choice(WORDS) for _ in range(24))} for _ in range(64)]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="session")
def tiny_litgpt_checkpoint(tmp_path_factory, tiny_chat_model) -> Path:
    """A LitGPT checkpoint folder of the tiny Llama: `model_config.yaml` (memplan's mapping of
    the Hugging Face config onto `litgpt.Config`), `lit_model.pth` (a bf16 state dict) and
    the word-level tokenizer of `tiny_chat_model`."""
    import shutil

    import torch
    from litgpt import Config
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from transformers import AutoConfig

    from memplan.models.litgpt import litgpt_config_fields

    folder = tmp_path_factory.mktemp("tiny-litgpt")
    config = Config(name="tiny-llama", **litgpt_config_fields(AutoConfig.from_pretrained(tiny_chat_model)))
    save_config(config, folder)
    torch.manual_seed(0)
    torch.save(GPT(config).to(torch.bfloat16).state_dict(), folder / "lit_model.pth")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_chat_model / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def instruction_json(tmp_path_factory) -> Path:
    """40 instruction/output pairs of a few words: LitGPT's `JSON` data module's format."""
    rng = random.Random(2)
    path = tmp_path_factory.mktemp("instructions") / "data.json"
    path.write_text(json.dumps([{"instruction": " ".join(rng.choice(WORDS) for _ in range(8)), "input": "",
                                 "output": " ".join(rng.choice(WORDS) for _ in range(12))} for _ in range(40)]))
    return path


def measured_ranks(command, **options):
    """Per rank, the profiler peaks of the real multi-process run of `command`
    (`measure_program`: the allocation events, which torch's memory-profiler analysis cannot
    refuse, so every run is a ground truth)."""
    from memplan.program import measure_program

    return measure_program(command, **options)
