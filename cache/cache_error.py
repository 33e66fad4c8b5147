"""The one exception type of the cache package."""


class CacheError(ValueError):
    """A cache on disk is missing, inconsistent, corrupt or does not match what is asked of it."""


class FormatVersionError(CacheError):
    """A cache written in another `format.FORMAT_VERSION`: refused whole, never read in part."""


class UnfinishedCacheError(CacheError):
    """A cache stage one has not finished (parts, no manifest). The CLI's line names each unfinished part and the
    command that finishes it (pipeline/cache_status.py, from the parts' progress and `pipeline.lock.live_writers`)."""

    def __init__(self, cache_dir, message: str):
        super().__init__(message)
        self.cache_dir = cache_dir


class UnsafeFileError(CacheError):
    """A path of a cache that is a symbolic link, or a file that is not a regular file (a FIFO, a device): refused
    whole, by every reader and `cache verify` alike (`safe_open`), never followed or read."""
