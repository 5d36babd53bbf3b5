"""The configuration each part of kvserve receives: one frozen slice of ServeConfig per owner (model,
KV cache, KV tiers, content reuse, scheduler, server), as vLLM hands its parts a ModelConfig, a
CacheConfig and so on. Each slice defines its fields (defaults and help: field name == CLI flag ==
YAML key) and checks them; ServeConfig (config.py) is all of them in one flat value, the one users
write, and adds the checks that span slices. A part imports only the slice it reads, so the KV cache
knows nothing of repairs and the scheduler nothing of Redis (tests/unit/test_import_layers.py)."""

from kvserve.config_slices.cache import CacheConfig
from kvserve.config_slices.model import ModelConfig
from kvserve.config_slices.reuse import ReuseConfig
from kvserve.config_slices.scheduler import SchedulerConfig
from kvserve.config_slices.server import ServerConfig
from kvserve.config_slices.tiers import TierConfig

SLICES = (ModelConfig, CacheConfig, TierConfig, ReuseConfig, SchedulerConfig, ServerConfig)

__all__ = [
    "SLICES",
    "CacheConfig",
    "ModelConfig",
    "ReuseConfig",
    "SchedulerConfig",
    "ServerConfig",
    "TierConfig",
]
