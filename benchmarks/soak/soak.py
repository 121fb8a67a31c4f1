"""Soak test: steady load through the gateway of an `ember up` fleet for a given time, sampling the
processes' health, then checking that nothing grows without bound.

    python benchmarks/soak/soak.py --duration 1800 --concurrency 4 --out soak-results

It writes a fleet file (a gateway and --replicas local `ember serve` replicas on free loopback ports,
async jobs with a short result TTL) into --out, starts `ember up` on it, and runs --concurrency
clients that loop over chat and completion requests (streamed and not, prompts that share a prefix)
and, every --async-every requests, an async job polled to its end. Every --sample-interval seconds it
records, per process (gateway, each replica): RSS and open file descriptors (/proc/PID), and per
replica the KV-cache blocks in use (`ember:kv_cache_usage_perc` on its /metrics); and the async job
store's rows (the SQLite file, read-only). After the load stops it waits for the replicas to go idle.

It passes (exit 0) when, for every process, the median RSS of the last 10% of the samples is within
--rss-tolerance of the median around the 25% mark (20-30% of the run: the warm-up is over), open fds
at the end are at most --fd-slack above those at the 25% mark, every replica's KV usage is 0 once idle,
no process restarted, no request failed, and the job store holds no finished job older than its TTL
plus the sweeper's interval. Samples go to samples.csv, the verdict to summary.json (both in --out).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import itertools
import json
import os
import secrets
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

MODEL = "smollm2-135m-instruct"
RESULT_TTL_S = 60.0
# The job sweeper deletes expired results once a minute (ember/gateway/jobs/worker.py CLEANUP_INTERVAL_S).
SWEEP_INTERVAL_S = 60.0
# Two system prompts, so prefix-cache routing spreads the load over the replicas and their caches get hits.
SHARED_PREFIXES = [
    "You are a concise assistant for a hardware shop. Answer in one short sentence, without lists, "
    "and never repeat the question. Customer question: ",
    "You answer questions from home-repair beginners. Be friendly, give one practical tip, and keep "
    "the answer under thirty words. The question is: ",
]
QUESTIONS = [
    "Which screwdriver fits a phone?",
    "Do you sell long extension cords?",
    "What glue holds wood and metal?",
    "How do I pick a drill bit for tiles?",
    "Is a cordless drill worth it?",
    "Which tape seals a leaking pipe?",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_fleet(out: Path, replicas: int, capacity: int, api_key: str) -> tuple[Path, int, list[int]]:
    gateway_port = free_port()
    replica_ports = [free_port() for _ in range(replicas)]
    fleet = {
        "models": {
            MODEL: {
                "routing": {"policy": "prefix-cache"},
                "deployments": [{
                    "name": "stable",
                    "replicas": [
                        {"url": f"http://127.0.0.1:{port}", "id": f"replica-{port}", "capacity": capacity}
                        for port in replica_ports
                    ],
                }],
            }
        },
        "keys": {"inline": [{"name": "soak", "sha256": hashlib.sha256(api_key.encode()).hexdigest()}]},
        "health": {"interval_s": 2.0, "timeout_s": 5.0, "unhealthy_threshold": 3},
        "async": {"store": "jobs.db", "jobs": {"result_ttl_s": RESULT_TTL_S}},
        "launch": {
            "gateway": {"host": "127.0.0.1", "port": gateway_port},
            "replicas": [{"port": port, "model": MODEL} for port in replica_ports],
        },
    }  # fmt: skip
    path = out / "fleet.yaml"
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path, gateway_port, replica_ports


# --- the processes under test -------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def fleet_processes(up_pid: int, gateway_port: int, replica_ports: list[int]) -> dict[str, int]:
    """name -> pid of the gateway and each replica, found among `ember up`'s children by their --port."""
    names = {str(gateway_port): "gateway", **{str(port): f"replica-{port}" for port in replica_ports}}
    found = {}
    for pid in children_of(up_pid):
        argv = cmdline(pid)
        if "--port" in argv:
            name = names.get(argv[argv.index("--port") + 1])
            if name is not None:
                found[name] = pid
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def kv_cache_usage(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("ember:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError("the replica's /metrics has no ember:kv_cache_usage_perc")


def job_store_rows(store: Path, stale_before: float) -> tuple[int, int]:
    """(all jobs, finished async jobs older than the TTL plus one sweep), read-only."""
    if not store.exists():
        return 0, 0
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5) as conn:
        total = conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
        stale = conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE kind = 'async' AND finished_at < ?", (stale_before,)
        ).fetchone()[0]
    return total, stale


# --- load ---------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    ok: int = 0
    async_jobs: int = 0
    failures: list[str] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, number: int, stats: LoadStats, async_every: int) -> None:
    prompt = SHARED_PREFIXES[number // 2 % 2] + QUESTIONS[number % len(QUESTIONS)]
    chat = number % 2 == 0
    body: dict = {"model": MODEL, "max_tokens": 16 + number % 17, "temperature": 0.7, "seed": number}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    endpoint = "chat/completions" if chat else "completions"
    if async_every and number % async_every == 0:
        await async_job(client, endpoint, body, stats)
        return
    if number % 3 == 0:
        body["stream"] = True
        async with client.stream("POST", f"/v1/{endpoint}", json=body) as response:
            text = (await response.aread()).decode()
            if response.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                stats.failures.append(f"stream {endpoint}: {response.status_code} {text[-200:]}")
                return
    else:
        response = await client.post(f"/v1/{endpoint}", json=body)
        if response.status_code != 200:
            stats.failures.append(f"{endpoint}: {response.status_code} {response.text[:200]}")
            return
    stats.ok += 1


async def async_job(client: httpx.AsyncClient, endpoint: str, body: dict, stats: LoadStats) -> None:
    response = await client.post(f"/v1/async/{endpoint}", json=body)
    if response.status_code != 202:
        stats.failures.append(f"async {endpoint}: {response.status_code} {response.text[:200]}")
        return
    job_id = response.json()["id"]
    while True:
        job = (await client.get(f"/v1/async/jobs/{job_id}")).json()
        if job.get("status") in ("succeeded", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.5)
    if job["status"] != "succeeded":
        stats.failures.append(f"async job {job_id}: {job['status']} {job.get('error')}")
        return
    stats.async_jobs += 1


async def client_loop(client: httpx.AsyncClient, numbers, stop_at: float, stats: LoadStats, async_every: int):
    while time.monotonic() < stop_at:
        try:
            await one_request(client, next(numbers), stats, async_every)
        except httpx.HTTPError as exc:
            stats.failures.append(f"{type(exc).__name__}: {exc}")


# --- sampling and verdict -----------------------------------------------------------------------


async def take_sample(http: httpx.AsyncClient, pids: dict[str, int], replica_ports: list[int], store: Path,
                      started: float, stats: LoadStats) -> dict:  # fmt: skip
    sample: dict = {"t_s": round(time.monotonic() - started, 1), "requests_ok": stats.ok, "async_jobs": stats.async_jobs}
    for name, pid in pids.items():
        sample[f"{name}_rss_mib"] = round(rss_mib(pid), 1)
        sample[f"{name}_fds"] = open_fds(pid)
    for port in replica_ports:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        sample[f"replica-{port}_kv_usage"] = kv_cache_usage(text)
    sample["jobs_rows"], sample["jobs_stale"] = job_store_rows(store, time.time() - RESULT_TTL_S - SWEEP_INTERVAL_S - 10)
    return sample


def window_median(samples: list[dict], column: str, start: float, end: float) -> float:
    count = len(samples)
    chosen = samples[int(count * start) : max(int(count * end), int(count * start) + 1)]
    return statistics.median(sample[column] for sample in chosen)


def verdict(samples: list[dict], idle: dict, pids: dict[str, int], args: argparse.Namespace, stats: LoadStats,
            restarted: list[str]) -> dict:  # fmt: skip
    checks: dict[str, dict] = {}
    for name in pids:
        warm = window_median(samples, f"{name}_rss_mib", 0.20, 0.30)
        last = window_median(samples, f"{name}_rss_mib", 0.90, 1.0)
        growth = (last - warm) / warm
        checks[f"{name} RSS flat"] = {"ok": growth <= args.rss_tolerance, "rss_25pct_mib": warm,
                                      "rss_last10pct_mib": last, "growth": round(growth, 4)}  # fmt: skip
        fds_warm = samples[int(len(samples) * 0.25)][f"{name}_fds"]
        fds_end = idle[f"{name}_fds"]
        checks[f"{name} fds flat"] = {"ok": fds_end <= fds_warm + args.fd_slack, "fds_25pct": fds_warm, "fds_idle": fds_end}
    for port in args.replica_ports:
        usage = idle[f"replica-{port}_kv_usage"]
        checks[f"replica-{port} KV blocks free when idle"] = {"ok": usage == 0.0, "kv_usage_idle": usage}
    stale = max(sample["jobs_stale"] for sample in [*samples, idle])
    checks["job store within TTL"] = {"ok": stale == 0, "max_stale_rows": stale,
                                      "max_rows": max(sample["jobs_rows"] for sample in samples)}  # fmt: skip
    checks["no process restarted"] = {"ok": not restarted, "restarted": restarted}
    checks["no failed request"] = {"ok": not stats.failures, "failures": len(stats.failures),
                                   "first": stats.failures[:5]}  # fmt: skip
    return checks


async def soak(args: argparse.Namespace, up: subprocess.Popen, gateway_port: int, store: Path) -> int:
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    headers = {"Authorization": f"Bearer {args.api_key}"}
    timeout = httpx.Timeout(args.request_timeout)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with (
        httpx.AsyncClient(base_url=gateway_url, headers=headers, timeout=timeout, limits=limits) as client,
        httpx.AsyncClient(timeout=10) as http,
    ):
        await wait_ready(http, up, gateway_url, args.replica_ports)
        pids = fleet_processes(up.pid, gateway_port, args.replica_ports)
        print(f"fleet ready: {pids}", flush=True)
        stats = LoadStats()
        started = time.monotonic()
        stop_at = started + args.duration
        numbers = itertools.count()
        clients = [
            asyncio.create_task(client_loop(client, numbers, stop_at, stats, args.async_every))
            for _ in range(args.concurrency)
        ]
        samples: list[dict] = []
        restarted: list[str] = []
        with open(args.out / "samples.csv", "w", newline="") as csv_file:
            writer = None
            while time.monotonic() < stop_at:
                await asyncio.sleep(min(args.sample_interval, max(0.0, stop_at - time.monotonic())))
                now_pids = fleet_processes(up.pid, gateway_port, args.replica_ports)
                if now_pids != pids:
                    restarted.append(f"{time.monotonic() - started:.0f}s: {pids} -> {now_pids}")
                    break
                sample = await take_sample(http, pids, args.replica_ports, store, started, stats)
                samples.append(sample)
                if writer is None:
                    writer = csv.DictWriter(csv_file, fieldnames=list(sample))
                    writer.writeheader()
                writer.writerow(sample)
                csv_file.flush()
                print(json.dumps(sample), flush=True)
            await asyncio.gather(*clients)
        idle = await wait_idle(http, pids, args.replica_ports, store, started, stats)
    checks = verdict(samples, idle, pids, args, stats, restarted)
    passed = all(check["ok"] for check in checks.values())
    summary = {"passed": passed, "duration_s": args.duration, "concurrency": args.concurrency,
               "requests_ok": stats.ok, "async_jobs": stats.async_jobs, "samples": len(samples),
               "idle": idle, "checks": checks}  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if passed else 1


async def wait_ready(http: httpx.AsyncClient, up: subprocess.Popen, gateway_url: str, replica_ports: list[int]) -> None:
    deadline = time.monotonic() + 600
    urls = [f"{gateway_url}/ready", *(f"http://127.0.0.1:{port}/health" for port in replica_ports)]
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"ember up exited with {up.returncode}")
        try:
            statuses = [(await http.get(url)).status_code for url in urls]
            if all(status == 200 for status in statuses):
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(1)
    raise SystemExit("the fleet was not ready after 600 s")


async def wait_idle(http, pids, replica_ports, store, started, stats, timeout_s: float = 60.0) -> dict:
    """The first sample with every replica's KV usage at 0 (or the last one after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sample = await take_sample(http, pids, replica_ports, store, started, stats)
        idle = all(sample[f"replica-{port}_kv_usage"] == 0.0 for port in replica_ports)
        if idle or time.monotonic() > deadline:
            return sample
        await asyncio.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800, help="Seconds of load (default 1800)")
    parser.add_argument("--concurrency", type=int, default=4, help="Clients sending at once (default 4)")
    parser.add_argument("--replicas", type=int, default=2, help="Local replicas (default 2)")
    parser.add_argument("--async-every", type=int, default=10, help="Every Nth request is an async job (0: none)")
    parser.add_argument("--sample-interval", type=float, default=10, help="Seconds between samples (default 10)")
    parser.add_argument("--rss-tolerance", type=float, default=0.10, help="Allowed RSS growth (default 0.10)")
    parser.add_argument("--fd-slack", type=int, default=8, help="Allowed extra open fds at the end (default 8)")
    parser.add_argument("--request-timeout", type=float, default=300, help="Per-request timeout, seconds")
    parser.add_argument("--out", type=Path, default=Path("soak-results"), help="Folder for the fleet file and results")
    args = parser.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.api_key = "sk-soak-" + secrets.token_hex(8)
    fleet_path, gateway_port, args.replica_ports = write_fleet(args.out, args.replicas, args.concurrency, args.api_key)
    log = open(args.out / "fleet.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "ember.cli", "up", str(fleet_path)], stdout=log,
                          stderr=subprocess.STDOUT, cwd=args.out)  # fmt: skip
    try:
        return asyncio.run(soak(args, up, gateway_port, args.out / "jobs.db"))
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
