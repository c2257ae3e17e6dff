"""Preparation of the JSONL files the trainer and evaluator read (see docs/data.md).

Each output row is ``{"prompt", "label", "datasource"}``: the problem with the authors'
instruction suffix (the chat template is applied later by OpenRLHF), the answer the reward
compares against, and the name OpenRLHF's evaluation groups metrics by.
"""
