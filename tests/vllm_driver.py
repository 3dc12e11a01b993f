"""Checks of `sampling.backend: vllm`'s engine, run in a process of its own (tests/integration/test_vllm.py).

vLLM's in-process engine pins the threads of the process that starts it and opens a
torch.distributed group there, so one engine is started once here, for every check, rather than
inside pytest. Writes the measured numbers as JSON to argv[2]; the test asserts on them.

    python tests/vllm_driver.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

TEMPERATURE = 0.7


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's numbers: log_softmax(logits / T) of each completion token, one plain forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def max_diff(engine_values, reference: torch.Tensor) -> float:
    return float((torch.tensor(engine_values) - reference).abs().max())


def episode_checks(engine, hf, model_dir: str, prompts: list[list[int]], eos: int) -> dict:
    from transformers import AutoTokenizer

    from tandem.agent.tools import tool_from_callable
    from tandem.config import AgentConfig
    from tandem.sampler.episodes import EpisodeRunner
    from tandem.sampler.generation import Generation
    from tandem.types import Example
    from tiny_agent import add

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    call = tokenizer(
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', add_special_tokens=False
    )["input_ids"] + [eos]
    generator = torch.Generator().manual_seed(3)

    def turn(ids, g, n):
        if g > 1:  # the first turn: every episode calls the tool
            rows = [p for p in ids for _ in range(g)]
            lps = [hf_logprobs(hf, p, call, TEMPERATURE).tolist() for p in rows]
            return Generation([list(call) for _ in rows], lps, [True] * len(rows))
        return engine.generate(
            ids,
            num_generations=1,
            max_new_tokens=n,
            eos_token_ids=[eos],
            temperature=TEMPERATURE,
            generator=generator,
        )

    runner = EpisodeRunner(
        AgentConfig(tools=["x:add"], max_turns=2), tokenizer, [tool_from_callable(add)], None
    )
    examples = [Example(f"p{i}", "q", "5") for i in range(len(prompts))]
    try:
        n = len(call) + 12  # a turn: room for the call, then 12 tokens of the engine's
        episodes = runner.run(turn, examples, lambda ex: ("", prompts[int(ex.prompt_id[1:])]), 2, n)
    finally:
        runner.close()
    diffs, tool_zero = [], True
    for e, (ids, lps, mask) in enumerate(zip(episodes.token_ids, episodes.logprobs, episodes.policy_masks)):
        whole = hf_logprobs(hf, prompts[e // 2], ids, TEMPERATURE)
        keep = torch.tensor(mask) == 1
        diffs.append(float((torch.tensor(lps)[keep] - whole[keep]).abs().max()))
        tool_zero &= all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
    return {
        "episode_turns": episodes.turns,
        "episode_tool_calls": episodes.tool_calls,
        "episode_second_turn_tokens": [
            len(ids) - mask.index(1, len(call))
            for ids, mask in zip(episodes.token_ids, episodes.policy_masks)
        ],
        "episode_logprob_max_diff": max(diffs),
        "episode_tool_logprobs_zero": tool_zero,
    }


def main(model_dir: str, out_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from tandem.config import LoraSpec, VLLMSpec
    from tandem.models.lora import apply_lora
    from tandem.sampler.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        model_dir,
        spec=VLLMSpec(cpu_threads_bind="nobind"),
        dtype="float32",
        device=torch.device("cpu"),
        seed=0,
        max_new_tokens=12,
        batch_size=16,
        num_threads=1,
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = hf.config.eos_token_id
    prompts = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65, 66]]
    result: dict = {"start_seconds": engine.start_seconds, "environment": engine.environment}

    def generate(seed: int):
        return engine.generate(
            prompts,
            num_generations=4,
            max_new_tokens=12,
            eos_token_ids=[eos],
            temperature=TEMPERATURE,
            generator=torch.Generator().manual_seed(seed),
        )

    gen = generate(5)
    result["lengths"] = [len(t) for t in gen.token_ids]
    result["finished"] = gen.finished
    result["ends_in_eos"] = [bool(t) and t[-1] == eos for t in gen.token_ids]
    result["distinct_in_group"] = [
        len({tuple(t) for t in gen.token_ids[p * 4 : p * 4 + 4]}) for p in range(3)
    ]
    result["generation_logprob_max_diff"] = max(
        max_diff(lp, hf_logprobs(hf, prompts[i // 4], ids, TEMPERATURE))
        for i, (ids, lp) in enumerate(zip(gen.token_ids, gen.logprobs))
    )
    result["same_seed_same_tokens"] = generate(5).token_ids == gen.token_ids
    result["other_seed_other_tokens"] = generate(6).token_ids != gen.token_ids

    # a new version: every weight moves; loaded in place, the engine's log-probs of fixed tokens follow
    prompt, completion = prompts[0], gen.token_ids[0]
    before = engine.logprobs(prompt, completion)
    result["initial_logprob_max_diff"] = max_diff(before, hf_logprobs(hf, prompt, completion, 1.0))
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)
    result["load_seconds"] = engine.load_weights(hf)
    after = engine.logprobs(prompt, completion)
    result["reload_changed_by"] = max_diff(after, torch.tensor(before))
    result["reload_logprob_max_diff"] = max_diff(after, hf_logprobs(hf, prompt, completion, 1.0))

    # agent episodes on the engine (sampler/episodes.py): a first turn that calls a tool (scripted,
    # with the weights' own log-probs), then the engine continues each episode from its tokens; the
    # policy tokens' log-probs must be the weights' over the whole episode, tool tokens 0
    result.update(episode_checks(engine, hf, model_dir, prompts, eos))

    # LoRA: adapters on the new weights, with B away from 0 (as after training); the engine gets W + BA
    peft = apply_lora(hf, LoraSpec(enabled=True, r=4, alpha=8.0)).eval()
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=noise) * 0.1)
    start = time.perf_counter()
    engine.load_weights(peft)
    result["lora_load_seconds"] = time.perf_counter() - start
    lora_after = engine.logprobs(prompt, completion)
    result["lora_changed_by"] = max_diff(lora_after, torch.tensor(after))
    result["lora_logprob_max_diff"] = max_diff(lora_after, hf_logprobs(peft, prompt, completion, 1.0))
    engine.close()
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
