"""Models by Hugging Face Hub id: only config.json, from a pre-filled Hub cache, never the network.

The cache is built the way huggingface_hub lays it out (`models--org--name/snapshots/<commit>/
config.json` and `refs/main` naming the commit) in a temporary HF_HOME, with HF_HUB_OFFLINE
set. In-process tests point huggingface_hub's constants at it (they are read from the
environment when huggingface_hub is imported); the remote-code test runs the CLI in a fresh
process with HF_HOME and HF_HUB_OFFLINE in its environment, as a user would.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

from memplan.errors import UserError
from memplan.models import FactorySpec, load_config, tiny_config

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"

REMOTE_CONFIG_CODE = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
REMOTE_MODEL_CODE = '''from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''


def put_in_cache(hf_home: Path, repo_id: str, files: dict[str, str]) -> Path:
    """`files` as the snapshot of `repo_id`'s main branch in the Hub cache under `hf_home`."""
    folder = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def tiny_llama_json() -> str:
    return json.dumps(tiny_config("llama-2-7b").to_dict())


def tiny_remote_files() -> dict[str, str]:
    data = tiny_config("llama-2-7b").to_dict()
    data.update(model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                          "AutoModelForCausalLM": "modeling_tiny.TinyRemoteForCausalLM"})
    return {"config.json": json.dumps(data), "configuration_tiny.py": REMOTE_CONFIG_CODE,
            "modeling_tiny.py": REMOTE_MODEL_CODE}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache in HF_HOME=tmp_path, offline."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path


def test_a_hub_id_reads_config_json_from_the_cache(hub_cache):
    put_in_cache(hub_cache, "some-org/tiny-llama", {"config.json": tiny_llama_json()})
    config = load_config("some-org/tiny-llama")
    assert type(config).__name__ == "LlamaConfig"
    assert config.name_or_path == "some-org/tiny-llama"
    assert config.hidden_size == 64 and config.num_hidden_layers == 2


def test_resolution_order_registry_path_factory_then_hub(hub_cache, tmp_path, monkeypatch):
    put_in_cache(hub_cache, "local/model", {"config.json": json.dumps(tiny_config("gpt2").to_dict())})
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "local" / "model"
    local.mkdir(parents=True)
    (local / "config.json").write_text(tiny_llama_json())
    assert load_config("local/model").model_type == "llama"  # an existing path wins over the Hub id
    assert isinstance(load_config("package.module:factory"), FactorySpec)
    assert load_config("gpt2").n_layer == 12  # a registry name first
    with pytest.raises(UserError, match="does not exist"):
        load_config("a/b/config.json")  # not an org/name id: a path that is not there


def test_offline_without_a_cached_copy_is_one_line(hub_cache):
    with pytest.raises(UserError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE is set: fetch it once "
                                        "online, or pass a config.json path") as info:
        load_config("some-org/not-cached")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("error", "expected"), [
    (GatedRepoError, "some-org/gated is a gated repository: accept its terms .*huggingface-cli login.*HF_TOKEN"),
    (RepositoryNotFoundError, "no repository some-org/gated on the Hugging Face Hub .* HF_TOKEN"),
])
def test_gated_and_missing_repositories_are_one_line(hub_cache, monkeypatch, error, expected):
    def refuse(repo_id, filename, **kwargs):
        raise error("refused", response=SimpleNamespace(headers={}, request=None, status_code=403))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(UserError, match=expected) as info:
        load_config("some-org/gated")
    assert "\n" not in str(info.value)


def test_remote_code_is_refused_without_trust(hub_cache):
    put_in_cache(hub_cache, "some-org/tiny-remote", tiny_remote_files())
    with pytest.raises(UserError, match="'tiny_remote'.*pass --trust-remote-code"):
        load_config("some-org/tiny-remote")


def test_cli_runs_remote_code_only_with_the_flag(tmp_path):
    """In a fresh process with HF_HOME and HF_HUB_OFFLINE set: without the flag one line and
    exit 2; with it, the repository's config and model classes (a LlamaForCausalLM subclass)
    estimate exactly what the same config as a plain Llama does."""
    put_in_cache(tmp_path, "some-org/tiny-remote", tiny_remote_files())
    put_in_cache(tmp_path, "some-org/tiny-llama", {"config.json": tiny_llama_json()})
    script = (
        "import contextlib, io, json, sys\n"
        "from memplan.cli import main\n"
        "flags = ['--batch', '2', '--seq', '32', '--device', 'cpu', '--allocator', 'none', '--json']\n"
        "for args in (['some-org/tiny-remote'], ['some-org/tiny-remote', '--trust-remote-code'],"
        " ['some-org/tiny-llama']):\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        code = main(['estimate', *args, *flags])\n"
        "    sys.stderr.write(f'RESULT {code} {out.getvalue()!r}\\n')\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    results = [line.split(" ", 2) for line in run.stderr.splitlines() if line.startswith("RESULT")]
    assert [code for _, code, _ in results] == ["2", "0", "0"], run.stderr[-2000:]
    assert "--trust-remote-code" in run.stderr
    remote, native = (json.loads(eval(out)) for _, _, out in results[1:])
    assert remote["model"] == "some-org/tiny-remote"
    assert remote["peak_allocated_bytes"] == native["peak_allocated_bytes"] > 0
    assert (tmp_path / "modules").is_dir()  # transformers kept the repository's code under HF_HOME
