"""Prints FreeToken's Python dependencies from pyproject.toml, one per line: the runtime ones, then those of each
extra named on the command line (``python scripts/dependencies.py test``). setup.sh installs them before it builds
the extension, so pip's download progress shows on its own."""

import os
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
for requirement in project["dependencies"] + [r for extra in sys.argv[1:] for r in extras[extra]]:
    print(requirement)
