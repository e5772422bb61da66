"""The error every config check raises. Its own module, so that the readers of config files (JSON, the peers' TOML
dataset files) and config_io, which calls them, import it without importing each other."""

# A config is a few kilobytes; this limit keeps a wrong file (a video, a dump) from costing memory or a traceback.
MAX_CONFIG_BYTES = 16 * 1024 * 1024


class ConfigError(Exception):
    """A config that cannot be used. `problems` holds one line per problem; scripts exit with code 2."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        super().__init__(f"invalid configuration{where}:\n" + "\n".join(f"  - {p}" for p in problems))
