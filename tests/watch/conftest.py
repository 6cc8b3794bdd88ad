"""What the watch's tests share: a Hugging Face `Trainer` run on cpu with a callback, and the rows of batches."""

import pytest


@pytest.fixture
def train_with_callback(tmp_path):
    """`train(model, rows, batch, steps, callback)`: a `Trainer` fine-tune of `model` on `rows`
    (dicts of one sample's tensors), `steps` optimizer steps of `batch` rows each, on cpu, with
    nothing logged or saved."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    def train(model, rows, batch, steps, callback):
        args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=batch,
                                 max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
                                 logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()

    return train


@pytest.fixture
def rows_of():
    """`rows_of(batches)`: the samples of `batches` (dicts of [batch, ...] tensors), one dict each."""
    return lambda batches: [{k: v[i] for k, v in b.items()} for b in batches
                            for i in range(len(next(iter(b.values()))))]
