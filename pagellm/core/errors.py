"""pagellm's exception types. Every message says what to change."""


class PagellmError(Exception):
    """Base of every error pagellm raises on purpose."""


class ConfigError(PagellmError, ValueError):
    """A setting that cannot work; the message names the setting and the fix.

    `param` is the setting's name (a request field such as `temperature`, an engine option), set where the
    check is made, so a server can name the field in its error without reading the message."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class DeviceUnavailableError(ConfigError):
    """The requested device does not exist or cannot be used on this machine."""


class BackendUnsupportedError(ConfigError):
    """The requested attention backend does not exist or cannot run this model here."""


class QuantizationUnsupportedError(ConfigError):
    """The requested quantization method does not exist or cannot run here."""


class PluginError(PagellmError):
    """A plugin failed to load, declares an incompatible API version, or clashes with another."""
