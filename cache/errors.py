"""The one exception type of the cache package."""


class CacheError(ValueError):
    """A cache on disk is missing, inconsistent, corrupt or does not match what is asked of it."""


class FormatVersionError(CacheError):
    """A cache written in another `format.FORMAT_VERSION`: refused whole, never read in part."""
