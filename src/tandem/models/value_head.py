"""The policy with a value head (PPO's critic on the policy's trunk): one packed forward gives the
completion tokens' log-probs and values. Pass it to `build_engine(policy, ..., forward=...)`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.algorithms.logprobs import linear_token_logprobs
from tandem.models.forward import PackedRows, decoder_hidden_states

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHeadModel(torch.nn.Module):
    """A causal LM plus a Linear(hidden, 1) on its last hidden states (TRL's classic value-head
    model: one trunk for actor and critic). forward(packed rows of models/forward.py pack_rows,
    temperature) -> (token log-probs, values), both [num_completions, T] float32, 0 past a
    completion's length.

    The value of completion token t is read from the hidden state that predicts it, so it is
    V(prompt + completion[:t]): the value of the state in which token t is chosen, as GAE wants.
    The head starts at zero (every value 0) and runs in fp32, outside any autocast.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy
        device = next(policy.parameters()).device
        self.value_head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=torch.float32, device=device)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, packed: PackedRows, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = packed.completion_lengths
        shape = (len(lengths), max(lengths, default=0))
        if packed.targets.numel() == 0:
            empty = torch.zeros(shape, dtype=torch.float32, device=packed.input_ids.device)
            return empty, empty.clone()
        hidden = decoder_hidden_states(self.policy, packed)  # [R, L, H]
        states = hidden[packed.predict_rows, packed.predict_cols]  # [N, H], one per completion token
        weight = self.policy.get_output_embeddings().weight
        # the output projection in fp32, as packed_logprobs: the importance ratio sees its rounding
        token_logprobs = linear_token_logprobs(
            states, weight.float(), packed.targets, temperature=temperature
        )
        with torch.autocast(states.device.type, enabled=False):  # DeepSpeed bf16 casts the head too
            token_values = self.value_head(states.to(self.value_head.weight.dtype)).squeeze(-1)  # [N]
        return _to_rows(token_logprobs, lengths, shape), _to_rows(token_values, lengths, shape)

    def save_value_head(self, folder: Path) -> None:
        """The head's weights as `folder/value_head.safetensors` (next to the policy's HF files)."""
        from safetensors.torch import save_file

        params = list(self.value_head.parameters())
        if any(p.numel() == 0 for p in params):  # a ZeRO-3 shard: the caller must gather first
            raise RuntimeError("the value head is partitioned (ZeRO-3); save it inside engine.gathered()")
        tensors = {k: v.detach().float().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(tensors, str(Path(folder) / VALUE_HEAD_FILE))

    def load_value_head(self, folder: Path) -> None:
        from safetensors.torch import load_file

        path = Path(folder) / VALUE_HEAD_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: a PPO checkpoint keeps its value head there; resume from a "
                "checkpoint of a `tandem ppo` run, or start a new run from its model/ folder"
            )
        with torch.no_grad():
            for name, value in load_file(str(path)).items():
                target = self.value_head.get_parameter(name)
                target.copy_(value.to(target.dtype))


def _to_rows(flat: torch.Tensor, lengths: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """Completion-ordered token values [N] -> right-padded rows [num_completions, T]."""
    out = torch.zeros(shape, dtype=torch.float32, device=flat.device)
    lengths_t = torch.tensor(lengths, device=flat.device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=flat.device), lengths_t)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    cols = torch.arange(rows.numel(), device=flat.device) - starts[rows]
    return out.index_put((rows, cols), flat.float())
