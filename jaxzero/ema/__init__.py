"""The sharded model EMA: the averaging rule, its storage (per leaf or bucketed), and its
placement in the master weights' shards.

Import the public names from :mod:`jaxzero`; this package holds the implementation.
"""
