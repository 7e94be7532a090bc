"""An example vendor package for pagellm: the `vendor_sim` device, `VENDOR_ATTN` and `vendor_int8`.

Nothing here is imported by pagellm directly; pagellm finds `pagellm_vendor_example.plugin` through the
`pagellm.plugins` entry point in this package's pyproject.toml.
"""
