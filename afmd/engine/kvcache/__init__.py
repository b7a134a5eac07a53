"""The block KV cache: a prompt's KV state kept in fixed-size blocks of tokens, in RAM and
on disk, so that agents' long, re-sent conversations resume instead of recomputing.

One module per concept: :mod:`.chain` (what a block's key is), :mod:`.identity` (which
model a block belongs to), :mod:`.ram` and :mod:`.disk` (the two tiers),
:mod:`.disk_counts` (what the disk tier tells ``/metrics``), :mod:`.folder` (the disk
tier's layout, readable without MLX), :mod:`.blocks` (the prefix index that walks both
tiers), and :mod:`.compat` (the mlx-lm cache internals it reads and builds).
See docs/kv-cache.md.
"""
