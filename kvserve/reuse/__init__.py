"""Content (approximate) reuse: KV of a piece seen anywhere in earlier prompts, moved to where it
appears now and repaired (docs/blend.md).

The rest of kvserve imports this package, never its modules: `ContentReuse` (connector.py) is the
one interface the scheduler and the step talk to; the names below are the values that cross it.
Behind it: matcher.py (pieces, the index lookup, the cost-aware choice), plan.py and repair.py (what
a repair recomputes, pass by pass), repairer.py (moving KV in, selection), probe.py (the attention
probe of query-aware repair), audit.py (the online audit), verified.py (the verified presets `auto`
reads), cost.py (the step cost model plans are priced with), build.py (start-up and request checks).
"""

from kvserve.reuse.audit import AuditStats
from kvserve.reuse.build import build_content_reuse, check_reuse_request
from kvserve.reuse.connector import ContentReuse, ContentReuseStats, RepairDone
from kvserve.reuse.cost import CostModel, Work
from kvserve.reuse.matcher import Choice, MatcherStats
from kvserve.reuse.plan import ContentHit
from kvserve.reuse.probe import AttentionProbe, ProbingBackend
from kvserve.reuse.repair import Repair

__all__ = [
    "AttentionProbe",
    "AuditStats",
    "Choice",
    "ContentHit",
    "ContentReuse",
    "ContentReuseStats",
    "CostModel",
    "MatcherStats",
    "ProbingBackend",
    "Repair",
    "RepairDone",
    "Work",
    "build_content_reuse",
    "check_reuse_request",
]
