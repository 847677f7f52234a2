"""`h2o-chat batch`: JSONL in, results appended as each row finishes."""
