"""``python -m tests.deepspeed_corpus``: which corpus entries work on meshzero.deepspeed."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.deepspeed_corpus.runner import main_env, run_all, score, table


def main() -> None:
    main_env()
    with tempfile.TemporaryDirectory(prefix="ds_corpus_") as tmp:
        print(table(score(run_all(Path(tmp)))))


if __name__ == "__main__":
    main()
