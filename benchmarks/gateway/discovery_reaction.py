"""The gateway's reaction time to an EndpointSlice change: from the moment the API server sends the
watch event to the moment the gateway's routing has changed.

    PYTHONPATH=. python benchmarks/gateway/discovery_reaction.py [--rounds 50]

Runs in one process on loopback: tests/deploy/fake_kube_api.py as the API server (it stamps each
event with time.monotonic() as it queues it on the watches), the real gateway discovering its
Service through the official client, a FakeReplica as the pod. A pool listener stamps the change:
`admit` (a pod turned Ready: includes the gateway's first health probe of it) and `remove` (a pod
turned not Ready or terminating: out of routing at once, then drained). Figures: docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "deploy"), str(ROOT / "tests" / "gateway")]

from fake_kube_api import FakeKubeApi  # noqa: E402
from gateway_harness import FakeReplica, GatewayServer, free_port, gateway_config, wait_until  # noqa: E402

SERVICE = "ember-tiny-main"


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    return f"median {statistics.median(ordered) * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        api = FakeKubeApi("ember").start()
        kubeconfig = Path(tmp) / "kubeconfig"
        kubeconfig.write_text(api.kubeconfig())
        os.environ["KUBECONFIG"] = str(kubeconfig)
        pod = FakeReplica("pod", port=free_port(), host="127.0.0.2").start()
        api.add_deployment(SERVICE, SERVICE, pod.server.port, lambda n: "127.0.0.2", replicas=1)
        (pod_name,) = api.pods
        replica_id = f"ember/{SERVICE}/{pod_name}"
        model = {"deployments": [{"name": "main", "discovery": {"kubernetes": {"service": SERVICE}}}]}
        # The default health settings of a gateway config: the probe interval does not matter here,
        # an admitted endpoint's first probe is sent at once.
        config = gateway_config({"tiny": model}, [{"name": "k", "secret": "k"}])
        config.pop("health")
        gateway = GatewayServer(config, Path(tmp))
        gateway.server.start()
        changed_at: dict[str, float] = {}
        gateway.dispatcher.pool.add_listener(lambda event, replica: changed_at.__setitem__(event, time.monotonic()))
        reactions: dict[str, list[float]] = {"admit": [], "remove": []}
        try:
            for _ in range(args.rounds):
                for ready, event in ((True, "admit"), (False, "remove")):
                    changed_at.pop(event, None)
                    api.set_ready(pod_name, ready)
                    wait_until(lambda event=event: event in changed_at, what=event)
                    reactions[event].append(changed_at[event] - api.last_event_at)
                    assert (gateway.dispatcher.pool.get(replica_id) is not None) == ready
                    time.sleep(0.02)
        finally:
            gateway.server.stop()
            pod.stop()
            api.stop()
    print(f"{args.rounds} rounds; event sent by the API server -> gateway routing changed")
    print(f"  pod Ready -> routed to (incl. first health probe): {percentiles(reactions['admit'])}")
    print(f"  pod not Ready / terminating -> out of routing:     {percentiles(reactions['remove'])}")


if __name__ == "__main__":
    main()
