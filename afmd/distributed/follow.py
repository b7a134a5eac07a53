"""A rank other than 0, as a process: check in with rank 0, load the shard, follow.

It serves nothing itself. Its exit code is 0 when rank 0 told it to stop, 1 otherwise
(rank 0 gone, the group broken, its shard failed to load): ``afmd launch`` reads rank 0's
outcome, and a follower's failure reaches rank 0 as a lost rank.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from afmd.config.load import Config
from afmd.distributed.control import BEAT_INTERVAL_S, LOADING, Heartbeat
from afmd.distributed.env import leader_host
from afmd.logs import get_logger

log = get_logger("afmd.distributed")


def _leader_lost() -> None:
    # Nothing to do without rank 0; its launcher restarts the whole group.
    log.error("rank 0 is gone: exiting")
    logging.shutdown()
    os._exit(1)


def follow(config: Config, group: Any) -> int:
    """Run this rank until rank 0 says stop; the exit code."""
    from afmd.engine.batch.stepper import Stepper
    from afmd.engine.kvcache.identity import model_identity
    from afmd.engine.sharded.follower import Follower
    from afmd.engine.sharded.sharding import drop_output_projection, folder_of, load_shard, memory

    port = int.from_bytes(group.share(), "little")
    report: dict[str, Any] = {"shard": LOADING, "memory": {}}
    sampled = [0.0]

    def describe() -> dict[str, Any]:
        # No MLX call on the heartbeat's thread: it must beat while a step runs.
        return dict(report)

    def refresh() -> None:
        now = time.monotonic()
        if now - sampled[0] >= BEAT_INTERVAL_S:
            report["memory"], sampled[0] = memory(), now

    beat = Heartbeat(group.rank, (leader_host(), port), describe, _leader_lost)
    beat.start()
    group.doorbell = beat
    try:
        entry = config.resolve_model(None)
        if entry is None:
            raise ValueError("no default model to shard")
        model, tokenizer, _, shard = load_shard(
            folder_of(entry), group, config.distributed.strategy
        )
        drop_output_projection(model)  # only rank 0 samples
        report["shard"] = shard.describe()
        refresh()
        beat.nudge()
        log.info("shard loaded", rank=group.rank, model=entry.id, shard=report["shard"])
        stepper = Stepper(
            model, tokenizer, name=entry.id,
            max_batch=config.queue.max_concurrent_requests,
            prompt_cache_bytes=config.cache.prompt_cache_bytes,
            prompt_cache_entries=config.cache.prompt_cache_entries,
            identity=model_identity(folder_of(entry), entry.id),
            block_tokens=config.cache.block_tokens,
            lockstep=group,
        )
        Follower(stepper, group, after_plan=refresh).run()
    except Exception as exc:  # the group is broken or this rank cannot take part
        log.error("rank stopped by a failure", rank=group.rank, error=str(exc))
        print(f"afmd: rank {group.rank}: {exc}", file=sys.stderr)
        return 1
    finally:
        beat.stop()
    log.info("rank stopped", rank=group.rank)
    return 0
