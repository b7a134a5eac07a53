"""``afmd serve`` as one rank of a launched group: rank 0 serves, the others follow.

Rank 0 runs the whole HTTP server with its group's lead (:mod:`afmd.distributed.lead`);
every other rank is a process that serves nothing: it checks in with rank 0, loads its
shard and applies rank 0's plans (:class:`afmd.engine.sharded.follower.Follower`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import time
from typing import Any

from afmd.config.sections import Config
from afmd.distributed.control import BEAT_INTERVAL_S, LOADING, Heartbeat
from afmd.distributed.env import backend, leader_host, write_outcome, write_pid
from afmd.logs import get_logger

log = get_logger("afmd.distributed")


def serve_rank(config: Config) -> int:
    """Join the group, then serve (rank 0) or follow (the others); the exit code."""
    from afmd.engine.sharded.lockstep import join
    from afmd.server import run

    # `kill -USR2 <pid>` prints every thread's stack: how to see where a group hangs.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    group = join(backend())
    if group is None:  # a group of one: an ordinary server
        write_pid()
        code = run(config)
        write_outcome(code)
        return code
    if not group.leads:
        # A follower is stopped by rank 0's plan, or dies with the group: a signal from
        # the launcher tearing the group down ends it at once.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        return follow(config, group)
    from afmd.distributed.lead import GroupLead

    # MLX's launcher sends SIGTERM to every rank when one dies: rank 0 finds the loss
    # itself and exits 1. afmd launch stops it with SIGINT (see Server._stop_signals).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_pid()
    lead = GroupLead(config, group)
    code = run(config, group=lead)
    write_outcome(code, lead.lost or "")
    return code


def _leader_lost() -> None:
    # Nothing to do without rank 0; its launcher restarts the whole group.
    log.error("rank 0 is gone: exiting")
    logging.shutdown()
    os._exit(1)


def follow(config: Config, group: Any) -> int:
    """A rank other than 0: check in with rank 0, load the shard, and follow rank 0's
    plans until it says stop; the exit code.

    It serves nothing itself. Its exit code is 0 when rank 0 told it to stop, 1 otherwise
    (rank 0 gone, the group broken, its shard failed to load): ``afmd launch`` reads rank
    0's outcome, and a follower's failure reaches rank 0 as a lost rank.
    """
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
