"""KV connectors (implementations of `core.kv_connector.KVConnector`) and the disaggregation proxy.

Like the platforms and attention backends, each connector imports only `core` and the plugins' `hookimpl`
marker, and registers through pagellm's own `pagellm.plugins` entry points, as a vendor's would.
"""
