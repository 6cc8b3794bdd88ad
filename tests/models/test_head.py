"""The task head: `TrainingSetup.head="seq-cls"` builds what an HF Trainer classification
fine-tune runs (AutoModelForSequenceClassification, one class label per sequence, HF's loss)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.cli.flags import add_setup_flags, setup_from_args
from memplan.errors import UserError
from memplan.models import (
    TrainingSetup,
    build_model,
    forward_loss,
    make_batch,
    tiny_config,
)


def classification(**fields) -> TrainingSetup:
    return TrainingSetup(head="seq-cls", batch=3, seq=16, **{"precision": "32-true", **fields})


def test_head_defaults_to_the_language_model_head_with_two_labels():
    setup = TrainingSetup(precision="32-true")
    assert (setup.head, setup.num_labels) == ("lm", 2)


def test_head_and_num_labels_flags_parse_into_the_setup():
    parser = argparse.ArgumentParser()
    add_setup_flags(parser)
    setup = setup_from_args(parser.parse_args(["--head", "seq-cls", "--num-labels", "5"]))
    assert (setup.head, setup.num_labels) == ("seq-cls", 5)


def test_an_unknown_head_is_a_user_error():
    with pytest.raises(UserError, match="`head` must be one of lm, seq-cls"):
        TrainingSetup(precision="32-true", head="token-cls")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_num_labels_below_one_or_not_whole_is_a_user_error(bad):
    with pytest.raises(UserError, match="`num_labels` must be a whole number >= 1"):
        TrainingSetup(precision="32-true", head="seq-cls", num_labels=bad)


@pytest.mark.parametrize("name, cls_name", [("bert-large", "BertForSequenceClassification"),
                                            ("llama-3.2-1b", "LlamaForSequenceClassification"),
                                            ("gpt2", "GPT2ForSequenceClassification")])
def test_seq_cls_builds_the_sequence_classification_class(name, cls_name):
    model = build_model(tiny_config(name), classification(num_labels=3))
    assert type(model).__name__ == cls_name
    assert model.config.num_labels == 3


def test_the_lm_head_still_builds_the_language_model_class():
    assert type(build_model(tiny_config("bert-large"), TrainingSetup(precision="32-true"))).__name__ == "BertForMaskedLM"


def test_classifier_output_is_num_labels_wide():
    model = build_model(tiny_config("bert-large"), classification(num_labels=7))
    assert model.classifier.out_features == 7


def test_a_last_token_classifier_without_a_pad_token_gets_eos_as_pad():
    config = tiny_config("llama-3.2-1b")
    assert config.pad_token_id is None
    model = build_model(config, classification())
    assert model.config.pad_token_id == (config.eos_token_id if isinstance(config.eos_token_id, int)
                                         else config.eos_token_id[0])
    assert config.pad_token_id is None  # the caller's config is left alone


def test_classification_batch_has_one_integer_label_per_sequence_below_num_labels():
    setup = classification(num_labels=4)
    model = build_model(tiny_config("bert-large"), setup)
    batch = make_batch(model, setup, seed=1)
    assert batch["input_ids"].shape == (3, 16)
    assert batch["labels"].shape == (3,)
    assert batch["labels"].dtype == torch.int64
    assert int(batch["labels"].min()) >= 0 and int(batch["labels"].max()) < 4


def test_classification_batch_is_seeded():
    setup = classification()
    config = tiny_config("bert-large")
    first, again = make_batch(config, setup, seed=5), make_batch(config, setup, seed=5)
    assert torch.equal(first["labels"], again["labels"]) and torch.equal(first["input_ids"], again["input_ids"])


def test_one_label_is_regression_with_float_targets_and_mse_loss():
    setup = classification(num_labels=1)
    model = build_model(tiny_config("bert-large"), setup)
    model.eval()  # no dropout, so two forwards agree
    batch = make_batch(model, setup)
    assert batch["labels"].dtype == torch.float32 and batch["labels"].shape == (3,)
    logits = model(input_ids=batch["input_ids"]).logits
    expected = torch.nn.functional.mse_loss(logits.squeeze(), batch["labels"])
    assert torch.allclose(forward_loss(model, batch), expected)


def test_loss_is_cross_entropy_over_the_classes_as_hf_computes_it():
    setup = classification(num_labels=3)
    model = build_model(tiny_config("bert-large"), setup)
    model.eval()  # no dropout, so two forwards agree
    batch = make_batch(model, setup)
    logits = model(input_ids=batch["input_ids"]).logits
    assert logits.shape == (3, 3)
    expected = torch.nn.functional.cross_entropy(logits, batch["labels"])
    assert torch.allclose(forward_loss(model, batch), expected)


def test_lora_on_a_classifier_also_trains_the_new_head():
    model = build_model(tiny_config("bert-large"), classification(num_labels=3, lora_rank=4))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any("lora_" in name for name in trainable)
    assert any("classifier" in name for name in trainable)
    assert not any("intermediate.dense.weight" in name and "lora" not in name for name in trainable)


def test_a_classification_step_runs_under_fake_tensors():
    setup = classification(checkpointing="full", lora_rank=4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(tiny_config("llama-3.2-1b"), setup)
        loss = forward_loss(model, make_batch(model, setup))
        loss.backward()
    assert loss.shape == ()


def test_a_model_type_without_a_classification_class_is_a_user_error(monkeypatch):
    from transformers.models.auto import modeling_auto

    names = dict(modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    names.pop("bert")
    monkeypatch.setattr(modeling_auto, "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", names)
    with pytest.raises(UserError, match="no sequence-classification class.*`head=lm`"):
        build_model(tiny_config("bert-large"), classification())


def test_a_factory_model_with_a_seq_cls_head_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "headless_factory.py").write_text("import torch\ndef build():\n    return torch.nn.Linear(2, 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match="factory 'headless_factory:build' builds its own model"):
        build_model("headless_factory:build", classification())


def test_a_classification_step_traces_and_its_estimate_runs():
    from memplan.estimation import estimate

    setup = classification(num_labels=2)
    result = estimate(tiny_config("bert-large"), setup, device="cuda", gpu="v100-16gb")
    assert result.peak_allocated_bytes > 0
    assert result.setup["head"] == "seq-cls"
    assert result.peak_reserved_bytes >= result.peak_allocated_bytes
