"""The framework callbacks that drive `memplan.watch`: the Hugging Face Trainer, Accelerate and
Lightning (each where installed), on a tiny model on cpu: the step they measure against the
estimate of the same step."""

import json

import pytest
import torch

from memplan import models
from memplan.trace import load

SETUP = models.TrainingSetup(precision="32-true", batch=2, seq=32)


def _model():
    torch.manual_seed(0)
    return models.build_model(models.tiny_config("llama-3.2-1b"), SETUP, device="cpu")


def _rows(model, n):
    return [{k: v[0] for k, v in models.make_batch(model, SETUP, device="cpu", seed=i).items()}
            for i in range(n) for _ in range(SETUP.batch)]


def _assert_within_one_percent(out):
    cmp = json.loads((out / "compare.json").read_text())
    for name, entry in {**cmp["breakdown"], "peak": cmp["figures"]["peak_allocated_bytes"]}.items():
        assert abs(entry["difference_bytes"]) <= 0.01 * max(entry["measured"], 1), (name, entry)
    return cmp


def test_trainer_callback_measures_the_trainers_step(tmp_path, train_with_callback):
    from memplan.integrations.transformers import MemplanCallback

    model = _model()
    callback = MemplanCallback(step=2, out_dir=tmp_path / "watch", profile=False)
    train_with_callback(model, _rows(model, 3), SETUP.batch, 3, callback)
    assert load(tmp_path / "watch" / "step2.memtrace").meta["step"] == 2
    _assert_within_one_percent(tmp_path / "watch")
    assert callback.result["report"].endswith("index.html")


def test_accelerate_loop_with_accumulation_is_one_iteration_per_optimizer_step(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from memplan.integrations.accelerate import watch

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [models.make_batch(model, SETUP, device="cpu", seed=i) for i in range(6)]
    with watch(accelerator, model, optimizer, step=2, out_dir=tmp_path, profile=False) as w:
        for batch in batches:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
    assert w.steps_done == 3
    assert len(w._measured_calls) == 2  # the two micro-batches of optimizer step 2
    _assert_within_one_percent(tmp_path)


def test_lightning_callback_measures_the_step(tmp_path):
    lightning = pytest.importorskip("lightning")

    from memplan.integrations.lightning import MemplanCallback

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _model()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, foreach=True)

    module = Module()
    loader = torch.utils.data.DataLoader(_rows(module.model, 3), batch_size=SETUP.batch)
    callback = MemplanCallback(step=2, out_dir=tmp_path, module_attr="model", profile=False)
    trainer = lightning.Trainer(accelerator="cpu", max_steps=3, callbacks=[callback], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert load(tmp_path / "step2.memtrace").meta["step"] == 2
    _assert_within_one_percent(tmp_path)
