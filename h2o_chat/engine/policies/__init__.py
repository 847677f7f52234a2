"""Who is evicted. A policy ranks cached tokens by a keep-priority; this room holds what the user chooses
(`kinds`: frozen, validated `Policy` dataclasses and `make_policy`), what the cache computes with (`rules`: every
row's policy as tensors), the one place where victims are chosen and slots move (`evict`), snap's reading of a
prompt with its last queries (`snap`) and recall's ranking of evicted tokens (`recall_rank`).

The names below are the policies' public surface; none of them imports torch (the command line reads them
before deciding to load any).
"""

from h2o_chat.engine.policies.kinds import (
    DEFAULT_POLICY,
    DROP_RULES,
    H2O,
    INF,
    POLICIES,
    STORE_MIN_TIMES,
    STORE_TIMES,
    Full,
    Policy,
    Recall,
    Recent,
    Sink,
    Snap,
    default_snap_window,
    make_policy,
    with_budget,
)
from h2o_chat.engine.policies.rules import Rules, pool_logits

__all__ = [
    "DEFAULT_POLICY", "DROP_RULES", "INF", "POLICIES", "STORE_MIN_TIMES", "STORE_TIMES", "H2O", "Full", "Policy",
    "Recall", "Recent", "Sink", "Snap", "Rules", "default_snap_window", "make_policy", "pool_logits", "with_budget",
]  # fmt: skip
