"""Time to first token through the gateway vs straight to the replica, measured back to back.

    python benchmarks/gateway/ttft.py --direct http://127.0.0.1:9101 --gateway http://127.0.0.1:9100 -n 300

One request at a time on a kept-alive connection per target, alternating direct / gateway so that
load drifting on a shared machine hits both alike. TTFT = request written -> first `data:` event
read. Prints p50/p90 of each and of the paired differences (the gateway's added TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from urllib.parse import urlsplit

BODY = b'{"model":"stub","messages":[{"role":"user","content":"Say hello"}],"max_tokens":16,"stream":true}'


class Target:
    def __init__(self, base_url: str, api_key: str | None):
        parts = urlsplit(base_url)
        self.host, self.port = parts.hostname, parts.port
        auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + parts.netloc.encode() + b"\r\n" + auth
            + b"Content-Type: application/json\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
        )  # fmt: skip
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def ttft(self) -> float:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        started = time.perf_counter()
        self.writer.write(self.request)
        buffer = b""
        while b"data:" not in buffer:
            buffer += await self.reader.read(65536)
        first = time.perf_counter() - started
        while not buffer.endswith(b"0\r\n\r\n"):  # drain the rest of the chunked response
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("server closed the stream")
            buffer += chunk
        return first


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--direct", required=True, help="base URL of the streaming stub upstream")
    parser.add_argument("--gateway", required=True, help="base URL of the gateway in front of it")
    parser.add_argument("--api-key", default="sk-bench", help="gateway API key")
    parser.add_argument("-n", type=int, default=300, help="requests per target")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured requests per target first")
    args = parser.parse_args()
    direct, gateway = Target(args.direct, None), Target(args.gateway, args.api_key)
    for _ in range(args.warmup):
        await direct.ttft()
        await gateway.ttft()
    direct_ms, gateway_ms = [], []
    for _ in range(args.n):
        direct_ms.append(await direct.ttft() * 1000)
        gateway_ms.append(await gateway.ttft() * 1000)
    added = [g - d for g, d in zip(gateway_ms, direct_ms, strict=True)]
    for name, values in (("direct", direct_ms), ("gateway", gateway_ms), ("added (paired)", added)):
        print(f"{name:>15}: p50 {statistics.median(values):7.3f} ms   p90 {percentile(values, 0.9):7.3f} ms")
    print(f"{'added (p50-p50)':>15}: {statistics.median(gateway_ms) - statistics.median(direct_ms):7.3f} ms")


if __name__ == "__main__":
    asyncio.run(main())
