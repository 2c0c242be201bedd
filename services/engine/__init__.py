"""The engine: plain synchronous array math (formats, models, caches, sampling, speculation).

Nothing in here knows about gRPC or HTTP; services/ wrap it.
"""
