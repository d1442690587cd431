"""Kept for imports of the old path: the sender now lives in :mod:`rankguard.client`."""

from ..client import DROP_REASONS, TelemetrySender

__all__ = ["DROP_REASONS", "TelemetrySender"]
