"""The one error type users see for bad input."""


class ConfigError(ValueError):
    """Raised for a misconfiguration, before any rank is spawned where possible.

    The message names the parameter, the value it got and what is accepted.
    """
