"""ZeRO stages as sharding rules: the config (:class:`ZeRO`), the per-leaf spec rule, the
collectives run inside ``shard_map``, and stage 3's per-layer gather.

Import the public names from :mod:`jaxzero`; this package holds the implementation.
"""
