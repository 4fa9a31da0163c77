"""Loads pdserve_mc.jsonl (next to this file) for the pdserve_mc lm-eval task, offline."""

import json
from pathlib import Path


def load(**_kwargs):
    import datasets  # lm-eval's environment, not pdserve's

    path = Path(__file__).with_name("pdserve_mc.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
