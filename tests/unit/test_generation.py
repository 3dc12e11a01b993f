"""Sampling: the sampler's log-probs are the teacher-forced log-probs; greedy and top-k behave."""

from __future__ import annotations

import pytest
import torch

from tandem.models.forward import pack_rows, packed_logprobs
from tandem.sampler.generation import draw, generate_groups, sample_next


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_sampler_logprobs_equal_teacher_forced_logprobs(tiny_model):
    """What makes the on-policy ratio exactly 1: generation (left-padded, KV cache, early exits)
    and training (packed rows) must score the same tokens the same way."""
    prompts = _prompts(tiny_model.config.vocab_size, (4, 9, 6))
    gen = generate_groups(
        tiny_model,
        prompts,
        num_generations=3,
        max_new_tokens=10,
        eos_token_ids=[2],
        pad_token_id=0,
        batch_size=6,
        temperature=0.8,
        generator=torch.Generator().manual_seed(1),
    )
    assert len(gen.token_ids) == 9
    rows = [(p, gen.token_ids[3 * i : 3 * i + 3]) for i, p in enumerate(prompts)]
    with torch.no_grad():
        teacher = packed_logprobs(tiny_model, pack_rows(rows), temperature=0.8)
    for k, (ids, lps) in enumerate(zip(gen.token_ids, gen.logprobs)):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 10
        assert gen.finished[k] == (ids[-1] == 2)
        torch.testing.assert_close(torch.tensor(lps), teacher[k, : len(ids)], rtol=1e-5, atol=1e-5)


def test_generation_is_reproducible_with_a_seeded_generator(tiny_model):
    prompts = _prompts(tiny_model.config.vocab_size, (5, 7))
    kw = dict(num_generations=2, max_new_tokens=6, eos_token_ids=[2], pad_token_id=0)
    a = generate_groups(tiny_model, prompts, generator=torch.Generator().manual_seed(3), **kw)
    b = generate_groups(tiny_model, prompts, generator=torch.Generator().manual_seed(3), **kw)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_greedy_and_top_k_one_agree():
    logits = torch.randn(5, 11)
    greedy, greedy_lp = sample_next(logits, temperature=0.0, top_k=0, top_p=1.0, generator=None)
    top1, top1_lp = sample_next(logits, temperature=1.0, top_k=1, top_p=1.0, generator=None)
    assert torch.equal(greedy, logits.argmax(-1)) and torch.equal(top1, greedy)
    # the log-prob is the untruncated policy's, not the truncated sampling distribution's
    torch.testing.assert_close(top1_lp, torch.log_softmax(logits, -1).gather(1, greedy[:, None]).squeeze(1))
    torch.testing.assert_close(greedy_lp, top1_lp)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    drawn = {
        int(sample_next(logits, temperature=1.0, top_k=0, top_p=0.7, generator=g)[0]) for _ in range(200)
    }
    assert drawn == {0, 1}  # 0.5 < 0.7 so the second token is needed; 0.8 >= 0.7 stops there


def test_draw_follows_the_weights_and_never_picks_a_zero():
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 5.0, 0.0, 2.0, 0.0]]).repeat(4000, 1)  # unnormalised
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.cat([draw(weights, g) for _ in range(10)]), minlength=8).double()
    expected = 40000 * weights[0].double() / weights[0].sum()
    assert counts[weights[0] == 0].sum() == 0
    nonzero = expected > 0
    chi2 = ((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum()
    assert chi2 < 16.3  # chi-square with 3 degrees of freedom: p = 0.001


def test_draw_at_the_edges_of_the_unit_interval():
    # a single non-zero weight, first or last, is always the one drawn, whatever the uniform
    for row in ([1.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 1e-30, 0.0]):
        weights = torch.tensor([row]).repeat(1000, 1)
        assert torch.all(draw(weights, torch.Generator().manual_seed(1)) == torch.tensor(row).argmax())


def test_completions_do_not_depend_on_how_often_the_host_synchronises(tiny_model):
    """A GPU checks for finished rows every few steps (finished rows ride along meanwhile), a CPU every
    step: each (step, completion) has its own uniform draw, so the completions are the same."""
    prompts = _prompts(tiny_model.config.vocab_size, (4, 9, 6))
    kw = dict(num_generations=3, max_new_tokens=12, eos_token_ids=[2, 5, 7], pad_token_id=0, batch_size=9)
    runs = [
        generate_groups(tiny_model, prompts, generator=torch.Generator().manual_seed(4), check_every=k, **kw)
        for k in (1, 3, 8, 100)
    ]
    assert any(len(ids) < 12 for ids in runs[0].token_ids)  # some rows finished early: the case at stake
    for other in runs[1:]:
        assert other.token_ids == runs[0].token_ids and other.finished == runs[0].finished
        for a, b in zip(other.logprobs, runs[0].logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_the_random_stream_is_drawn_on_the_cpu_whatever_the_device():
    """The uniforms come from the CPU generator (a CUDA tensor cannot be drawn with it), so the stream
    is the checkpointed CPU generator's on every device."""
    from tandem.sampler.generation import uniforms

    u = uniforms((3, 4), torch.Generator().manual_seed(9), torch.device("cpu"))
    assert torch.equal(u, torch.rand((3, 4), generator=torch.Generator().manual_seed(9)))
    assert u.dtype == torch.float32


def test_a_non_finite_logit_is_an_error_not_a_token(tiny_model):
    """fp16 overflow makes NaN logits; the inverse-CDF draw then searched past the vocabulary."""
    import copy

    weights = torch.tensor([[1.0, float("nan"), 2.0], [float("nan")] * 3, [0.0, 1.0, 0.0]])
    ids = draw(weights, torch.Generator().manual_seed(0))
    assert ((ids >= 0) & (ids < 3)).all()
    broken = copy.deepcopy(tiny_model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[7] = float("nan")
    prompts = _prompts(tiny_model.config.vocab_size, (4, 5))
    for check_every in (1, 8):
        with pytest.raises(RuntimeError, match="non-finite logit .* decode step 0"):
            generate_groups(
                broken,
                prompts,
                num_generations=2,
                max_new_tokens=6,
                eos_token_ids=[2],
                pad_token_id=0,
                generator=torch.Generator().manual_seed(0),
                check_every=check_every,
            )


def test_a_bf16_rollout_copy_scores_with_an_fp32_head(tiny_model):
    """The trainer scores with an fp32 output projection; the sampler's log-probs come from the same
    head precision, so a bf16 rollout copy differs from the trainer only by its body's precision."""
    import copy

    from tandem.sampler.generation import head_weight

    bf16 = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert head_weight(bf16).dtype == torch.float32
    prompts = _prompts(tiny_model.config.vocab_size, (6,))
    gen = generate_groups(
        bf16, prompts, num_generations=1, max_new_tokens=1, eos_token_ids=[2], pad_token_id=0, temperature=0.0
    )
    with torch.no_grad():
        hidden = bf16.get_decoder()(input_ids=torch.tensor(prompts)).last_hidden_state[0, -1]
        expected = torch.log_softmax(hidden.float() @ bf16.get_output_embeddings().weight.float().T, -1).max()
    assert gen.logprobs[0][0] == pytest.approx(float(expected), abs=1e-6)
