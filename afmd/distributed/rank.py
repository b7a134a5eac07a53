"""``afmd serve`` as one rank of a launched group: rank 0 serves, the others follow."""

from __future__ import annotations

import faulthandler
import signal

from afmd.config.load import Config
from afmd.distributed.env import backend, write_outcome, write_pid


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
        from afmd.distributed.follow import follow

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
