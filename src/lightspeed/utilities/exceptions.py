"""Lightning's exception names. `MisconfigurationException` is lightspeed's ConfigError itself (not
a subclass), so `except MisconfigurationException` catches every misconfiguration lightspeed
reports."""

import re

from lightspeed.errors import ConfigError

MisconfigurationException = ConfigError


def _augment_message(exception: BaseException, pattern: str, new_message: str) -> None:
    """Replaces, in place, each string argument of `exception` that matches the regex `pattern`
    (fully, as `re.match` on the whole text) with `new_message`; other arguments stay."""
    exception.args = tuple(
        new_message if isinstance(arg, str) and re.match(pattern, arg, re.DOTALL) else arg
        for arg in exception.args
    )


__all__ = ["MisconfigurationException"]
