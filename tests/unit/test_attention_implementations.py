"""Packed forwards under every attention implementation the config accepts, against each sequence
scored alone by a plain forward: GRPO/DPO rows, SFT packing and the value head, values and
gradients, in fp32 on tiny random Llama and Qwen2 models. flash-attention's route ("unpacked") runs
here with sdpa, eager and a stand-in varlen attention; segment attention's CUDA branch (key/value
heads expanded) runs on the CPU through its flag."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tandem.algorithms.sft import sft_loss
from tandem.data.sft import EncodedExample
from tandem.models import attention
from tandem.models.forward import attention_route, decoder_hidden_states, pack_rows, packed_logprobs
from tandem.models.value_head import ValueHeadModel
from tandem.trainer.sft import collate

VOCAB = 96
FAKE_FLASH = "tandem_test_flash_varlen"


def _tiny_model(arch: str, implementation: str, seed: int = 0):
    """A 2-layer model with grouped key/value heads (4 query heads, 2 key heads); the same weights
    for every implementation of one seed."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config = LlamaConfig(**kw) if arch == "llama" else Qwen2Config(**kw, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.config._attn_implementation = implementation
    return model


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def _group_rows(seed: int = 1) -> list[tuple[list[int], list[list[int]]]]:
    """Prompts of different lengths with several completions (one empty, one a single token), a
    prompt alone, and a DPO-like pair."""
    g = torch.Generator().manual_seed(seed)
    return [
        (_ids(g, 7), [_ids(g, 5), _ids(g, 9), [], _ids(g, 1)]),
        (_ids(g, 12), [_ids(g, 3), _ids(g, 4)]),
        (_ids(g, 2), []),
        (_ids(g, 4), [_ids(g, 6), _ids(g, 6)]),
    ]


def _weights(shape: tuple[int, int], seed: int = 2) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _alone(model, rows, weights) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each prompt + completion scored alone by the model's plain forward: log-probs [N, T] and the
    gradients of sum(weights * log-probs)."""
    model.zero_grad()
    completions = [(p, c) for p, cs in rows for c in cs]
    out = torch.zeros(len(completions), max(len(c) for _, c in completions))
    loss = 0.0
    for k, (prompt, completion) in enumerate(completions):
        if not completion:
            continue
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
        logprobs = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
        picked = logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]
        loss = loss + (picked * weights[k, : len(completion)]).sum()
        out[k, : len(completion)] = picked.detach()
    loss.backward()
    return out, _grads(model)


def _packed(model, packed, weights, route=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    logprobs = packed_logprobs(model, packed, route=route)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), _grads(model)


def _assert_same(got, expected) -> None:
    (values, grads), (ref_values, ref_grads) = got, expected
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_logprobs_equal_each_sequence_scored_alone(arch, implementation):
    """The eager regression: transformers' eager attention adds the mask to the scores, and a bool
    mask added as 0/1 hid nothing (0.035 nats off on this batch). Now exact for both, the model's
    own route (sdpa: segments, eager: the additive dense mask)."""
    model = _tiny_model(arch, implementation)
    rows = _group_rows()
    packed = pack_rows(rows)
    weights = _weights(tuple(packed_logprobs(model, packed).shape))
    assert attention_route(model, packed) == ("segments" if implementation == "sdpa" else "dense")
    _assert_same(_packed(model, packed, weights), _alone(model, rows, weights))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_every_route_gives_the_segment_routes_logprobs_and_gradients(implementation):
    """The unpacked route (flash-attention's) and the dense mask equal the segment route, whichever
    attention computes them."""
    model = _tiny_model("llama", implementation, seed=3)
    packed = pack_rows(_group_rows(seed=4))
    weights = _weights(tuple(packed_logprobs(model, packed).shape), seed=5)
    reference = _packed(_tiny_model("llama", "sdpa", seed=3), packed, weights, route="segments")
    routes = ["dense", "unpacked"] + (["segments"] if implementation == "sdpa" else [])
    for route in routes:
        _assert_same(_packed(model, packed, weights, route=route), reference)


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A stand-in for flash-attention's varlen path, with its contract: no mask, one row, the
    sequences given by cu_seq_lens (int32) and their longest length."""
    assert attention_mask is None and query.shape[0] == 1 and dropout == 0.0
    bounds = kwargs["cu_seq_lens_q"]
    assert bounds.dtype == torch.int32 and torch.equal(bounds, kwargs["cu_seq_lens_k"])
    bounds = bounds.tolist()
    assert bounds[0] == 0 and bounds[-1] == query.shape[2]
    assert kwargs["max_length_q"] == max(b - a for a, b in zip(bounds, bounds[1:]))
    _varlen_attention.num_calls += 1
    outs = [
        F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True
        )
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs, dim=2).transpose(1, 2), None


_varlen_attention.num_calls = 0


@pytest.fixture
def fake_flash():
    """FAKE_FLASH registered with transformers, taking the flash-attention masks (none here)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(FAKE_FLASH, _varlen_attention)
    AttentionMaskInterface.register(FAKE_FLASH, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return FAKE_FLASH


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_flash_like_attention_gets_each_sequence_alone_and_scores_exactly(arch, fake_flash):
    """A dense 4D mask reached flash-attention as a padding mask (an index error on the CPU, a
    device-side assert on CUDA). Now it gets no mask and the sequence boundaries as cu_seq_lens."""
    model = _tiny_model(arch, fake_flash, seed=6)
    rows = _group_rows(seed=7)
    packed = pack_rows(rows)
    weights = _weights(tuple(packed_logprobs(model, packed).shape), seed=8)
    assert attention_route(model, packed) == "unpacked"
    num_calls = _varlen_attention.num_calls
    _assert_same(_packed(model, packed, weights), _alone(_tiny_model(arch, "sdpa", seed=6), rows, weights))
    assert _varlen_attention.num_calls == num_calls + model.config.num_hidden_layers
    with pytest.raises(ValueError, match="takes no 4D attention mask"):
        decoder_hidden_states(model, packed, route="dense")


def test_flash_attention_2_takes_the_unpacked_route():
    model = _tiny_model("llama", "flash_attention_2")
    assert attention_route(model, pack_rows(_group_rows())) == "unpacked"
    assert model.config._attn_implementation == "flash_attention_2"  # not switched to tandem_sdpa


def test_unpacked_layout_of_packed_rows():
    """Sequences laid end to end: each completion behind a copy of its prompt, a prompt with no
    completion alone; packed positions read the first copy, padding reads token 0."""
    packed = pack_rows([([1, 2], [[3], [], [4, 5]]), ([6, 7, 8], [])])
    seq = packed.sequences  # rows of width 5: [1 2 3 4 5], [6 7 8 pad pad]
    assert seq.gather_index.tolist() == [0, 1, 2, 0, 1, 3, 4, 5, 6, 7]
    assert seq.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]]
    assert seq.cu_seq_lens.tolist() == [0, 3, 7, 10] and seq.max_length == 4
    assert seq.scatter_index.tolist() == [0, 1, 2, 5, 6, 7, 8, 9, 0, 0]
    # the packed position ids are each sequence's own
    assert torch.equal(packed.position_ids.view(-1)[seq.gather_index], seq.position_ids[0])


def _sft_examples(seed: int = 9) -> list[EncodedExample]:
    """Examples of different lengths, the loss on their answers (and a gap inside one)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (3, 9), (10, 2), (2, 2), (5, 7)]  # (prompt, answer) lengths
    examples = [EncodedExample(_ids(g, p + a), [0] * p + [1] * a) for p, a in shapes]
    examples[1].loss_mask[5] = 0
    return examples


def _sft_alone(model, examples) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    num_tokens = sum(e.num_targets for e in examples)
    loss = 0.0
    for e in examples:
        logprobs = model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1].float().log_softmax(-1)
        picked = logprobs.gather(1, torch.tensor(e.input_ids[1:])[:, None])[:, 0]
        loss = loss - (picked * torch.tensor(e.loss_mask[1:], dtype=torch.float32)).sum() / num_tokens
    loss.backward()
    return float(loss.detach()), _grads(model)


@pytest.mark.parametrize("implementation,route", [("eager", None), ("sdpa", None), ("eager", "unpacked")])
def test_sft_packed_loss_equals_each_example_alone(implementation, route):
    """SFT packing: examples first-fit into rows of 16 tokens (block-diagonal attention)."""
    model = _tiny_model("llama", implementation, seed=10)
    examples = _sft_examples()
    packed, loss_mask = collate(examples, 0, packing=True, row_length=16)
    assert packed.input_ids.shape[0] < len(examples)  # rows do hold several examples
    seq = packed.sequences  # each example alone, at the positions it has in its row
    assert sorted(seq.cu_seq_lens.diff().tolist()) == sorted(len(e.input_ids) for e in examples)
    assert torch.equal(packed.position_ids.view(-1)[seq.gather_index], seq.position_ids[0])
    model.zero_grad()
    loss, _ = sft_loss(packed_logprobs(model, packed, route=route), loss_mask)
    loss.backward()
    ref_loss, ref_grads = _sft_alone(model, examples)
    assert abs(float(loss.detach()) - ref_loss) < 1e-5
    for a, b in zip(_grads(model), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_value_head_reads_the_states_of_each_sequence_alone(implementation):
    """PPO's packed forward: log-probs and values as if every completion were alone."""
    model = ValueHeadModel(_tiny_model("llama", implementation, seed=11))
    torch.nn.init.normal_(model.value_head.weight, generator=torch.Generator().manual_seed(12))
    rows = _group_rows(seed=13)
    logprobs, values = model(pack_rows(rows))
    k = 0
    for prompt, completions in rows:
        for completion in completions:
            if completion:
                ids = torch.tensor([prompt + completion])
                hidden = model.policy.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
                expected = model.value_head(hidden).squeeze(-1)
                torch.testing.assert_close(values[k, : len(completion)], expected, rtol=0, atol=1e-5)
                lp = model.policy(input_ids=ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
                expected = lp.gather(1, torch.tensor(completion)[:, None])[:, 0]
                torch.testing.assert_close(logprobs[k, : len(completion)], expected, rtol=0, atol=1e-5)
            k += 1


def _masked_reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d) masked) v with the key heads repeated: [R, L, H, D]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_segment_attention_with_expanded_heads_equals_grouped_heads():
    """The CUDA branch (key/value heads repeated, no enable_gqa) against the CPU one and attention
    written out, values and gradients in float64."""
    packed = pack_rows(_group_rows(seed=14))
    num_rows, width = packed.input_ids.shape
    real = torch.zeros(num_rows * width, dtype=torch.bool)
    real[packed.sequences.gather_index] = True
    real = real.view(num_rows, width)
    g = torch.Generator().manual_seed(15)
    q = torch.randn(num_rows, 6, width, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(num_rows, 2, width, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out_weights = torch.randn(num_rows, width, 6, 8, generator=g, dtype=torch.float64) * real[..., None, None]
    results = []
    for attend in (
        functools.partial(attention.segment_attention, layout=packed.layout, scale=None, expand_heads=True),
        functools.partial(attention.segment_attention, layout=packed.layout, scale=None, expand_heads=False),
        functools.partial(_masked_reference, mask=packed.attention_mask),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out * out_weights).sum().backward()
        results.append((out.detach()[real], [t.grad for t in leaves]))
    for out, grads in results[:2]:
        torch.testing.assert_close(out, results[2][0], rtol=1e-12, atol=1e-12)
        for a, b in zip(grads, results[2][1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_packed_logprobs_with_expanded_heads_equal_each_sequence_alone(monkeypatch):
    """The whole model through the CUDA branch of segment attention, on the CPU."""
    monkeypatch.setattr(
        attention, "segment_attention", functools.partial(attention.segment_attention, expand_heads=True)
    )
    model = _tiny_model("qwen2", "sdpa", seed=16)
    rows = _group_rows(seed=17)
    packed = pack_rows(rows)
    weights = _weights(tuple(packed_logprobs(model, packed).shape), seed=18)
    _assert_same(_packed(model, packed, weights), _alone(model, rows, weights))


@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flash_attention_2"])
def test_packed_logprobs_on_cuda_equal_each_sequence_alone(implementation):
    """On CUDA: segment attention's expanded-heads branch (sdpa), the additive mask (eager) and the
    varlen route (flash-attention, bf16 only) against each sequence scored alone."""
    dtype = torch.float32
    if implementation == "flash_attention_2":
        pytest.importorskip("flash_attn")
        dtype = torch.bfloat16
    from transformers import AutoModelForCausalLM

    source = _tiny_model("qwen2", "sdpa", seed=19)
    model = AutoModelForCausalLM.from_config(source.config, attn_implementation=implementation, dtype=dtype)
    model.load_state_dict(source.state_dict())
    model.to("cuda")
    rows = _group_rows(seed=20)
    with torch.no_grad():
        logprobs = packed_logprobs(model, pack_rows(rows).to(torch.device("cuda")))
        k = 0
        for prompt, completions in rows:
            for completion in completions:
                if completion:
                    ids = torch.tensor([prompt + completion], device="cuda")
                    lp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
                    expected = lp.gather(1, torch.tensor(completion, device="cuda")[:, None])[:, 0]
                    tol = 2e-3 if dtype == torch.float32 else 5e-2  # TF32 may be on
                    torch.testing.assert_close(logprobs[k, : len(completion)], expected, rtol=0, atol=tol)
                k += 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_segment_attention_on_cuda_runs_without_the_math_kernel(dtype):
    """With the key/value heads expanded, the prefix call can take the flash kernel (bf16) and the
    masked segment call the memory-efficient one: SDPA limited to those two still runs (with
    enable_gqa it found no kernel for the segment call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    packed = pack_rows(_group_rows(seed=21)).to(torch.device("cuda"))
    num_rows, width = packed.input_ids.shape
    g = torch.Generator().manual_seed(22)
    q = torch.randn(num_rows, 6, width, 64, generator=g)
    k, v = (torch.randn(num_rows, 2, width, 64, generator=g) for _ in range(2))
    real = torch.zeros(num_rows * width, dtype=torch.bool, device="cuda")
    real[packed.sequences.gather_index] = True
    expected = _masked_reference(q.double(), k.double(), v.double(), packed.attention_mask.cpu())
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = attention.segment_attention(*(t.to("cuda", dtype) for t in (q, k, v)), packed.layout, None)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(
        out.float()[real.view(num_rows, width)].cpu(),
        expected.float()[real.view(num_rows, width).cpu()],
        rtol=0,
        atol=tol,
    )
