"""Errors raised on bad input, each naming the offending field or file."""


class DepthBenchError(Exception):
    """Base class for every error DepthBench raises on purpose."""


class ConfigError(DepthBenchError):
    """A config value is invalid. The message starts with the dotted field path."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"config field '{field}': {message}")


class DataError(DepthBenchError):
    """A corpus, shard or tokenizer file is missing or malformed."""


class CheckpointError(DepthBenchError):
    """A checkpoint cannot be read or does not belong to this run."""
