"""What the watch's tests share: a tiny AdamW job, a Hugging Face `Trainer` run on cpu with a callback,
and the rows of batches."""

import pytest
import torch

from memplan import models


@pytest.fixture(scope="session")
def adamw_job():
    """`adamw_job(setup, steps, name="gpt2")`: (model, AdamW, `steps` batches) of the tiny config
    `name`, seeded, on cpu: the loop the engine tests run with and without the watch."""
    def job(setup, steps, name="gpt2"):
        torch.manual_seed(0)
        model = models.build_model(models.tiny_config(name), setup, device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        return model, optimizer, [models.make_batch(model, setup, device="cpu", seed=i) for i in range(steps)]

    return job


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
