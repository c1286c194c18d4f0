"""`python -m torchtitan.config [args]`: print the fully resolved config as TOML."""

import sys

from torchtitan.config.manager import main_parse, to_toml

if __name__ == "__main__":
    sys.stdout.write(to_toml(main_parse(sys.argv[1:])))
