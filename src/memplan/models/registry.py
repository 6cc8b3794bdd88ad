"""The model registry: public model configs shipped as JSON, user configs, user factories.

A model is named in one of four ways, all resolved by `load_config`, in this order:

- a registry name (`gpt2`, `llama-2-70b`, ...): one of the Hugging Face `config.json` files
  shipped in `memplan/models/configs/`, written from the published configs of those models.
  Each carries a `_memplan` block with its Hub id and published parameter count, which
  the tests check against the model built from the config (on the meta device);
- a path to a local Hugging Face `config.json` (or a directory holding one) that exists;
- `package.module:factory`, a user function that returns an `nn.Module` (see `FactorySpec`);
- a Hugging Face Hub id, `org/name` (one `/`, not an existing path): a registry model's own
  Hub id or a published variant of it (`memplan.models.aliases`) is its registry config,
  offline, unless the Hub cache holds that id's config.json; otherwise only its `config.json`
  is fetched, by `huggingface_hub.hf_hub_download`, which keeps it in the Hub cache and
  honours `HF_HOME` / `HF_HUB_CACHE`, `HF_TOKEN` and `HF_HUB_OFFLINE`. No weights are
  downloaded: the model is built from its config.

A config whose `auto_map` names an `AutoConfig` class from the repository's own code, for a
`model_type` transformers does not know, needs that code run: `load_config` refuses it
unless `trust_remote_code=True` (the CLI's `--trust-remote-code`), and then loads it with
`AutoConfig.from_pretrained(..., trust_remote_code=True)`, as transformers does; the
builders then take the model class from the same remote code (`uses_remote_code`).

`tiny_config` scales any config down to the same architecture at toy size, for tests and
real CPU runs. Assumes transformers >= 4.45 (tested on 5.x), where `AutoConfig.for_model`
accepts both the old `torch_dtype`/`rope_scaling` keys and their newer spellings.
"""

from __future__ import annotations

import difflib
import importlib
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memplan.errors import UserError
from memplan.models.aliases import hub_alias
from memplan.models.moe import EXPERT_COUNT_KEYS

if TYPE_CHECKING:  # transformers takes a second to import; only its config class is named here
    from transformers import PretrainedConfig

CONFIG_PACKAGE = "memplan.models.configs"
PROVENANCE_KEY = "_memplan"
# `org/name` as the Hub spells repository ids (huggingface_hub.utils.validate_repo_id)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
REMOTE_CODE_PACKAGE = "transformers_modules"  # where transformers imports a repository's own code
HUB_LOGIN = "log in with `huggingface-cli login` (`hf auth login`) or set HF_TOKEN"

# Toy sizes used by `tiny_config`.
TINY_LAYERS = 2
TINY_HIDDEN = 64
TINY_HEADS = 4
TINY_KV_HEADS = 2
TINY_VOCAB = 512
TINY_MAX_POSITIONS = 256
TINY_EXPERTS = 4
TINY_EXPERTS_PER_TOKEN = 2
TINY_SLIDING_WINDOW = 128


@dataclass(frozen=True)
class FactorySpec:
    """A model given as `package.module:factory`.

    The factory is called with no arguments, or with the `TrainingSetup` when it takes one
    parameter, and returns an `nn.Module` whose `forward(**batch)` returns an object with
    `.loss`, a dict with `"loss"`, or a loss tensor. If the module has a
    `make_batch(setup, device, seed)` method, `make_batch` uses it; otherwise the module must
    have a `config` with `vocab_size` (and optionally `max_position_embeddings`), and gets
    causal-LM `input_ids` + `labels`.
    """

    module: str
    attribute: str

    @property
    def spec(self) -> str:
        return f"{self.module}:{self.attribute}"

    def resolve(self) -> Any:
        """Import the module and return the factory callable."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:
            raise UserError(f"cannot import module '{self.module}' for model '{self.spec}': {exc}") from exc
        factory = getattr(module, self.attribute, None)
        if factory is None or not callable(factory):
            raise UserError(f"module '{self.module}' has no callable '{self.attribute}' (model '{self.spec}')")
        return factory


def list_models() -> list[str]:
    """Names of the shipped model configs, sorted."""
    root = resources.files(CONFIG_PACKAGE)
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def _read_json(path: Path | Any, label: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read model config {label}: {getattr(exc, 'strerror', None) or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"model config {label} is not valid JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(data, dict):
        raise UserError(f"model config {label} must hold a JSON object, not {type(data).__name__}")
    return data


def registry_entry(name: str) -> dict[str, Any]:
    """The raw shipped JSON of a registry model, provenance block included."""
    if name not in list_models():
        raise UserError(_unknown_model_message(name))
    return _read_json(resources.files(CONFIG_PACKAGE) / f"{name}.json", f"'{name}'")


def provenance(name: str) -> dict[str, Any]:
    """`{"hf_id", "parameters", "parameters_source"}` of a registry model (and `source`, the URL of the
    published config.json, where the entry names it)."""
    return dict(registry_entry(name)[PROVENANCE_KEY])


def _unknown_model_message(spec: str) -> str:
    names = list_models()
    close = difflib.get_close_matches(spec.lower(), names, n=4, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return (
        f"unknown model '{spec}': {hint}give a registry name ({', '.join(names)}),"
        f" a path to a config.json, package.module:factory or a Hugging Face Hub id (org/name)"
    )


def config_from_dict(data: dict[str, Any], label: str) -> PretrainedConfig:
    """A `PretrainedConfig` of the class its `model_type` names."""
    from transformers import AutoConfig

    data = {k: v for k, v in data.items() if k != PROVENANCE_KEY}
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise UserError(f"model config {label} has no 'model_type' field")
    try:
        return AutoConfig.for_model(model_type, **data)
    except Exception as exc:  # transformers validates fields with several exception types
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise UserError(f"model config {label} is invalid: {message}") from exc


def load_config(spec: str, *, trust_remote_code: bool = False) -> PretrainedConfig | FactorySpec:
    """Resolve a model spec to a `transformers.PretrainedConfig`, or a `FactorySpec`.

    `spec` is, in this order: a registry name, an existing path to a local HF
    `config.json` (or a directory holding one), `package.module:factory`, or a Hub id
    `org/name` (see the module docstring). Unknown names raise `UserError` with close
    matches. `trust_remote_code` lets a config whose `auto_map` needs the repository's
    own code run that code (refused otherwise).
    """
    if not isinstance(spec, str) or not spec:
        raise UserError("a model is required: a registry name, a config.json path, package.module:factory "
                        "or a Hugging Face Hub id (org/name)")
    if spec in list_models():
        return config_from_dict(registry_entry(spec), f"'{spec}'")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _config_from_file(path, str(path), path.parent, trust_remote_code)
    if ":" in spec and "/" not in spec:
        module, _, attribute = spec.partition(":")
        if module and attribute.isidentifier() and all(part.isidentifier() for part in module.split(".")):
            return FactorySpec(module, attribute)
    if HUB_ID.fullmatch(spec) and path.suffix != ".json":
        alias = hub_alias(spec, registry_hub_ids())
        if alias is not None and not _in_hub_cache(spec):
            return _aliased_config(spec, *alias)
        return _config_from_file(Path(hub_config_path(spec)), f"{spec} (config.json from the Hugging Face Hub)",
                                 spec, trust_remote_code)
    if path.suffix == ".json" or "/" in spec or "\\" in spec:
        raise UserError(f"model config file {path} does not exist")
    raise UserError(_unknown_model_message(spec))


def registry_hub_ids() -> dict[str, str]:
    """Each registry entry's own Hub id -> its registry name."""
    return {registry_entry(name)[PROVENANCE_KEY]["hf_id"]: name for name in list_models()}


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the Hub cache holds `repo_id`'s config.json (looked up without the network)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def _aliased_config(repo_id: str, name: str, quantization: dict[str, Any] | None) -> PretrainedConfig:
    """The registry config a Hub id names (`memplan.models.aliases`), with the published
    checkpoint's quantization_config where it has one."""
    data = dict(registry_entry(name))
    if quantization is not None:
        data["quantization_config"] = dict(quantization)
    config = config_from_dict(data, f"'{name}' (the registry's config of {repo_id})")
    config.name_or_path = repo_id
    return config


def hub_config_path(repo_id: str) -> str:
    """The local path of `repo_id`'s `config.json`: from the Hub cache, or downloaded into it
    (`huggingface_hub.hf_hub_download`, which honours HF_HOME, HF_TOKEN and HF_HUB_OFFLINE).
    Every failure is one `UserError` line saying what to do."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return hf_hub_download(repo_id, "config.json")
    except GatedRepoError:
        raise UserError(f"{repo_id} is a gated repository: accept its terms on https://huggingface.co/{repo_id}, "
                        f"then {HUB_LOGIN}; or pass a config.json path") from None
    except RepositoryNotFoundError:
        raise UserError(f"no repository {repo_id} on the Hugging Face Hub (if it is private, {HUB_LOGIN}): "
                        "give a registry name, a config.json path or package.module:factory") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise UserError(f"{repo_id}'s config.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                        f"{why}: fetch it once online, or pass a config.json path") from None
    except EntryNotFoundError:
        raise UserError(f"{repo_id} has no config.json on the Hugging Face Hub: pass a config.json path") from None
    except HFValidationError as exc:
        raise UserError(f"{repo_id!r} is not a Hugging Face Hub id ({str(exc).splitlines()[0]})") from None
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        hint = HUB_LOGIN if status in (401, 403) else "try again, or pass a config.json path"
        raise UserError(f"the Hugging Face Hub answered HTTP {status} for {repo_id}'s config.json: {hint}") from None
    except OSError as exc:  # a network failure without a cached copy, an unwritable cache
        raise UserError(f"cannot fetch {repo_id}'s config.json: {exc.strerror or exc}") from None


def needs_remote_code(data: dict[str, Any]) -> bool:
    """Whether a config.json can only be loaded by running its repository's code: its
    `auto_map` names an `AutoConfig` and transformers has no class for its `model_type`
    (the test transformers' `AutoConfig.from_pretrained` makes)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_map = data.get("auto_map")
    return isinstance(auto_map, dict) and "AutoConfig" in auto_map and data.get("model_type") not in CONFIG_MAPPING


def uses_remote_code(config: PretrainedConfig) -> bool:
    """Whether `config` is an instance of a class from a repository's own code (loaded
    with `trust_remote_code=True`): its model class then comes from that code too."""
    return type(config).__module__.startswith(REMOTE_CODE_PACKAGE)


def _config_from_file(path: Path, label: str, source: str | Path, trust_remote_code: bool) -> PretrainedConfig:
    """The config of `path` (a local file, or the Hub's cached copy of `source`'s)."""
    data = _read_json(path, label)
    remote = isinstance(data.get("auto_map"), dict) and "AutoConfig" in data["auto_map"]
    if not trust_remote_code:
        if needs_remote_code(data):
            raise UserError(f"{label} names a model type transformers does not know ({data.get('model_type')!r}); "
                            f"its auto_map loads it with the repository's own code: pass --trust-remote-code to "
                            "run that code, or a config.json of a model type transformers has")
        config = config_from_dict(data, label)
        check_buildable(config, data, label)
    elif remote:
        config = _remote_config(str(source), label)
    else:
        config = config_from_dict(data, label)
    config.name_or_path = str(source)
    return config


# What memplan needs of a config to build its model, as transformers names the fields (a
# family's own spelling, `n_embd`, `n_layer`, is its config class's `attribute_map`).
NEEDED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_buildable(config: PretrainedConfig, data: dict[str, Any], label: str) -> None:
    """`UserError` (one line) for a config memplan cannot build a transformer from: a model
    type without attention heads (Mamba, RWKV: memplan traces attention-block language
    models), or a file that leaves out a field memplan needs, which transformers would fill
    with its family's defaults (a 7B-sized Llama for `{"model_type": "llama"}`)."""
    model_type = data.get("model_type")
    if getattr(config, "num_attention_heads", None) is None:
        supported = sorted({str(registry_entry(name).get("model_type")) for name in list_models()})
        raise UserError(f"{label}: model type {model_type!r} has no attention heads; memplan builds attention-block "
                        f"language models (the model types of its registry: {', '.join(supported)})")
    spelled = getattr(type(config), "attribute_map", {})
    missing = [name for name in NEEDED_FIELDS if name not in data and spelled.get(name) not in data]
    if missing:
        raise UserError(f"{label} lacks {', '.join(missing)}: transformers would fill them with its {model_type} "
                        "defaults, another model's sizes; add them to the config")


def _remote_config(source: str, label: str) -> PretrainedConfig:
    """`AutoConfig.from_pretrained(source, trust_remote_code=True)`: the repository's own
    config class, its code fetched into (or read from) the Hub cache."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=True)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        message = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise UserError(f"cannot load {label} with its own code: {message[:300]}") from None


def as_config(spec: str | PretrainedConfig | FactorySpec) -> PretrainedConfig:
    """The HF config a spec names (a registry name or config path); UserError for a factory."""
    if isinstance(spec, str):
        spec = load_config(spec)
    if isinstance(spec, FactorySpec):
        raise UserError(f"model '{spec.spec}' is a factory: it has no config to scale or count from")
    return spec


def tiny_config(spec: str | PretrainedConfig, **overrides: Any) -> PretrainedConfig:
    """The same architecture as `spec` at toy size, for tests and real CPU runs.

    2 layers, hidden 64, 4 heads (head dim 16), 2 KV heads when the model has grouped-query
    attention (1 when it has multi-query attention), vocab 512, 256 positions, the
    feed-forward width keeping the model's ratio to hidden, 4 experts top-2 for MoE
    (`_tiny_experts`), a 128-token sliding window where the model has one. `overrides` are set last (config
    attribute names, e.g. `num_hidden_layers=4`).
    """
    config = as_config(spec)
    data = config.to_dict()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    ffn_key = next((k for k in ("intermediate_size", "ffn_dim", "n_inner") if data.get(k)), None)
    new: dict[str, Any] = {
        "num_hidden_layers": TINY_LAYERS,
        "hidden_size": TINY_HIDDEN,
        "num_attention_heads": TINY_HEADS,
        "vocab_size": TINY_VOCAB,
    }
    if "num_key_value_heads" in data:
        new["num_key_value_heads"] = TINY_HEADS if kv_heads == heads else (1 if kv_heads == 1 else TINY_KV_HEADS)
    if data.get("head_dim") is not None:
        new["head_dim"] = TINY_HIDDEN // TINY_HEADS
    if ffn_key is not None:
        ratio = data[ffn_key] / hidden
        new[ffn_key] = max(8, int(round(ratio * TINY_HIDDEN / 8)) * 8)
    if "word_embed_proj_dim" in data:  # OPT-350m projects embeddings to a narrower width
        narrower = data["word_embed_proj_dim"] != hidden
        new["word_embed_proj_dim"] = TINY_HIDDEN // 2 if narrower else TINY_HIDDEN
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None:
        # RoBERTa reserves padding_idx + 1 position slots before the first token.
        reserved = max_positions - 512 if max_positions in (514, 1026) else 0
        new["max_position_embeddings"] = TINY_MAX_POSITIONS + reserved
    if data.get("n_ctx") is not None:
        new["n_ctx"] = TINY_MAX_POSITIONS
    if data.get("original_max_position_embeddings") is not None:  # Phi-3
        new["original_max_position_embeddings"] = TINY_MAX_POSITIONS
    for key in ("rope_parameters", "rope_scaling"):  # Llama 3.1 / 3.2 long-context RoPE
        rope = data.get(key)
        if isinstance(rope, dict) and rope.get("original_max_position_embeddings") and max_positions:
            shrink = rope["original_max_position_embeddings"] / max_positions
            new[key] = {**rope, "original_max_position_embeddings": max(16, int(TINY_MAX_POSITIONS * shrink))}
    if data.get("sliding_window") is not None:
        new["sliding_window"] = TINY_SLIDING_WINDOW
    if data.get("max_window_layers") is not None:
        new["max_window_layers"] = TINY_LAYERS
    if isinstance(data.get("layer_types"), list):  # per-layer attention kinds, in order
        new["layer_types"] = data["layer_types"][:TINY_LAYERS]
    new.update(_tiny_experts(data))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = data.get(key)
        if isinstance(value, int) and value >= TINY_VOCAB:
            new[key] = TINY_VOCAB - 1
        elif isinstance(value, list):
            new[key] = [v if v < TINY_VOCAB else TINY_VOCAB - 1 for v in value]
    tiny = config.__class__.from_dict({**data, **_canonical_keys(config, new)})
    for key, value in overrides.items():
        setattr(tiny, key, value)
    return tiny


# DeepSeek's multi-head latent attention widths, at toy size (q_lora_rank stays None where the model has none)
TINY_LATENT = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}


def _tiny_experts(data: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of `tiny_config`: 4 routed experts, top-2, the expert
    width keeping its ratio to hidden, DeepSeek's groups (2 of 2 experts, 1 group chosen,
    where the model routes in groups), its dense first block and its latent attention."""
    new: dict[str, Any] = {}
    key = next((k for k in EXPERT_COUNT_KEYS if data.get(k)), None)
    if key is None:
        return new
    new[key] = TINY_EXPERTS
    new["num_experts_per_tok"] = min(TINY_EXPERTS_PER_TOKEN, data.get("num_experts_per_tok") or 2)
    if data.get("moe_intermediate_size"):
        ratio = data["moe_intermediate_size"] / data["hidden_size"]
        new["moe_intermediate_size"] = max(8, int(round(ratio * TINY_HIDDEN / 8)) * 8)
    if (data.get("n_group") or 1) > 1:
        new["n_group"], new["topk_group"] = 2, 1
    if data.get("first_k_dense_replace"):
        new["first_k_dense_replace"] = 1  # one dense block, then one MoE block
    for name, value in TINY_LATENT.items():
        if data.get(name):
            new[name] = value
    if data.get("qk_rope_head_dim"):  # DeepSeek's rotary embedding is as wide as the rope part of a head
        new["head_dim"] = TINY_LATENT["qk_rope_head_dim"]
    return new


def _canonical_keys(config: PretrainedConfig, values: dict[str, Any]) -> dict[str, Any]:
    """Map generic names (hidden_size) to the class's own keys (n_embd) for `from_dict`."""
    attribute_map = getattr(config, "attribute_map", {}) or {}
    return {attribute_map.get(k, k): v for k, v in values.items()}
