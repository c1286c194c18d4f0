"""Job configuration: dataclasses (`job_config`) and their TOML/CLI parser (`manager`)."""

from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import ConfigError, ConfigManager, last_wins, main_parse, to_toml

__all__ = ["ConfigError", "ConfigManager", "JobConfig", "last_wins", "main_parse", "to_toml"]
