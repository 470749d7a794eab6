#!/usr/bin/env python3
"""The conversations `scripts/perf.sh` and `scripts/instructions.py` fill before they measure.

Each is MESSAGES - 1 alternating messages (the reply to the request makes MESSAGES), words drawn
with a fixed seed from loadbench's word list, different in each conversation: the same bodies
for every binary and every run.

Usage: scripts/perf_seeds.py DIR CONVERSATIONS MESSAGES   (writes DIR/seed-N.json, N from 0)
"""

import json
import random
import sys
from pathlib import Path

WORDS = Path(__file__).resolve().parent.parent / "examples/loadbench/words.txt"


def bodies(conversations, messages):
    """The request bodies that fill each conversation, as bytes."""
    words = WORDS.read_text().split()
    made = []
    for c in range(conversations):
        rng = random.Random(c)
        listed = []
        for i in range(messages - 1):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(16, 24)))
            listed.append(
                {
                    "role": "user" if i % 2 == 0 else "assistant",
                    "content": f"{text.capitalize()}. [conversation {c} #{i}]",
                }
            )
        made.append(json.dumps({"model": "gpt-4o-mini", "messages": listed}).encode())
    return made


if __name__ == "__main__":
    out, count, messages = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for c, body in enumerate(bodies(count, messages)):
        (out / f"seed-{c}.json").write_bytes(body)
