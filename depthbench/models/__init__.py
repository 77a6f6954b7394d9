"""Models: the config dataclass (config), the shared backbone (base), the registry and one module
per architecture (archs/)."""
