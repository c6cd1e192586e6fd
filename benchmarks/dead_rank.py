"""How long the survivors take to raise when one rank is SIGKILLed during a large all_to_all (issue 23 item 4).

Each run starts W gloo ranks (a fresh TCP store, process-group timeout `--timeout` s), lets them run
`commlib_torch.all_to_all` of `--mib` MiB per rank in a loop, SIGKILLs rank `--victim` at a seeded random
moment, and records for each survivor the seconds from the kill to its exception and the exception's type
(`CommFailure`: a lost connection; `CommTimeout`: the process-group timeout). Prints one JSON object.

    python benchmarks/dead_rank.py --runs 10 > benchmarks/results/<dir>/dead_rank.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import statistics
import time
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank: int, world_size: int, port: int, timeout: float, mib: float, started, replies) -> None:
    import torch
    import torch.distributed as dist

    import commlib_torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    x = torch.ones(int(mib * 2**20 / 4) // world_size * world_size)
    commlib_torch.all_to_all(x, 0, 0)  # connections made
    started.put(rank)
    try:
        while True:
            commlib_torch.all_to_all(x, 0, 0)
    except RuntimeError as error:
        replies.put((rank, time.time(), type(error).__name__, str(error)[:200]))
    replies.close()
    replies.join_thread()  # (the reply is written before the process ends)
    os._exit(0)  # (the group is broken: no clean shutdown)


def one_run(world_size: int, victim: int, timeout: float, mib: float, delay: float) -> dict:
    context = mp.get_context("spawn")
    started, replies = context.Queue(), context.Queue()
    port = _free_port()
    processes = [
        context.Process(target=_rank, args=(rank, world_size, port, timeout, mib, started, replies))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    for _ in range(world_size):
        started.get(timeout=120)
    time.sleep(delay)
    killed_at = time.time()
    os.kill(processes[victim].pid, signal.SIGKILL)
    seconds: dict[int, object] = {}
    deadline = time.time() + 2 * timeout + 30
    while len(seconds) < world_size - 1 and time.time() < deadline:
        try:
            rank, raised_at, kind, text = replies.get(timeout=max(0.1, deadline - time.time()))
        except Exception:
            break
        seconds[rank] = {"seconds": round(raised_at - killed_at, 2), "error": kind, "text": text}
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    return {
        "delay": round(delay, 2),
        "survivors": {str(rank): seconds.get(rank, "never raised") for rank in range(world_size) if rank != victim},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--mib", type=float, default=64.0, help="MiB of each rank's all_to_all input")
    parser.add_argument("--seed", type=int, default=23)
    args = parser.parse_args()
    draw = random.Random(args.seed)
    runs = [
        one_run(args.world_size, args.victim, args.timeout, args.mib, draw.uniform(0.2, 1.5)) for _ in range(args.runs)
    ]
    times = [
        survivor["seconds"] for run in runs for survivor in run["survivors"].values() if isinstance(survivor, dict)
    ]
    slowest = [
        max((s["seconds"] if isinstance(s, dict) else float("inf")) for s in run["survivors"].values()) for run in runs
    ]
    summary = {
        "survivor_seconds_sorted": sorted(times),
        "median": statistics.median(times) if times else None,
        "runs_whose_slowest_survivor_took_over_5s": sum(seconds > 5 for seconds in slowest),
        "runs_whose_slowest_survivor_reached_the_timeout": sum(seconds >= args.timeout - 1 for seconds in slowest),
    }
    print(json.dumps({"args": vars(args), "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
