"""Writes tasks.jsonl next to this file: 240 short arithmetic questions as chat prompts, each with its
`solution` and an `op` column (any extra column reaches the rewards by name)."""

import json
import random
from pathlib import Path

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}

rng = random.Random(0)
with open(Path(__file__).with_name("tasks.jsonl"), "w") as f:
    for _ in range(240):
        op = rng.choice(sorted(OPS))
        a, b = rng.randint(2, 20), rng.randint(2, 12)
        prompt = [
            {"role": "system", "content": "You are a calculator. Reply with the result only."},
            {"role": "user", "content": f"What is {a} {op} {b}?"},
        ]
        f.write(json.dumps({"prompt": prompt, "solution": f"${OPS[op](a, b)}$", "op": op}) + "\n")
