"""Serving one model over several processes (ranks), possibly on several machines.

``afmd launch`` (:mod:`.launch`) starts the ranks through MLX's launcher and owns their
process contract; each rank's process starts in :mod:`.rank`: rank 0 serves HTTP and leads
(:mod:`.lead`), the others follow; :mod:`.control` carries their heartbeats to rank 0.
"""
