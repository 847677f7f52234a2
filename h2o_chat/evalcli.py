"""`h2o-chat eval`: what a budget costs in quality (perplexity, needle retrieval, generation agreement).

No torch import at module level (start-up stays fast for --help).
"""

from __future__ import annotations

import typer

eval_app = typer.Typer(
    no_args_is_help=True,
    help="Measure what a cache budget costs in quality: perplexity, long-context retrieval, agreement.",
)
