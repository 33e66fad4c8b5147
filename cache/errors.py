"""The one exception type of the cache package."""


class CacheError(ValueError):
    """A cache on disk is missing, inconsistent, corrupt or does not match what is asked of it."""
