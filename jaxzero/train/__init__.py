"""The training state and the jitted ZeRO train step built from :class:`jaxzero.ZeRO`.

Import the public names from :mod:`jaxzero`; this package holds the implementation.
"""
