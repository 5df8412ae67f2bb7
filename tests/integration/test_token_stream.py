"""Token stream over real pyzmq sockets: a decode-side process pushes per-step batches to the proxy's server."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from cluster.wire.token_stream import TokenStreamClient, TokenStreamServer


def _push(address: str, n_requests: int, n_steps: int) -> None:
    client = TokenStreamClient()
    for step in range(n_steps):
        batch = [{"request_id": f"r{r}", "token_ids": [step], "finish_reason": "length" if step == n_steps - 1 else None}
                 for r in range(n_requests)]
        batch.append({"request_id": "gone", "token_ids": [step]})
        client.send(address, batch)
    client.close()


def test_deltas_arrive_in_order_per_request_and_strays_are_dropped() -> None:
    async def main() -> None:
        server = TokenStreamServer()
        address = await server.start()
        queues = {f"r{r}": server.subscribe(f"r{r}") for r in range(10)}
        proc = mp.get_context("spawn").Process(target=_push, args=(address, 10, 50))
        proc.start()
        for rid, q in queues.items():
            got = []
            while True:
                d = await asyncio.wait_for(q.get(), timeout=30)
                got.extend(d["token_ids"])
                if d["finish_reason"]:
                    break
            assert got == list(range(50)), rid
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 30)
        assert proc.exitcode == 0
        assert server.messages_received == 50 and server.deltas_dropped == 50
        await server.close()

    asyncio.run(main())
