"""The one error type users see for bad input."""


class ConfigError(ValueError):
    """Raised for a misconfiguration, before any rank is spawned where possible.

    The message names the parameter, the value it got and what is accepted.
    """


def bad_value(param: str, value, accepted: str) -> ConfigError:
    """Builds the standard message: parameter, value received, what is accepted."""
    return ConfigError(f"{param}={value!r} is not valid: {accepted}.")
