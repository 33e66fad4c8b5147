"""UserError, alone at the bottom of `pipeline/`: what `lock` raises and `errors` maps to exit code 2 (errors.py's
table), kept out of errors.py so that the modules `errors` reaches (cache_status, lock) need not import it back."""


class UserError(Exception):
    """A problem the user caused and can fix; the message says what and how."""
