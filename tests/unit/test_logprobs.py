"""The fused log-prob head and the packed forward against straightforward full log-softmax."""

from __future__ import annotations

import pytest
import torch

from tandem.algorithms.logprobs import linear_token_logprobs, logits_token_logprobs
from tandem.models.forward import pack_rows, packed_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_fused_head_matches_full_log_softmax_values_and_grads(temperature, chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    upstream = torch.randn(10, dtype=torch.float64)

    ours = linear_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    (ours.double() * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    naive = (
        torch.log_softmax((hidden @ weight.T) / temperature, dim=-1).gather(1, targets[:, None]).squeeze(1)
    )
    (naive * upstream).sum().backward()
    # the fused head works in float32 logits, whatever the input dtype
    torch.testing.assert_close(ours.double(), naive, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-4, atol=1e-5)


def test_fused_head_passes_gradcheck_in_float64_weights():
    torch.manual_seed(1)
    hidden = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 6, 3, 3])
    # float32 logits inside: loose tolerances, but the analytic backward must agree
    assert torch.autograd.gradcheck(
        lambda h, w: linear_token_logprobs(h, w, targets, chunk_size=2).double(),
        (hidden, weight),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
    )


def _naive_completion_logprobs(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0]  # [L, V] full log-softmax, one sequence alone
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logits_token_logprobs(logits[positions], torch.tensor(completion))


def test_packed_rows_equal_each_sequence_scored_alone(tiny_model):
    g = torch.Generator().manual_seed(0)
    vocab = tiny_model.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9)]
    completions = [
        [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens] for lens in ((4, 1, 6), (3, 0))
    ]
    packed = pack_rows(list(zip(prompts, completions)))
    with torch.no_grad():
        out = packed_logprobs(tiny_model, packed)
    k = 0
    for prompt, group in zip(prompts, completions):
        for completion in group:
            if completion:
                with torch.no_grad():
                    expected = _naive_completion_logprobs(tiny_model, prompt, completion)
                torch.testing.assert_close(out[k, : len(completion)], expected, rtol=1e-5, atol=1e-5)
            assert torch.all(out[k, len(completion) :] == 0)
            k += 1
    assert out.shape == (5, 6)


def test_memory_trimming_hooks_leave_the_gradients_bit_identical(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from tandem.distributed.runtime import _LIBC, trim_memory_in_training

    packed = pack_rows([([5, 6, 7, 8], [[9, 10, 11], [12, 13]]), ([14, 15], [[16, 17, 18, 19]])])
    grads = []
    for hooked in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layers = model.config.num_hidden_layers
        if hooked:
            assert trim_memory_in_training(model, every=1) == (layers if _LIBC is not None else 0)
        packed_logprobs(model, packed).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_fused_entropy_matches_full_softmax_and_leaves_the_logprobs_alone(temperature, chunk_size):
    torch.manual_seed(2)
    hidden = torch.randn(10, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    hidden.data[0] *= 40  # a near-one-hot row: most exp() underflow to 0, whose e log e must be 0
    targets = torch.randint(0, 50, (10,))
    plain = linear_token_logprobs(hidden, weight, targets, temperature=temperature, chunk_size=chunk_size)
    plain.sum().backward()
    plain_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logprobs, entropy = linear_token_logprobs(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk_size, return_entropy=True
    )
    logprobs.sum().backward()
    # the entropy changes nothing of the log-probs or their gradients, and carries no gradient
    assert torch.equal(logprobs, plain) and not entropy.requires_grad
    assert torch.equal(hidden.grad, plain_grads[0]) and torch.equal(weight.grad, plain_grads[1])
    with torch.no_grad():
        logits = (hidden.double() @ weight.double().T) / temperature
        p = torch.softmax(logits, dim=-1)
        expected = -(p * torch.log_softmax(logits, dim=-1)).sum(dim=-1)
    torch.testing.assert_close(entropy.double(), expected, rtol=1e-5, atol=1e-5)
    assert entropy[0] < 1e-3 < entropy[1:].min()


def test_packed_entropy_equals_a_full_softmax_chunk_by_chunk(tiny_model, monkeypatch):
    """Each token's entropy from the packed forward equals a direct full softmax over the model's
    logits, and no chunk holds more than chunk_size rows of vocabulary logits."""
    import tandem.algorithms.logprobs as fused

    rows_seen = []
    real = fused._entropy_in_place

    def spy(logits, peak, entropy):
        rows_seen.append(logits.shape)
        return real(logits, peak, entropy)

    monkeypatch.setattr(fused, "_entropy_in_place", spy)
    g = torch.Generator().manual_seed(1)
    vocab = tiny_model.config.vocab_size
    prompt = torch.randint(3, vocab, (5,), generator=g).tolist()
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (4, 7)]
    with torch.no_grad():
        logprobs, entropy = packed_logprobs(
            tiny_model, pack_rows([(prompt, completions)]), chunk_size=4, return_entropy=True
        )
        plain = packed_logprobs(tiny_model, pack_rows([(prompt, completions)]), chunk_size=4)
    assert torch.equal(logprobs, plain)
    assert rows_seen and all(shape == (4, vocab) or shape[0] < 4 for shape in rows_seen)
    for k, completion in enumerate(completions):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = tiny_model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.distributions.Categorical(logits=logits).entropy()
        torch.testing.assert_close(entropy[k, : len(completion)], expected, rtol=1e-4, atol=1e-4)
        assert torch.all(entropy[k, len(completion) :] == 0)
