"""What only a GPU can show (`make gpu-check` runs these; skipped without CUDA): sampling on CUDA,
device-mapped process groups, checkpoint state on the rank's own device, TF32, precision."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.models.forward import pack_rows, packed_logprobs
from tandem.sampler.generation import generate_groups

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _generate(model, prompts, **kw):
    return generate_groups(
        model,
        prompts,
        num_generations=4,
        max_new_tokens=24,
        eos_token_ids=[2],
        pad_token_id=0,
        generator=torch.Generator().manual_seed(5),
        **kw,
    )


def test_sampling_on_cuda_draws_the_cpu_generators_stream(tiny_model):
    """The first GPU run died at the first sampled token (a CPU generator drawing on CUDA). The
    uniforms now come from the CPU generator on every device: an fp32 model samples the same
    completions on the GPU as on the CPU (TF32 off: exact fp32 on both)."""
    torch.set_float32_matmul_precision("highest")
    prompts = _prompts(tiny_model.config.vocab_size, (5, 9, 3))
    on_cpu = _generate(tiny_model, prompts)
    on_gpu = _generate(copy.deepcopy(tiny_model).to(CUDA), prompts)
    assert on_gpu.token_ids == on_cpu.token_ids and on_gpu.finished == on_cpu.finished
    for a, b in zip(on_gpu.logprobs, on_cpu.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


def test_cuda_completions_do_not_depend_on_the_synchronisation_interval(tiny_model):
    model = copy.deepcopy(tiny_model).to(CUDA)
    prompts = _prompts(tiny_model.config.vocab_size, (5, 9, 3))
    every_step, every_eighth = _generate(model, prompts, check_every=1), _generate(model, prompts)
    assert every_step.token_ids == every_eighth.token_ids


def test_sampler_logprobs_equal_the_trainers_on_cuda(tiny_model):
    """What the first step's ratio rests on: generation and the packed forward score alike on a GPU."""
    model = copy.deepcopy(tiny_model).to(CUDA)
    prompts = _prompts(tiny_model.config.vocab_size, (6, 4))
    gen = _generate(model, prompts)
    rows = [(p, gen.token_ids[4 * i : 4 * i + 4]) for i, p in enumerate(prompts)]
    with torch.no_grad():
        teacher = packed_logprobs(model, pack_rows(rows).to(CUDA))
    for k, lps in enumerate(gen.logprobs):
        torch.testing.assert_close(
            torch.tensor(lps, device=CUDA), teacher[k, : len(lps)], rtol=1e-3, atol=1e-3
        )


def test_fused_entropy_on_cuda_equals_the_full_softmax(tiny_model):
    """The chunked head's entropy (logged as `entropy`) on a GPU, fp32 and bf16 bodies, against the
    entropy of each completion's whole softmax from a plain forward on the CPU."""
    vocab = tiny_model.config.vocab_size
    prompt = _prompts(vocab, (5,))[0]
    completions = _prompts(vocab, (4, 7, 2))
    expected = []
    for completion in completions:
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        expected.append(torch.distributions.Categorical(logits=logits.float()).entropy())
    packed = pack_rows([(prompt, completions)]).to(CUDA)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 5e-2)):
        model = copy.deepcopy(tiny_model).to(CUDA, dtype)
        with torch.no_grad():
            _, entropy = packed_logprobs(model, packed, chunk_size=4, return_entropy=True)
        for k, want in enumerate(expected):
            torch.testing.assert_close(entropy[k, : len(want)].cpu(), want, rtol=tol, atol=tol)
            assert torch.all(entropy[k, len(want) :] == 0)


def test_fp16_sampling_never_leaves_the_vocabulary(tiny_model):
    model = copy.deepcopy(tiny_model).to(CUDA, torch.float16)
    gen = _generate(model, _prompts(tiny_model.config.vocab_size, (5, 7)))
    assert all(0 <= t < tiny_model.config.vocab_size for ids in gen.token_ids for t in ids)


DRIVER = textwrap.dedent(
    """
    import json, sys, torch
    from tandem.distributed.env import DistEnv, all_reduce_sum, broadcast_json, init_distributed, shutdown
    from tandem.distributed.env import scatter_tensor_dicts
    env = init_distributed("ddp", "cuda", sys.argv[1])
    assert broadcast_json(env, {"a": 1}) == {"a": 1}
    assert all_reduce_sum(env, [2.0]) == [2.0]
    got = scatter_tensor_dicts(env, [{"x": torch.arange(3)}] if env.is_main else None)
    cuda_sum = torch.ones(2, device="cuda")
    torch.distributed.all_reduce(cuda_sum)
    print(json.dumps({"backend": env.backend, "pg": str(torch.distributed.get_backend()),
                      "cuda_sum": cuda_sum.tolist(), "got": str(got)}))
    shutdown(env)
    """
)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_group_of_one_moves_cpu_and_cuda_tensors(backend, tmp_path):
    """nccl alone refuses CPU tensors ("No backend type associated with device type cpu"): every
    DDP/DeepSpeed run died before its first step. gloo alone is the vGPU fallback."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, backend], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"cuda_sum": [1.0, 1.0]' in proc.stdout


def _engine(model, device):
    from tandem.config import TrainingConfig
    from tandem.distributed.engine import TorchEngine
    from tandem.distributed.env import DistEnv

    return TorchEngine(model, TrainingConfig(max_steps=4), DistEnv(), device)


def test_optimizer_state_loads_onto_the_ranks_own_device(tiny_model, tmp_path):
    """torch.load without map_location put each rank's optimizer state first where it was saved
    (rank 0's GPU). Saved on the GPU and loaded by a CPU engine, nothing may land on the GPU."""
    gpu_model = copy.deepcopy(tiny_model).to(CUDA)
    engine = _engine(gpu_model, CUDA)
    gpu_model(torch.ones(1, 4, dtype=torch.long, device=CUDA)).logits.sum().backward()
    engine.step()
    engine.save(tmp_path)
    cpu_engine = _engine(copy.deepcopy(tiny_model), torch.device("cpu"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cpu_engine.load(tmp_path)
    assert torch.cuda.max_memory_allocated() == before
    state = cpu_engine.optimizer.state_dict()["state"]
    assert state and all(not t.is_cuda for s in state.values() for t in s.values() if torch.is_tensor(t))


def test_a_checkpoint_restores_the_cuda_random_state(tiny_model, tmp_path):
    from tandem.distributed.env import DistEnv
    from tandem.trainer import checkpoint as ckpt

    model = copy.deepcopy(tiny_model).to(CUDA)
    engine = _engine(model, CUDA)
    torch.cuda.manual_seed(123)
    torch.rand(3, device=CUDA)
    path = ckpt.save_checkpoint(tmp_path, 1, engine=engine, env=DistEnv(), trainer_state={})
    after_save = torch.rand(5, device=CUDA)
    torch.rand(7, device=CUDA)  # the stream moves on
    ckpt.load_checkpoint(path, engine=_engine(model, CUDA), env=DistEnv())
    assert torch.equal(torch.rand(5, device=CUDA), after_save)


def test_tf32_is_on_for_cuda_runs_unless_turned_off():
    from tandem.distributed.runtime import use_device

    use_device(CUDA)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "high"
    use_device(CUDA, tf32=False)
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"


def test_no_host_heap_trimming_on_a_gpu(tiny_model):
    """malloc_trim between phases and inside the training pass is a CPU remedy (the CPU's tensors
    fill the host heap); on a GPU it would only cost time."""
    from tandem.distributed import runtime

    model = copy.deepcopy(tiny_model).to(CUDA)
    runtime.use_device(CUDA)
    assert runtime.trim_memory_in_training(model) == 0 and not runtime._TRIM


def test_a_gpu_snapshot_copies_into_a_page_locked_heap_buffer(tiny_model):
    """Without /dev/shm (or for remote samplers only) a GPU trainer's heap buffers are registered
    page-locked, every copy queued at once; the bytes equal a plain copy's."""
    from tandem.transport.weights import SnapshotBuffers, take_snapshot

    class Idle:
        def busy(self, _buffer) -> bool:
            return False

    model = copy.deepcopy(tiny_model).to(CUDA)
    named = list(model.named_parameters())
    buffers = SnapshotBuffers()
    snap = buffers.snapshot(named, publisher=Idle(), version=0, run_id="r")
    assert snap.path is None and snap.flat.is_pinned()
    plain = take_snapshot([(n, p.cpu()) for n, p in named], version=0, run_id="r")
    assert torch.equal(snap.flat, plain.flat)
    buffers.close()
    assert not snap.flat.is_pinned()
