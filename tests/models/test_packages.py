"""A setup that needs an optional package this Python lacks is refused in one line, naming the
flag and the install, before anything is built (`memplan.models.packages`)."""

import importlib.util

import pytest

from memplan.errors import UserError
from memplan.models import TrainingSetup, build_model, build_optimizer, packages, tiny_config


@pytest.fixture
def without(monkeypatch):
    """Make `find_spec` answer None for the packages named, as when they are not installed."""
    hidden: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(packages.importlib.util, "find_spec",
                        lambda name, *a: None if name in hidden else real(name, *a))
    return hidden


def test_a_quantised_base_without_bitsandbytes_is_a_user_error_naming_the_install(without):
    without.add("bitsandbytes")
    setup = TrainingSetup(batch=1, seq=8, quant="nf4", lora_rank=4)
    with pytest.raises(UserError, match=r"--quant nf4 needs bitsandbytes.*pip install bitsandbytes"):
        build_model(tiny_config("llama-3.2-1b"), setup)


@pytest.mark.parametrize(("optimizer", "package"), [("adamw8bit", "bitsandbytes"), ("ao-adamw8bit", "torchao")])
def test_an_optimizer_without_its_package_is_a_user_error(without, optimizer, package):
    without.add(package)
    setup = TrainingSetup(batch=1, seq=8, optimizer=optimizer)
    model = build_model(tiny_config("llama-3.2-1b"), setup)
    with pytest.raises(UserError, match=f"--optimizer {optimizer} needs {package}"):
        build_optimizer(model, setup)


def test_cpu_offloaded_optimizer_without_torchao_is_a_user_error(without):
    without.add("torchao")
    setup = TrainingSetup(batch=1, seq=8, cpu_offload="optimizer")
    model = build_model(tiny_config("llama-3.2-1b"), setup)
    with pytest.raises(UserError, match="--cpu-offload optimizer needs torchao"):
        build_optimizer(model, setup)
