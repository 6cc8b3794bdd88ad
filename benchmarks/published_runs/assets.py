"""What a trainer's command needs on disk, made locally: no weights, no download.

- `write_checkpoint`: a Hugging Face checkpoint folder (`config.json` and one
  `model.safetensors`) whose tensors have the model's names, shapes and dtypes and no data:
  the safetensors header (an 8-byte length and a JSON table of dtype, shape and byte offsets;
  https://github.com/huggingface/safetensors#format) followed by a hole the size of the data
  (a sparse file: it takes no disk). `memplan run` reads only the header (docs/run.md,
  "Checkpoints"), so the trainer's `from_pretrained` or `load_file` loads fake tensors of the
  full model.
- `write_word_tokenizer`: a word-level `tokenizers` tokenizer of a given vocabulary size
  (`w0` ... `wN` and the special tokens), saved as `tokenizer.json` beside a
  `tokenizer_config.json`, so that `AutoTokenizer.from_pretrained(folder)` loads it.
- `words`: reproducible text of those words, as long as a run needs its samples to be.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SAFETENSORS_DTYPES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16",
                      "torch.int64": "I64", "torch.int32": "I32", "torch.uint8": "U8", "torch.int8": "I8",
                      "torch.bool": "BOOL"}


def write_shapes_safetensors(tensors: dict[str, Any], path: Path) -> int:
    """Write `tensors` (name -> tensor, any device, `meta` included) as a safetensors file
    whose data region is a hole; the file's size in bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(8 + len(blob) + offset)
    return 8 + len(blob) + offset


def write_checkpoint(config: Any, folder: Path, auto_class: str = "AutoModelForCausalLM",
                     dtype: str = "bfloat16") -> Path:
    """`folder` holding `config.json` and a shapes-only `model.safetensors` of the model
    `auto_class.from_config(config)` builds (in `dtype`; tied weights stored once, as
    `save_pretrained` stores them)."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        model = getattr(transformers, auto_class).from_config(config, dtype=getattr(torch, dtype))
    seen: set[int] = set()
    tensors = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied weight is saved under its first name
            seen.add(id(t))
            tensors[name] = t
    write_shapes_safetensors(tensors, folder / "model.safetensors")
    return folder


SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def write_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """`folder` holding a word-level tokenizer of `vocab_size` tokens: `<pad>` 0, `<s>` 1,
    `</s>` 2, `<unk>` 3, then `w4` ... (whitespace-split words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def words(count: int, vocab_size: int, seed: int = 0) -> str:
    """`count` words of the word-level vocabulary, space-separated (one token each)."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(len(SPECIALS), vocab_size)}" for _ in range(count))
