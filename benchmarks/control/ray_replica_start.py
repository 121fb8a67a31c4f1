"""Replica start time on Ray: actor requested -> `ember serve` started in it -> first token.

    python benchmarks/control/ray_replica_start.py [--model smollm2-135m-instruct] [--rounds 3]

Starts a local Ray head (2 CPUs, 100 MB object store, no dashboard), then for each round asks for one
`ServeProcess` actor (num_cpus=1) exactly as the Ray provider does, and times (1) the actor's
`start()` returning the replica's URL (Ray placed the actor and it spawned `ember serve`), (2) the
first streamed token of a one-token chat completion sent directly to that URL. The same rounds run
without Ray (the same `ServeProcess` class called in this process) to show what Ray adds. Prints one
JSON line per round and a summary (medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx
import ray

from ember.control.autoscaling.ray_provider import ServeActor, ServeProcess

KEY = "sk-bench"


def first_token(url: str, model: str, deadline_s: float = 300.0) -> float:
    """Polls until the server streams its first token; returns the time it arrived (monotonic)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1, "stream": True}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                              headers={"authorization": f"Bearer {KEY}"}) as response:  # fmt: skip
                if response.status_code == 200:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no first token from {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    argv = [sys.executable, "-m", "ember.cli", "serve", "--model", args.model, "--served-model-name", "m",
            "--num-threads", "1"]  # fmt: skip
    env = {"EMBER_API_KEY": KEY}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    results: dict[str, list[dict]] = {"ray": [], "local": []}
    for round_ in range(args.rounds):
        for where in ("ray", "local"):
            started = time.monotonic()
            if where == "ray":
                actor = ServeActor.options(num_cpus=1).remote(argv, env)
                url = ray.get(actor.start.remote())
            else:
                process = ServeProcess(argv, env)
                url = process.start()
            serving = time.monotonic()
            token = first_token(url, "m")
            row = {"round": round_, "where": where, "to_process_s": round(serving - started, 3),
                   "to_first_token_s": round(token - started, 3)}  # fmt: skip
            print(json.dumps(row), flush=True)
            results[where].append(row)
            if where == "ray":
                ray.get(actor.stop.remote(30))
                ray.kill(actor)
            else:
                process.stop(30)
    for where, rows in results.items():
        print(f"{where}: median to process {statistics.median(r['to_process_s'] for r in rows):.2f}s, "
              f"to first token {statistics.median(r['to_first_token_s'] for r in rows):.2f}s "
              f"over {len(rows)} rounds")  # fmt: skip
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
