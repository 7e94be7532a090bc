"""The small core: interfaces, config and selection. Imports nothing else of pagellm."""
