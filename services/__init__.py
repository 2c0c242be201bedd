"""specsplit: DFlash speculative decoding split into gateway, verifier and drafter services."""

__version__ = "0.1.0"
