"""The deploy tests import their helpers (helm_renderer, fake_kube_api) from this folder."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))  # gateway_harness: FakeReplica, GatewayServer
