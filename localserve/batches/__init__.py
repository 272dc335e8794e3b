"""The Batch API (OpenAI's /v1/files and /v1/batches): durable state, input validation, the runner.

- `store.py`: SQLite in the data directory (WAL, schema version recorded) holding files' metadata,
  batches and one row per input line; every state change is one transaction.
- `files.py`: file contents in the data directory, written atomically.
- `jsonl.py`: what a batch input file must be (refused at create with a 400 naming the line).
- `lines.py`: one line through the same openai_api functions the HTTP routes use.
- `room.py`: the disk a batch may need (checked at create).
- `queues.py`: which batches may run at once (local models share one queue, upstream models not).
- `runner.py`: runs batches on the `batch` lane and finalizes them into output/error files.

Exactly once: a line's result is written to its row (result IS NULL -> set) in one transaction and
never re-run once set; output and error files are assembled from the rows only at finalize, under
ids derived from the batch id, so a daemon killed at any point re-runs only unfinished lines and
rewrites the same files on its next start.
"""
