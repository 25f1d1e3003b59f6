"""Ranks for the context-parallel tests: `run(world, fn, *args)` spawns `world` processes
joined in a gloo process group (a FileStore in a fresh folder), runs ``fn(rank, world,
*args)`` in each and returns their results in rank order. A rank's exception is re-raised
here with its traceback; ranks still running after `timeout` seconds are killed and the call
fails, so a test proves "no rank hangs" by returning."""

import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _entry(rank, world, store_path, out_dir, fn, args):
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:      # reported to the parent, which raises it
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run(world: int, fn, *args, timeout: float = 60.0, allow_errors: bool = False):
    """Results of ``fn(rank, world, *args)`` per rank. With `allow_errors`, a rank's error
    comes back as ("error", message) instead of being raised."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, world, os.path.join(tmp, "store"), tmp,
                                                   fn, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise AssertionError(f"ranks {hung} of {world} did not finish in {timeout} s")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"{r}.pkl")
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} died without a result (exit code "
                                     f"{procs[r].exitcode})")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    if not allow_errors:
        for r, (status, value) in enumerate(results):
            if status == "error":
                raise AssertionError(f"rank {r}: {value}")
        return [value for _, value in results]
    return results
