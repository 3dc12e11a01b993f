"""Reward models: a scalar head on a causal LM, scoring the last token of prompt + answer.

A reward model is saved as a Hugging Face sequence-classification folder (num_labels=1), so
`AutoModelForSequenceClassification.from_pretrained` loads it anywhere. `ScoreModule` is the
forward the trainers and scorers share: right-padded rows, the score read at each row's last
real token (no dependence on which id pads).
"""

from __future__ import annotations

import torch

from tandem.models.loading import load_causal_lm, load_tokenizer


def load_reward_model(spec: str, **kwargs):
    """A reward model from a `tandem rm` folder, or a fresh scalar head on any causal LM (HF
    folder, hub id, GGUF, `embedded`); keyword arguments as load_causal_lm's."""
    from transformers import AutoModelForSequenceClassification

    return load_causal_lm(spec, auto_class=AutoModelForSequenceClassification, num_labels=1, **kwargs)


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], lengths [B]) of right-padded token sequences."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    input_ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return input_ids, lengths


class ScoreModule(torch.nn.Module):
    """forward(input_ids [B, L], lengths [B]) -> scores [B] float32: the head applied to the hidden
    state of each row's last real token (causal attention: padding after it is never seen)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        attention_mask = (positions[None, :] < lengths[:, None]).long()
        # under LoRA the HF model sits inside the PEFT wrapper (its layers carry the adapters)
        model = self.model.get_base_model() if hasattr(self.model, "peft_config") else self.model
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), lengths - 1]
        head = model.score  # the Linear(hidden, 1) of HF's *ForSequenceClassification
        return head(last.to(next(head.parameters()).dtype)).squeeze(-1).float()


class RewardScorer:
    """A frozen reward model that scores (prompt messages, answer) pairs in batches, for the
    sampler's `type: model` reward and Safe-MM-DPO's margins."""

    def __init__(
        self,
        path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        batch_size: int = 16,
        max_length: int = 1024,
    ) -> None:
        self.tokenizer = load_tokenizer(path)
        self.model = load_reward_model(path, dtype=dtype, device=device, trainable=False)
        self.forward = ScoreModule(self.model)
        self.device, self.batch_size, self.max_length = torch.device(device), batch_size, max_length

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores [N] of token sequences (prompt + answer, in this model's tokenizer)."""
        scores = []
        for first in range(0, len(sequences), self.batch_size):
            batch = [s[-self.max_length :] for s in sequences[first : first + self.batch_size]]
            input_ids, lengths = pad_right(batch, self.tokenizer.pad_token_id or 0)
            scores.append(self.forward(input_ids.to(self.device), lengths.to(self.device)).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def score(self, prompts: list[list[dict]], answers: list[str]) -> torch.Tensor:
        """Scores [N] of answers to chat prompts, rendered with this model's chat template."""
        from tandem.data.preferences import encode_answer, encode_prompt

        sequences = [
            encode_prompt(self.tokenizer, p) + encode_answer(self.tokenizer, a)
            for p, a in zip(prompts, answers)
        ]
        return self.score_ids(sequences)
