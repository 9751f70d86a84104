"""Lightning's exception names. `MisconfigurationException` is lightspeed's ConfigError itself (not
a subclass), so `except MisconfigurationException` catches every misconfiguration lightspeed
reports."""

from lightspeed.errors import ConfigError

MisconfigurationException = ConfigError

__all__ = ["MisconfigurationException"]
